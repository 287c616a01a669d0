"""``metasd bench --executor ray`` on tiny models and a local 2-CPU Ray: the same tokens and MLflow layout as the
in-process executor, Ctrl-C on the driver then --resume, and a worker killed mid-shard.

The Ray tests are skipped when ray is not installed (pip install -e '.[ray]'); CI sets METASD_REQUIRE_RAY=1,
which turns a missing ray into a failure instead.
"""
import json
import os
import re
import sys

import pytest
import yaml

from metasd.config import ConfigError
from metasd.bench.experiment import load_experiment
from metasd.bench import ExperimentInterrupted, run_experiment
from test_runner import N_REQUESTS, _artifact_lines, _children, _experiment
from tiny import tiny_qwen, tiny_tokenizer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

try:
    import ray
except ImportError:
    ray = None
    if os.environ.get("METASD_REQUIRE_RAY") == "1":
        raise ImportError("METASD_REQUIRE_RAY=1 but ray is not installed: pip install -e '.[ray]'") from None

needs_ray = pytest.mark.skipif(ray is None, reason="ray not installed (pip install -e '.[ray]'); CI requires it")

QUESTIONS = [
    {"question_id": "q1", "category": "writing", "turns": ["w10 w11 w12 w13 w10 w11", "w20 w21 w22"]},
    {"question_id": "q2", "category": "translation", "turns": ["w30 w31 w32 w30 w31 w32 w30"]},
    {"question_id": "q3", "category": "qa", "turns": ["w40 w41 w42 w43"]},
]
RUNS = [{"policy": {"name": "ucb", "params": {"c": 1.0}}, "reward": "block_efficiency", "granularity": "step"},
        {"name": "ucb-persistent", "policy": {"name": "ucb", "params": {"c": 1.0}}, "reward": "block_efficiency",
         "persistent": True},
        {"single": True}, {"oracle": True}]
