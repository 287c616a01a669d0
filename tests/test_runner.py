"""Experiment runner on tiny models: MLflow layout, per-request records, resume, Ctrl-C, config errors."""
import json
import os
from pathlib import Path

import pytest
import yaml

import metasd.models
from metasd.config import ConfigError
from metasd.core.engine import Engine
from metasd.bench.experiment import load_experiment
from metasd.bench.report import cumulative_regret, summarize
from metasd.bench import ExperimentInterrupted, run_experiment
from tiny import tiny_qwen, tiny_tokenizer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # offline tests: no usage reporting thread

QUESTIONS = [
    {"question_id": "q1", "category": "writing", "turns": ["w10 w11 w12 w13 w10 w11", "w20 w21 w22"]},
    {"question_id": "q2", "category": "translation", "turns": ["w30 w31 w32 w30 w31 w32 w30"]},
    {"question_id": "q3", "category": "qa", "turns": ["w40 w41 w42 w43"]},
]
N_REQUESTS = 4  # q1 has two turns


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Tiny verifier and drafter as HF directories, a dataset, and one MLflow store for the module."""
    root = tmp_path_factory.mktemp("runner")
    tok = tiny_tokenizer()
    for name, seed in (("verifier", 0), ("drafter", 0)):  # the drafter has the verifier's weights: all accepted
        tiny_qwen(seed=seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    with open(root / "questions.jsonl", "w") as f:
        for q in QUESTIONS:
            f.write(json.dumps(q) + "\n")
    return root


@pytest.fixture
def uri(store):
    return f"sqlite:///{store}/mlflow.db"


def _experiment(store: Path, name: str, **over) -> dict:
    cfg = {
        "name": name,
        "pools": [{"name": "tiny", "config": {
            "verifier": {"model": str(store / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "small", "type": "pretrained", "model": str(store / "drafter"), "params": {"k": 3}},
                         {"name": "ngram", "type": "ngram", "params": {"k": 4, "n_min": 1, "n_max": 2}}],
        }}],
        "datasets": [{"name": "q", "path": str(store / "questions.jsonl")}],
        "max_new_tokens": 6,
        "runs": [{"policy": {"name": "ucb", "params": {"c": 1.0}}, "reward": "block_efficiency", "granularity": "step"},
                 {"single": True}, {"oracle": True}],
        "baselines": ["plain"],
        "warmup": False,
        "plots": False,
    }
    cfg.update(over)
    return cfg


def _write(store: Path, name: str, **over) -> Path:
    path = store / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_experiment(store, name, **over)))
    return path


@pytest.fixture
def count_generate(monkeypatch):
    calls = []
    real = Engine.generate

    def counting(self, prompt, *a, **kw):
        calls.append(kw.get("category"))
        return real(self, prompt, *a, **kw)

    monkeypatch.setattr(Engine, "generate", counting)
    return calls


def _children(client, exp_id, parent):
    runs = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    return {r.data.tags["metasd.key"]: r for r in runs}


def _artifact_lines(client, run_id, tmp_path):
    from mlflow.artifacts import download_artifacts

    local = download_artifacts(run_id=run_id, artifact_path="requests.jsonl", dst_path=str(tmp_path / run_id),
                               tracking_uri=client._tracking_client.tracking_uri)
    return [json.loads(line) for line in open(local)]


def test_runner_logs_runs_params_metrics_artifacts(store, uri, tmp_path, count_generate):
    from mlflow import MlflowClient

    path = _write(store, "full", baselines=["plain", {"type": "assisted", "drafter": "small"}], plots=True)
    res = run_experiment(path, tracking_uri=uri, progress=False)
    client = MlflowClient(uri)
    parent = client.get_run(res.parent_run_id)
    assert parent.info.status == "FINISHED"
    p = parent.data.params
    assert p["model.tiny.verifier"] == str(store / "verifier")
    assert "version.torch" in p and "version.transformers" in p and p["max_new_tokens"] == "6"
    assert p["pools.0.config.drafters.0.params.k"] == "3"
    assert parent.data.tags["threads"] and parent.data.tags["dtype"] == "float32"
    kids = _children(client, res.experiment_id, res.parent_run_id)
    methods = ["plain", "assisted:small", "single:small/seed0", "single:ngram/seed0", "ucb-block_efficiency-step/seed0"]
    assert sorted(kids) == sorted(f"tiny/q/{m}" for m in methods)
    # 3 methods x 4 requests through the engine (plain and assisted go through transformers)
    assert len(count_generate) == 3 * N_REQUESTS
    for key, run in kids.items():
        assert run.info.status == "FINISHED"
        lines = _artifact_lines(client, run.info.run_id, tmp_path)
        assert lines == res.records[key] and len(lines) == N_REQUESTS
        assert [(r["question_id"], r["turn"]) for r in lines] == [("q1", 0), ("q1", 1), ("q2", 0), ("q3", 0)]
        hist = client.get_metric_history(run.info.run_id, "tokens_per_second")
        assert sorted((m.step, round(m.value, 6)) for m in hist) == [(r["index"], round(r["tokens_per_second"], 6)) for r in lines]
        assert "summary/speedup/overall" in run.data.metrics
    pol = kids["tiny/q/ucb-block_efficiency-step/seed0"]
    recs = res.records["tiny/q/ucb-block_efficiency-step/seed0"]
    assert pol.data.params["policy.name"] == "ucb" and pol.data.params["reward"] == "block_efficiency"
    sel = client.get_metric_history(pol.info.run_id, "selections/small")
    assert sorted((m.step, m.value) for m in sel) == [(r["index"], r["selection_counts"].get("small", 0)) for r in recs]
    for r in recs:
        assert r["steps"] == len(r["tokens_per_step"]) == len(r["drafter_per_step"]) == len(r["rewards"])
        assert r["committed"] >= r["new_tokens"] == 6 and r["prefill_committed"] == 1
        assert r["matches_plain"] is True  # lossless: the same tokens as transformers greedy decoding
    small = res.records["tiny/q/single:small/seed0"]
    assert all(r["mean_tokens_per_step"] > 1.5 and r["acceptance_rate"] == 1.0 for r in small)
    assert res.summaries["tiny/q"]["methods"]["single:small"]["overall"]["tokens_per_step"] > 1.5
    # later turns are prompted with the method's own earlier answer
    assert res.records["tiny/q/plain"][1]["prompt_tokens"] > res.records["tiny/q/plain"][0]["prompt_tokens"]
    files = {f.path for f in client.list_artifacts(pol.info.run_id)}
    assert {"requests.jsonl", "policy_state.json", "drafter_choice.png"} <= files
    pfiles = {f.path for f in client.list_artifacts(res.parent_run_id)}
    assert {"results.md", "results.json", "config", "plots"} <= pfiles
    plots = {f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(res.parent_run_id, "plots/tiny/q")}
    assert {"speedup.png", "acceptance_length.png", "regret_time.png", "regret_steps.png"} <= plots
    # the table: rows = methods, columns = groups in Spec-Bench order + overall
    assert "| method | MT | translation | QA | overall |" in res.table
    assert "| plain | 1.00x / 1.00 | 1.00x / 1.00 | 1.00x / 1.00 | 1.00x / 1.00 |" in res.table
    assert "| oracle |" in res.table and "bonus token included" in res.table
    summ = res.summaries["tiny/q"]["methods"]["single:small"]["overall"]
    assert parent.data.metrics["tiny/q/single:small/speedup/overall"] == pytest.approx(summ["speedup"])


def test_summaries_and_regret_definitions():
    def rec(q, turn, tokens, secs, steps, seed=0, index=0, group="MT", cat="writing"):
        return dict(question_id=q, turn=turn, new_tokens=tokens, wall_s=secs, steps=steps, committed=tokens,
                    seed=seed, index=index, group=group, category=cat)

    plain = [rec("a", 0, 10, 10.0, 10), rec("a", 1, 10, 10.0, 10), rec("b", 0, 10, 5.0, 10, group="QA", cat="qa")]
    method = [rec("a", 0, 10, 5.0, 4), rec("a", 1, 10, 5.0, 4), rec("b", 0, 10, 5.0, 2, group="QA", cat="qa")]
    s = summarize(method, plain)
    assert s["MT"]["speedup"] == pytest.approx(2.0) and s["QA"]["speedup"] == pytest.approx(1.0)
    # overall: mean question speed (2.0, 2.0) / mean plain question speed (1.0, 2.0)
    assert s["overall"]["speedup"] == pytest.approx(2.0 / 1.5)
    assert s["MT"]["tokens_per_step"] == pytest.approx(20 / 8)
    singles = {"x": [rec("a", 0, 10, 2.0, 2, index=0), rec("b", 0, 10, 8.0, 2, index=1)],
               "y": [rec("a", 0, 10, 6.0, 5, index=0), rec("b", 0, 10, 3.0, 5, index=1)]}
    policy = [rec("a", 0, 10, 3.0, 3, index=0), rec("b", 0, 5, 2.0, 3, index=1)]
    series, best = cumulative_regret(policy, singles, "wall_s")
    # costs for the policy's work: x = 2 + 4 = 6, y = 6 + 1.5 = 7.5 -> d* = x
    assert best == "x" and series == pytest.approx([1.0, 1.0 + 2.0 - 4.0])
    series, best = cumulative_regret(policy, singles, "steps")
    assert best == "x" and series == pytest.approx([1.0, 1.0 + 3 - 1.0])


def test_resume_skips_finished_requests(store, uri, count_generate):
    path = _write(store, "resume", order="sequential")
    first = run_experiment(path, tracking_uri=uri, progress=False, limit=2)  # q1 (2 turns) and q2
    assert len(count_generate) == 3 * 3 and first.generated == 4 * 3
    count_generate.clear()
    again = run_experiment(path, tracking_uri=uri, resume_run_id=first.parent_run_id, progress=False, limit=2)
    assert count_generate == [] and again.generated == 0 and again.skipped == 4 * 3
    more = run_experiment(path, tracking_uri=uri, resume_run_id=first.parent_run_id, progress=False)
    assert count_generate == ["qa"] * 3 and more.generated == 4  # only q3, for 3 methods + plain
    assert more.parent_run_id == first.parent_run_id
    for key, recs in more.records.items():
        assert [r["index"] for r in recs] == [0, 1, 2, 3], key
    # --resume finds the latest parent run of the same config by itself
    count_generate.clear()
    latest = run_experiment(path, tracking_uri=uri, resume=True, progress=False)
    assert latest.parent_run_id == first.parent_run_id and count_generate == []


@pytest.mark.parametrize("order", ["interleaved", "sequential"])
def test_interrupt_keeps_finished_requests_and_resume_completes(store, uri, monkeypatch, tmp_path, order):
    from mlflow import MlflowClient

    calls = []
    interrupt = [True]
    real = Engine.generate

    def flaky(self, prompt, *a, **kw):
        calls.append(1)
        if len(calls) == 3 and interrupt[0]:  # Ctrl-C during the third engine request
            interrupt[0] = False
            raise KeyboardInterrupt
        return real(self, prompt, *a, **kw)

    monkeypatch.setattr(Engine, "generate", flaky)
    path = _write(store, f"interrupt-{order}", order=order)
    with pytest.raises(ExperimentInterrupted) as info:
        run_experiment(path, tracking_uri=uri, progress=False)
    run_id = info.value.run_id
    assert "| plain | 1.00x / 1.00 |" in info.value.table  # results so far
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "KILLED"
    kids = _children(client, client.get_run(run_id).info.experiment_id, run_id)
    engine_runs = {k: r for k, r in kids.items() if not k.endswith("/plain")}
    kept = {k: len(_artifact_lines(client, r.info.run_id, tmp_path)) for k, r in engine_runs.items()
            if client.list_artifacts(r.info.run_id)}
    assert sum(kept.values()) == 2, kept  # the two requests that finished before Ctrl-C
    assert all(r.info.status in ("KILLED", "FINISHED") for r in kids.values())
    interrupted = "tiny/q/ucb-block_efficiency-step/seed0" if order == "interleaved" else "tiny/q/single:small/seed0"
    assert kids[interrupted].info.status == "KILLED"
    calls.clear()
    done = run_experiment(path, tracking_uri=uri, resume_run_id=run_id, progress=False)
    assert len(calls) == 3 * N_REQUESTS - 2  # the two finished requests are not generated again
    assert client.get_run(run_id).info.status == "FINISHED"
    assert all(r.info.status == "FINISHED" for r in _children(client, done.experiment_id, run_id).values())
    assert all(len(r) == N_REQUESTS for r in done.records.values())
    for recs in done.records.values():
        assert [(r["question_id"], r["turn"], r["index"]) for r in recs] == [
            ("q1", 0, 0), ("q1", 1, 1), ("q2", 0, 2), ("q3", 0, 3)]


@pytest.mark.parametrize("over, field", [
    ({"runs": [{"policy": {"name": "ucb", "params": {"bogus": 1}}}]}, "runs.0.policy.params"),
    ({"runs": [{"policy": {"name": "nope"}}]}, "runs.0.policy.name"),
    ({"runs": [{"policy": {"name": "ucb"}, "granularity": "token"}]}, "runs.0.granularity"),
    ({"runs": [{"single": True, "drafters": ["missing"]}]}, "runs.0.drafters.0"),
    ({"max_new_token": 5}, "max_new_token"),
    ({"baselines": ["plain", {"type": "assisted", "drafter": "ngram"}]}, "baselines.1.drafter"),
    ({"baselines": [{"type": "assisted"}]}, "baselines.0"),
    ({"baselines": [{"type": "assisted", "drafter": "small"}]}, "baselines"),  # no plain
    ({"runs": [{"oracle": True}]}, "runs"),
    ({"runs": [{"policy": {"name": "exp3"}, "reward": "throughput"}]}, "runs.0.reward"),  # needs rewards in [0, 1]
    ({"datasets": [{"path": "x.jsonl", "turns": "some"}]}, "datasets.0.turns"),
])
def test_bad_experiment_names_file_and_field(store, over, field):
    path = _write(store, "bad", **over)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    msg = str(info.value)
    assert str(path) in msg and f"  {field}:" in msg, msg


def test_missing_dataset_fails_before_any_model_load(store, uri, monkeypatch, capsys):
    def no_load(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(metasd.models, "load_model", no_load)
    path = _write(store, "nodata", datasets=[{"path": "no/such/file.jsonl"}])
    with pytest.raises(ConfigError, match=r"datasets\.0\.path: dataset .*no/such/file\.jsonl does not exist"):
        run_experiment(path, tracking_uri=uri, progress=False)
    from metasd.cli import main

    assert main(["bench", str(path), "--tracking-uri", uri]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_threads_and_tracking_uris_are_named_before_any_model_load(store, uri, monkeypatch, capsys):
    from metasd.cli import main

    def no_load(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(metasd.models, "load_model", no_load)
    path = _write(store, "flags", runs=[{"single": True, "drafters": ["ngram"]}])
    for threads in ("0", "-1"):  # 0 once meant the experiment's threads, -1 a traceback
        assert main(["bench", str(path), "--tracking-uri", uri, "--threads", threads]) == 2
        assert "--threads must be an integer >= 1" in capsys.readouterr().err
    assert main(["bench", str(path), "--tracking-uri", "nonsense://x", "--no-progress"]) == 2  # once a traceback
    assert "--tracking-uri nonsense://x: MLflow cannot open this store" in capsys.readouterr().err


def test_cli_bench_prints_table(store, uri, capsys):
    from metasd.cli import main

    path = _write(store, "cli", runs=[{"single": True, "drafters": ["ngram"]}])
    assert main(["bench", str(path), "--tracking-uri", uri, "--no-progress", "--limit", "1"]) == 0
    out = capsys.readouterr()
    assert "| method | MT | overall |" in out.out and "| single:ngram |" in out.out
    assert "mlflow ui --backend-store-uri" in out.err


def test_builtin_prompts_and_shipped_experiments_validate():
    root = Path(__file__).resolve().parent.parent
    smoke = load_experiment(root / "experiments" / "smoke.yaml")
    assert smoke.datasets[0].name == "builtin" and {q.group for q in smoke.datasets[0].questions} == {
        "MT", "translation", "summarization", "QA", "math", "RAG"}
    assert [m.name for m in smoke.pools[0].methods] == ["ucb-throughput-step", "single:qwen0.5b", "single:ngram"]
    spec = root.parent / "shared" / "data" / "spec_bench" / "question.jsonl"
    if spec.is_file():
        exp = load_experiment(root / "experiments" / "metasd_specbench.yaml")
        assert len(exp.pools[0].methods) >= 10


def test_median_speedup_and_plain_outliers():
    from metasd.bench.report import plain_outliers, results_table, summarize

    def rec(q, tokens, wall):
        return {"question_id": q, "turn": 0, "group": "QA", "category": "qa", "new_tokens": tokens, "wall_s": wall,
                "committed": tokens, "steps": tokens // 2, "seed": 0}

    # plain: 10 tok/s on q1..q4, but q5's plain request was disturbed (2 tok/s): its speedup is inflated
    plain = [rec(f"q{i}", 20, 2.0) for i in range(1, 5)] + [rec("q5", 20, 10.0)]
    method = [rec(f"q{i}", 20, 1.0) for i in range(1, 6)]  # 20 tok/s everywhere
    s = summarize(method, plain)["overall"]
    assert s["median_speedup"] == pytest.approx(2.0)  # q1..q4 give 2x, q5 gives 10x: the median ignores it
    assert s["speedup"] == pytest.approx(20 / ((4 * 10 + 2) / 5))  # Spec-Bench's ratio of mean speeds
    assert plain_outliers(plain) == ["q5"] and plain_outliers(plain[:4]) == []
    table = results_table({"columns": ["QA", "overall"], "methods": {"plain": summarize(plain, plain), "m": summarize(method, plain)},
                           "plain_outliers": ["q5"]})
    assert "median of per-question speedups, overall: m 2.00x" in table and "questions q5" in table


@pytest.mark.parametrize("load, warned", [(1.7, True), (0.4, False)])
def test_requests_run_on_an_overloaded_machine_are_flagged(store, uri, monkeypatch, capsys, load, warned):
    """Each record carries the machine's load per core; above 1 the experiment warns once and the table counts them."""
    import metasd.bench.requests

    monkeypatch.setattr(metasd.bench.requests, "load_per_core", lambda: load)
    res = run_experiment(_write(store, f"load{int(load * 10)}"), tracking_uri=uri, progress=False)
    err = capsys.readouterr().err
    assert err.count("the machine's load is") == (1 if warned else 0)
    assert ("requests ended while the machine's load exceeded its cores" in res.table) == warned