N_RUNS = 5  # plain, ucb, ucb-persistent, single:small, single:ngram


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    tok = tiny_tokenizer()
    for name in ("verifier", "drafter"):  # the drafter has the verifier's weights: all accepted
        tiny_qwen(seed=0).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    with open(root / "questions.jsonl", "w") as f:
        for q in QUESTIONS:
            f.write(json.dumps(q) + "\n")
    return root


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray (2 CPUs) for the module: starting one costs seconds. It also declares one GPU, which this
    machine need not have: Ray schedules it as a resource (an actor reserving it is shown it as
    CUDA_VISIBLE_DEVICES=0), so reservations are tested; workers that reserve none never see it. Ray's driver
    replaces ``builtins.print`` (ray.experimental.tqdm_ray's safe_print) once it prints a worker's log line, for the
    rest of the process: put back after the session, so files after this one print as they would alone (conftest
    checks it)."""
    import builtins

    original_print = builtins.print
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, object_store_memory=80 * 1024 * 1024, logging_level="ERROR",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
    builtins.print = original_print


def _write(store, name, **over):
    path = store / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_experiment(store, name, runs=RUNS, **over)))
    return path


def _logged_once(client, res, tmp_path):
    """Every nested run holds each request exactly once: records, JSONL artifact and metric steps."""
    kids = _children(client, res.experiment_id, res.parent_run_id)
    assert len(kids) == N_RUNS
    for key, run in kids.items():
        assert run.info.status == "FINISHED", key
        lines = _artifact_lines(client, run.info.run_id, tmp_path)
        assert [(r["question_id"], r["turn"], r["index"]) for r in lines] == [
            ("q1", 0, 0), ("q1", 1, 1), ("q2", 0, 2), ("q3", 0, 3)], key
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "tokens_per_second")]
        assert sorted(steps) == [0, 1, 2, 3], key  # one metric point per request: nothing logged twice
    return kids


@needs_ray
def test_ray_gives_inprocess_tokens_and_mlflow_layout(store, ray_session, tmp_path, capsys):
    from mlflow import MlflowClient

    from metasd.cli import main

    pool = _experiment(store, "same")["pools"][0]
    path = _write(store, "same", plots=True, pools=[pool, {**pool, "name": "tiny2"}])  # workers hold one pool at a time
    uri_in, uri_ray = f"sqlite:///{tmp_path}/in.db", f"sqlite:///{tmp_path}/ray.db"
    ref = run_experiment(path, tracking_uri=uri_in, progress=False)
    assert main(["bench", str(path), "--executor", "ray", "--workers", "2", "--tracking-uri", uri_ray, "--no-progress"]) == 0
    out = capsys.readouterr().out
    c_in, c_ray = MlflowClient(uri_in), MlflowClient(uri_ray)
    (parent,) = c_ray.search_runs([c_ray.get_experiment_by_name("same").experiment_id], "tags.`metasd.kind` = 'experiment'")
    kids_in = _children(c_in, ref.experiment_id, ref.parent_run_id)
    kids = _children(c_ray, parent.info.experiment_id, parent.info.run_id)
    assert sorted(kids) == sorted(kids_in) and len(kids) == 2 * N_RUNS
    workers, served = {}, {}  # (pool, question) -> workers; method key -> the workers that answered its requests
    for key, run in kids.items():
        assert run.info.status == "FINISHED"
        mine = _artifact_lines(c_ray, run.info.run_id, tmp_path / "ray")
        theirs = _artifact_lines(c_in, kids_in[key].info.run_id, tmp_path / "in")
        # per request and method: the same prompt, tokens and text as in-process, in the same order
        assert [(r["question_id"], r["turn"], r["index"], r["prompt_sha"], r["token_ids"], r["text"]) for r in mine] == [
            (r["question_id"], r["turn"], r["index"], r["prompt_sha"], r["token_ids"], r["text"]) for r in theirs], key
        served[key] = {r["worker"] for r in mine}
        for r in mine:
            workers.setdefault((key.split("/")[0], r["question_id"]), set()).add(r["worker"])
            assert r.get("matches_plain", True) is True
        assert {f.path for f in c_ray.list_artifacts(run.info.run_id)} == {
            f.path for f in c_in.list_artifacts(kids_in[key].info.run_id)}, key
        assert run.data.params == kids_in[key].data.params
        assert set(run.data.metrics) == set(kids_in[key].data.metrics), key
    # every method of a question ran on one worker; both workers served questions
    assert all(len(w) == 1 for w in workers.values()) and set().union(*workers.values()) == {"0", "1"}
    assert {f.path for f in c_ray.list_artifacts(parent.info.run_id)} == {f.path for f in c_in.list_artifacts(ref.parent_run_id)}
    plots = lambda c, rid: {f.path.rsplit("/", 1)[-1] for f in c.list_artifacts(rid, "plots/tiny/q")}  # noqa: E731
    assert plots(c_ray, parent.info.run_id) == plots(c_in, ref.parent_run_id)
    assert parent.data.params == c_in.get_run(ref.parent_run_id).data.params  # same config hash, same params
    tags = parent.data.tags
    assert tags["metasd.executor"] == "ray" and tags["metasd.workers"] == "2" and tags["threads"] == "1"
    assert tags["metasd.policy_state"] == "per-worker" and tags["dtype"] == "float32"
    # the persistent policy's final state is one per worker, and the table says so
    state = json.load(open(c_ray.download_artifacts(
        kids["tiny2/q/ucb-persistent/seed0"].info.run_id, "policy_state.json", str(tmp_path / "st"))))
    # one state per worker that served this method's requests (which worker takes which shard depends on timing)
    assert state["scope"] == "per-worker" and set(state["workers"]) == served["tiny2/q/ucb-persistent/seed0"]
    assert "persistent policies (ucb-persistent) kept one state per worker (2 workers)" in out
    rows = lambda table: [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]  # noqa: E731
    assert rows(out) == rows(ref.table)  # the same methods (rows) and columns
    assert "| method | MT | translation | QA | overall |" in out and "### pool `tiny2`, dataset `q`" in out


@needs_ray
def test_ctrl_c_on_driver_then_resume_completes_without_duplicates(store, ray_session, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from metasd.bench.ray_executor import RayRunner

    real_take, taken = RayRunner._take, []

    def take_then_ctrl_c(self, shard, result):
        taken.append(shard.sid)
        if len(taken) == 2:  # Ctrl-C while the driver logs the second finished shard
            raise KeyboardInterrupt
        return real_take(self, shard, result)

    monkeypatch.setattr(RayRunner, "_take", take_then_ctrl_c)
    uri = f"sqlite:///{tmp_path}/resume.db"
    path = _write(store, "resume")
    with pytest.raises(ExperimentInterrupted) as info:
        run_experiment(path, tracking_uri=uri, progress=False, executor={"type": "ray", "workers": 2})
    client = MlflowClient(uri)
    run_id = info.value.run_id
    assert client.get_run(run_id).info.status == "KILLED"
    kids = _children(client, client.get_run(run_id).info.experiment_id, run_id)
    kept = sum(len(_artifact_lines(client, r.info.run_id, tmp_path / "k")) for r in kids.values()
               if client.list_artifacts(r.info.run_id))
    first = QUESTIONS[taken[0]]
    assert kept == len(first["turns"]) * N_RUNS  # exactly the one shard logged before Ctrl-C
    monkeypatch.setattr(RayRunner, "_take", real_take)
    done = run_experiment(path, tracking_uri=uri, resume=True, progress=False, executor="ray")
    assert done.parent_run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
    assert done.skipped == kept and done.generated == N_REQUESTS * N_RUNS - kept
    _logged_once(client, done, tmp_path)


def _die_on_second_request(marker: str):
    """Worker setup: the first worker to reach its second engine request exits at once (only one ever does)."""
    def setup():
        from metasd.core.engine import Engine

        real, calls = Engine.generate, []

        def generate(self, *a, **kw):
            calls.append(1)
            if len(calls) == 2:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    pass
                else:
                    os._exit(1)  # the worker process dies mid-shard
            return real(self, *a, **kw)

        Engine.generate = generate

    return setup


@needs_ray
def test_dead_worker_shard_is_retried_and_every_request_logged_once(store, ray_session, tmp_path, capsys):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/dead.db"
    marker = tmp_path / "died"
    res = run_experiment(_write(store, "dead"), tracking_uri=uri, progress=True,
                         executor={"type": "ray", "workers": 2}, worker_setup=_die_on_second_request(str(marker)))
    assert marker.exists()  # a worker did die
    client = MlflowClient(uri)
    parent = client.get_run(res.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["metasd.worker_restarts"] == "1"
    assert res.generated == N_REQUESTS * N_RUNS
    _logged_once(client, res, tmp_path)
    # the dead worker's shard was answered by its replacement (id "<slot>.1")
    assert any("." in r["worker"] for recs in res.records.values() for r in recs)
    # one progress bar over every request, with the live workers; the death and the replacement are reported
    # (whether a shard finishes before the death is seen - a "0 restarted" refresh - depends on timing)
    err = capsys.readouterr().err
    assert f"{N_REQUESTS * N_RUNS}/{N_REQUESTS * N_RUNS}" in err and re.search(r"[12]/2 workers live", err), err
    assert "1 restarted" in err and re.search(r"worker [01] died \(ActorDiedError\)", err), err


def test_ray_executor_without_ray_names_the_extra(store, tmp_path, monkeypatch, capsys):
    from metasd.cli import main
    from metasd.bench.ray_executor import RayNotInstalledError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    path = _write(store, "noray")
    with pytest.raises(RayNotInstalledError, match=r"pip install -e '\.\[ray\]'"):
        run_experiment(path, tracking_uri=f"sqlite:///{tmp_path}/x.db", progress=False, executor="ray")
    assert main(["bench", str(path), "--executor", "ray", "--tracking-uri", f"sqlite:///{tmp_path}/x.db"]) == 2
    assert "needs the 'ray' extra: pip install -e '.[ray]'" in capsys.readouterr().err
    from mlflow import MlflowClient

    assert MlflowClient(f"sqlite:///{tmp_path}/x.db").get_experiment_by_name("noray") is None  # nothing opened


def test_executor_field_and_flags_are_checked(store, tmp_path, capsys):
    from metasd.cli import main

    exp = load_experiment(_write(store, "exec", executor={"type": "ray", "workers": 3, "address": "auto"}))
    assert exp.config.executor.workers == 3 and exp.config.executor.address == "auto"
    # how an experiment runs is not what it is: the executor leaves the config hash (resume across executors) alone
    assert exp.config_hash() == load_experiment(_write(store, "exec")).config_hash()
    with pytest.raises(ConfigError, match=r"executor: .*'workers'.* apply to the ray executor only"):
        load_experiment(_write(store, "exec-bad", executor={"type": "inprocess", "workers": 2}))
    assert main(["bench", str(_write(store, "exec")), "--workers", "2", "--tracking-uri", f"sqlite:///{tmp_path}/y.db"]) == 2
    assert "--workers needs --executor ray" in capsys.readouterr().err


def _ray_bench_paused(pause_file: str, at: str, *argv: str) -> None:
    """Child: ``metasd bench ARGV`` (``--executor ray``) whose driver stops dead when handed finished shard number
    ``at`` to log, the shards before it logged: it writes ``pause_file`` and blocks until the test SIGKILLs it."""
    import threading
    from pathlib import Path

    from metasd.bench import ray_executor
    from metasd.cli import main

    real, taken = ray_executor.RayRunner._take, []

    def take(self, shard, result):
        taken.append(shard)
        if len(taken) == int(at):
            Path(pause_file).write_text("")
            threading.Event().wait()  # blocked until killed
        return real(self, shard, result)

    ray_executor.RayRunner._take = take
    sys.exit(main(list(argv)))


@needs_ray
def test_killed_driver_then_resume_completes_without_duplicates(store, ray_session, tmp_path):
    """SIGKILL the `metasd bench --executor ray` process mid-experiment (no Ctrl-C handler runs), then --resume."""
    import signal
    import subprocess
    import time

    from mlflow import MlflowClient

    questions = [{"question_id": f"k{i}", "category": "qa", "turns": [f"w{10 + i} w{20 + i} w{30 + i}"]} for i in range(12)]
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions))
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(_experiment(store, "killed", runs=RUNS, datasets=[{"name": "q", "path": str(data)}])))
    uri = f"sqlite:///{tmp_path}/killed.db"
    address = ray.get_runtime_context().gcs_address  # the driver joins this module's Ray
    argv = ["bench", str(path), "--executor", "ray", "--ray-address", address, "--workers", "2", "--tracking-uri", uri,
            "--no-progress"]
    pause = tmp_path / "paused"
    # the driver stops dead when handed its 3rd finished shard (2 logged), then is killed: no race with its progress
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_ray_executor as t; "
            "t._ray_bench_paused(*sys.argv[1:])")
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, str(pause), "3", *argv], stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while not pause.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert pause.exists(), f"the driver did not reach its 3rd shard:\n{(tmp_path / 'driver.log').read_text()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    client = MlflowClient(uri)
    assert proc.returncode == -signal.SIGKILL, "the experiment ended before it could be killed"
    done = run_experiment(path, tracking_uri=uri, resume=True, progress=False, executor="ray")
    assert 0 < done.skipped < len(questions) * N_RUNS and done.generated + done.skipped == len(questions) * N_RUNS
    for key, run in _children(client, done.experiment_id, done.parent_run_id).items():
        lines = _artifact_lines(client, run.info.run_id, tmp_path / "dl")
        assert [r["index"] for r in lines] == list(range(len(questions))), key  # each request once, in order
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "tokens_per_second"))
        assert steps == list(range(len(questions))), key  # one metric point per request (metasd.bench.tracking's journal)


# ---------------------------------------------------------------------------------------------------- GPUs

@needs_ray
def test_workers_reserve_their_gpu_share_and_report_it(store, ray_session, tmp_path, capsys):
    """--gpus-per-worker 0.5: two workers share the cluster's one GPU (Ray's num_gpus reaches the actors: each is
    shown GPU 0); the pool names its device (cpu, this machine has no GPU), so they build it there; every record
    names the device it ran on."""
    from mlflow import MlflowClient

    from metasd.cli import main

    pool = _experiment(store, "gpu")["pools"][0]
    pool["config"]["verifier"]["device"] = "cpu"
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(_experiment(store, "gpu", pools=[pool], runs=[{"single": True}])))
    uri = f"sqlite:///{tmp_path}/gpu.db"
    assert main(["bench", str(path), "--executor", "ray", "--workers", "2", "--gpus-per-worker", "0.5",
                 "--tracking-uri", uri, "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert len(re.findall(r"worker [01] up on .*, 1 threads, GPU 0\)", captured.err)) == 2, captured.err
    assert "2 workers x 1 CPUs (torch threads) and 0.5 GPU each" in captured.out
    client = MlflowClient(uri)
    (parent,) = client.search_runs([client.get_experiment_by_name("gpu").experiment_id], "tags.`metasd.kind` = 'experiment'")
    assert parent.data.tags["metasd.gpus_per_worker"] == "0.5" and parent.data.tags["device"] == "cpu"
    kids = _children(client, parent.info.experiment_id, parent.info.run_id)
    records = [r for run in kids.values() for r in _artifact_lines(client, run.info.run_id, tmp_path / "dl")]
    assert records and {r["device"] for r in records} == {"cpu"}


@needs_ray
def test_gpu_reservations_beyond_the_cluster_are_refused(store, ray_session, tmp_path):
    path = _write(store, "gpu-over")
    with pytest.raises(ValueError, match=r"2 workers x 1 GPUs each need 2 GPUs; the Ray cluster has 1"):
        run_experiment(path, tracking_uri=f"sqlite:///{tmp_path}/o.db", progress=False,
                       executor={"type": "ray", "workers": 2, "gpus_per_worker": 1})


def test_gpus_per_worker_is_checked(store, tmp_path, capsys):
    from pydantic import ValidationError

    from metasd.bench.schema import ExecutorSpec
    from metasd.cli import main

    assert ExecutorSpec(type="ray", gpus_per_worker=0.25).gpus_per_worker == 0.25  # fractions share a GPU, as in Ray
    assert ExecutorSpec(type="ray", gpus_per_worker=2).gpus_per_worker == 2
    for bad, why in ((-1, "greater than or equal to 0"), (0.00001, "precision of 0.0001")):
        with pytest.raises(ValidationError, match=why):
            ExecutorSpec(type="ray", gpus_per_worker=bad)
    with pytest.raises(ConfigError, match=r"executor: .*'gpus_per_worker'.* apply to the ray executor only"):
        load_experiment(_write(store, "gpu-bad", executor={"type": "inprocess", "gpus_per_worker": 1}))
    uri = f"sqlite:///{tmp_path}/g.db"
    assert main(["bench", str(_write(store, "gpu-flag")), "--gpus-per-worker", "1", "--tracking-uri", uri]) == 2
    assert "--gpus-per-worker needs --executor ray" in capsys.readouterr().err
    assert main(["bench", str(_write(store, "gpu-flag")), "--executor", "ray", "--gpus-per-worker", "-1",
                 "--tracking-uri", uri]) == 2
    assert "--gpus-per-worker must be >= 0" in capsys.readouterr().err


def test_a_worker_with_a_gpu_builds_its_pools_on_cuda(store, monkeypatch):
    import torch

    from metasd.bench.ray_executor import on_worker_device, worker_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as in a worker Ray showed its GPU
    assert worker_device(None, 1) == "cuda" and worker_device("auto", 0.5) == "cuda"
    assert worker_device("cpu", 1) == "cpu" and worker_device("cuda:0", 1) == "cuda:0"  # the pool says otherwise
    assert worker_device(None, None) is None and worker_device(None, 0) is None  # no GPU: nothing changes
    pool = load_experiment(_write(store, "gpu-pool")).pools[0]
    moved = on_worker_device(pool, 1)
    assert moved.config.verifier.device == "cuda" and pool.config.verifier.device is None
    assert moved.config.drafters == pool.config.drafters and on_worker_device(pool, None) is pool
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU reserved but torch sees none: refused
    with pytest.raises(ValueError, match="reserved 1 GPU .* torch sees no CUDA device"):
        worker_device(None, 1)