def test_parent_run_killed_before_its_params_were_logged_gets_them_on_resume(store, uri, monkeypatch):
    """A kill between creating the parent run and logging its params leaves a run without params; --resume
    logs them (and only those missing) before going on."""
    from mlflow import MlflowClient

    from metasd.bench.tracking import PARAMS_TAG, BenchStore

    real = BenchStore._log_parent_params

    def killed(self, exp, present=None):
        self.client.log_batch(self.parent_id, params=[])  # the process dies before any param is written
        raise KeyboardInterrupt

    monkeypatch.setattr(BenchStore, "_log_parent_params", killed)
    path = _write(store, "params_kill")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(path, tracking_uri=uri, progress=False)
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("params_kill").experiment_id
    (parent,) = client.search_runs([exp_id], filter_string="tags.`metasd.kind` = 'experiment'")
    assert parent.data.params == {} and PARAMS_TAG not in parent.data.tags
    monkeypatch.setattr(BenchStore, "_log_parent_params", real)
    res = run_experiment(path, tracking_uri=uri, resume=True, progress=False)
    assert res.parent_run_id == parent.info.run_id
    done = client.get_run(parent.info.run_id)
    assert done.data.tags[PARAMS_TAG] == "1" and done.data.params["max_new_tokens"] == "6"


def test_interleaved_order_rotates_baselines_with_methods(store, uri, monkeypatch):
    """Request r is answered by every run in the order of request 0 rotated by r: plain and the other baselines
    take every position like the pool's methods; a run answered before plain still gets matches_plain."""
    import metasd.bench.runner as runner_mod
    from metasd.bench.stats import rotation

    order: list[tuple[int, str]] = []
    real = runner_mod.answer_request

    def recording(engines, fn, messages, q, t, index, seed, method, kind, plain):
        order.append((index, method))
        return real(engines, fn, messages, q, t, index, seed, method, kind, plain)

    monkeypatch.setattr(runner_mod, "answer_request", recording)
    path = _write(store, "rotation", baselines=["plain", "prompt_lookup"])
    res = run_experiment(path, tracking_uri=uri, progress=False)
    per_request = [[m for i, m in order if i == r] for r in range(N_REQUESTS)]
    assert per_request[0][0] == "plain" and len(set(map(len, per_request))) == 1
    for r, names in enumerate(per_request):
        assert names == rotation(per_request[0], r), r
    assert [names[0] for names in per_request] == per_request[0][:N_REQUESTS]  # a different run first each time
    for key, recs in res.records.items():
        assert [r["index"] for r in recs] == list(range(N_REQUESTS)), key
        if not key.endswith("/plain"):
            assert all(r["matches_plain"] is True for r in recs), key
