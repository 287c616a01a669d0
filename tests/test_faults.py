"""Fault injection (issue 19 item 2): a killed or crowded ``metasd bench`` and a damaged bundled-model cache.

Each test injects one fault and checks the protection that handles it:

1. ``metasd bench`` SIGKILLed between committing a request and logging its metrics, then ``--resume``:
   every (method, request) ends up with one record and one set of metrics (``metasd.bench.tracking.NestedRun``);
2. two ``metasd bench`` processes starting at once on one new SQLite store both finish
   (``metasd.bench.store_guard.store_lock``), MLflow calls are retried while SQLite says ``database is locked``
   (``metasd.bench.store_guard.call_with_retry``), and resuming a run that a live process writes is refused
   (``metasd.bench.tracking.BenchStore._claim``);
3. a converted bundled-model file truncated or overwritten after its marker was written is detected
   cheaply and rebuilt, or refused with the cache dir and the fixing command (``metasd.models.cache_marker.cache_problem``);
4. a full disk during the first conversion leaves no marker and no half cache, and says so
   (``metasd.models.bundled.prepare_bundled``);
5. two processes converting one bundled model at once convert it once (``metasd.models.bundled._file_lock``).

Models are the tiny random ones of ``tests/tiny.py``; a bundled model is faked by part modules written here
and a conversion step that saves a tiny model, so no real GGUF is needed. Subprocesses run functions of this
module (``_child``) and synchronise through files, never through sleeps.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from metasd.models import bundled, cache_marker
from metasd.bench import tracking
from metasd.models.bundled import BUNDLED, BundledModel, prepare_bundled
from metasd.models.cache_marker import CACHE_MARKER
from metasd.models import ModelLoadError, load_model

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

TESTS = Path(__file__).resolve().parent
QUESTIONS = [{"question_id": f"q{i}", "category": "qa", "turns": [f"w{10 + i} w{11 + i} w{12 + i} w{10 + i}"]}
             for i in range(3)]
CHILD_TIMEOUT = 180  # seconds a child may take (two torch imports on a busy 2-core machine take ~10 s)


# ------------------------------------------------------------------------------------------ helpers


_child_ids = itertools.count()


def _child(fn: str, *args: str, cwd: Path) -> subprocess.Popen:
    """Start ``python -c`` running ``tests/test_faults.<fn>(*args)`` (one thread per library, offline MLflow);
    its output goes to a file (``proc.log``), so a chatty child never blocks on a full pipe."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import test_faults; test_faults.{fn}(*sys.argv[1:])"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONUNBUFFERED": "1"}
    log = cwd / f"child-{next(_child_ids)}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for the children (killing any still running after the timeout); their outputs."""
    try:
        for p in procs:
            p.wait(timeout=CHILD_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.log.read_text() for p in procs]


def _wait_for(cond, what: str, procs: list[subprocess.Popen] = (), timeout: float = CHILD_TIMEOUT) -> None:
    """Poll ``cond()`` every 20 ms; fail (with the children's output) if a child exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"child exited with {p.returncode} before {what}:\n{p.log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _wait_files(directory: Path, n: int, timeout: float = CHILD_TIMEOUT) -> None:
    """In a child: wait until ``directory`` holds ``n`` files (a barrier between processes)."""
    deadline = time.monotonic() + timeout
    while len(list(directory.iterdir())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {directory}: {len(list(directory.iterdir()))} of {n}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A tiny verifier saved as an HF directory (subprocesses load it by path) and a 3-question dataset."""
    from tiny import tiny_qwen, tiny_tokenizer

    root = tmp_path_factory.mktemp("fault-models")
    tiny_qwen(seed=0).save_pretrained(root / "verifier")
    tiny_tokenizer().save_pretrained(root / "verifier")
    with open(root / "questions.jsonl", "w") as f:
        for q in QUESTIONS:
            f.write(json.dumps(q) + "\n")
    return root


def _experiment(models: Path, path: Path, name: str) -> Path:
    """Plain decoding and the n-gram drafter on 3 one-turn requests: 6 requests in all, interleaved."""
    cfg = {
        "name": name,
        "pools": [{"name": "tiny", "config": {
            "verifier": {"model": str(models / "verifier"), "dtype": "fp32"},
            "drafters": [{"name": "ngram", "type": "ngram", "params": {"k": 3, "n_min": 1, "n_max": 2}}],
        }}],
        "datasets": [{"name": "q", "path": str(models / "questions.jsonl")}],
        "max_new_tokens": 4,
        "runs": [{"single": True}],
        "baselines": ["plain"],
        "warmup": False,
        "plots": False,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _parents(client, name: str):
    exp = client.get_experiment_by_name(name)
    return client.search_runs([exp.experiment_id], filter_string="tags.`metasd.kind` = 'experiment'")


def _assert_study_complete(client, parent, tmp_path: Path) -> None:
    """Parent and nested runs FINISHED; every nested run: each request once, in order, metrics once per request."""
    from mlflow.artifacts import download_artifacts

    assert client.get_run(parent.info.run_id).info.status == "FINISHED"
    kids = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(k.data.tags["metasd.key"] for k in kids) == ["tiny/q/plain", "tiny/q/single:ngram/seed0"]
    for kid in kids:
        run_id = kid.info.run_id
        assert kid.info.status == "FINISHED"
        local = download_artifacts(run_id=run_id, artifact_path="requests.jsonl", dst_path=str(tmp_path / run_id),
                                   tracking_uri=client._tracking_client.tracking_uri)
        recs = [json.loads(line) for line in open(local)]
        assert [(r["question_id"], r["index"]) for r in recs] == [(q["question_id"], i) for i, q in enumerate(QUESTIONS)]
        steps = sorted(m.step for m in client.get_metric_history(run_id, "tokens_per_second"))
        assert steps == list(range(len(QUESTIONS))), (kid.data.tags["metasd.key"], steps)


# ------------------------------------------------------------- 1. SIGKILL of metasd bench, then --resume


def _bench_paused_at(experiment: str, uri: str, pause_file: str, pause_at: str) -> None:
    """Child: ``metasd bench`` that stops dead at per-request metrics call number ``pause_at``, after the record
    of that request is committed: it writes ``pause_file`` and blocks until the test SIGKILLs it."""
    from metasd.cli import main

    calls = []
    real = tracking.BenchStore.log_metrics

    def log_metrics(self, run_id, metrics, step=0):
        calls.append(step)
        if len(calls) == int(pause_at):
            Path(pause_file).write_text(str(step))
            threading.Event().wait()  # blocked until killed
        return real(self, run_id, metrics, step)

    tracking.BenchStore.log_metrics = log_metrics
    sys.exit(main(["bench", experiment, "--tracking-uri", uri, "--no-progress"]))


def test_sigkill_mid_study_then_resume_logs_every_request_once(models_dir, tmp_path, capsys):
    from mlflow import MlflowClient

    from metasd.cli import main

    exp = _experiment(models_dir, tmp_path / "killed.yaml", "killed")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    pause = tmp_path / "paused"
    # interleaved order: plain q0, ngram q0, plain q1 (its record committed, its metrics not yet logged) - kill
    child = _child("_bench_paused_at", str(exp), uri, str(pause), "3", cwd=tmp_path)
    try:
        _wait_for(pause.exists, "the third request", [child])
        client = MlflowClient(uri)
        [parent] = _parents(client, "killed")
        assert parent.info.status == "RUNNING"  # the experiment has not ended
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    plain = client.search_runs([parent.info.experiment_id], filter_string="tags.`metasd.key` = 'tiny/q/plain'")[0]
    assert sorted(m.step for m in client.get_metric_history(plain.info.run_id, "tokens_per_second")) == [0]

    assert main(["bench", str(exp), "--tracking-uri", uri, "--resume", "--no-progress"]) == 0
    assert "3 requests generated, 3 already logged" in capsys.readouterr().err
    [resumed] = _parents(client, "killed")
    assert resumed.info.run_id == parent.info.run_id
    _assert_study_complete(client, resumed, tmp_path)


# ------------------------------------------------------- 2. two bench writers on one SQLite store


def _bench_after_barrier(experiment: str, uri: str, barrier: str, me: str) -> int:
    """Import everything, wait until both writers are ready, then run ``metasd bench`` (in a child: exit with
    its status)."""
    import mlflow  # noqa: F401  (imported before the barrier, so both reach the store at the same moment)
    import torch  # noqa: F401

    from metasd.cli import main

    Path(barrier, me).touch()
    _wait_files(Path(barrier), 2)
    return main(["bench", experiment, "--tracking-uri", uri, "--no-progress"])


def _bench_after_barrier_child(*args: str) -> None:
    sys.exit(_bench_after_barrier(*args))


def test_two_bench_writers_on_one_new_sqlite_store_both_finish(models_dir, tmp_path):
    from mlflow import MlflowClient

    exp = _experiment(models_dir, tmp_path / "shared.yaml", "shared")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"  # a new store: both create its tables and the experiment
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # the two writers: a child process and this one (which has torch and mlflow imported already)
    child = _child("_bench_after_barrier_child", str(exp), uri, str(barrier), "child", cwd=tmp_path)
    try:
        here = _bench_after_barrier(str(exp), uri, str(barrier), "here")
    finally:
        [output] = _finish([child])
    assert (here, child.returncode) == (0, 0), output
    client = MlflowClient(uri)
    parents = _parents(client, "shared")
    assert len(parents) == 2
    for parent in parents:
        _assert_study_complete(client, parent, tmp_path)


def test_resuming_a_run_that_a_live_process_writes_is_refused(models_dir, tmp_path):
    from mlflow import MlflowClient

    from metasd.bench.experiment import load_experiment

    exp = load_experiment(_experiment(models_dir, tmp_path / "claimed.yaml", "claimed"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = tracking.BenchStore(uri)
    first.open(exp, exp.config_hash(), tmp_path, None, resume=False)
    # the parent run is RUNNING and owned by a live process (a stand-in for another metasd bench)
    writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        MlflowClient(uri).set_tag(first.parent_id, tracking.OWNER_TAG, tracking.owner_token(writer.pid))
        with pytest.raises(tracking.RunInUseError, match=rf"run {first.parent_id} in {uri} is being written by another"
                                                         rf" metasd bench process \(host:pid .*:{writer.pid}\)"):
            tracking.BenchStore(uri).open(exp, exp.config_hash(), tmp_path, None, resume=True)
    finally:
        writer.communicate()  # its stdin closes: it ends
    second = tracking.BenchStore(uri)  # the writer is gone (as after a SIGKILL): the run is resumed
    second.open(exp, exp.config_hash(), tmp_path, None, resume=True)
    assert second.parent_id == first.parent_id
    assert MlflowClient(uri).get_run(first.parent_id).data.tags[tracking.OWNER_TAG] == tracking.owner_token()


def test_locked_sqlite_is_retried_with_backoff_then_refused_clearly(monkeypatch):
    import sqlite3

    from mlflow.exceptions import MlflowException

    monkeypatch.setattr(tracking.time, "sleep", lambda s: None)
    locked = MlflowException("(sqlite3.OperationalError) database is locked")
    locked.__cause__ = sqlite3.OperationalError("database is locked")
    calls = []

    def flaky(x):
        calls.append(x)
        if len(calls) < 3:
            raise locked
        return x * 2

    client = tracking.RetryingClient(type("C", (), {"set_tag": staticmethod(flaky)})(), "sqlite:///x.db")
    assert client.set_tag(21) == 42 and len(calls) == 3

    def always_locked():
        calls.append(None)
        raise locked

    calls.clear()
    with pytest.raises(tracking.StoreBusyError, match=r"sqlite:///x\.db stayed locked .* tries of log_batch"):
        tracking.call_with_retry("sqlite:///x.db", "log_batch", always_locked)
    assert len(calls) == tracking.LOCKED_RETRIES + 1  # bounded
    with pytest.raises(ValueError):  # other errors are not retried
        tracking.call_with_retry("sqlite:///x.db", "x", lambda: (calls.append(1), int("x")))


# ------------------------------------------------------------ bundled models: a fake entry


def _fake_entry(root: Path, name: str, write: bool = True) -> BundledModel:
    """A bundled entry whose two part modules (under ``root/partmods``, written when ``write``) hold a few fake
    GGUF bytes."""
    import hashlib

    data = b"not really a gguf " * 64
    moddir = root / "partmods"
    moddir.mkdir(parents=True, exist_ok=True)
    modules, packages = [], []
    for i, chunk in enumerate((data[:500], data[500:]), start=1):
        mod = f"metasd_fault_part_{name.replace('-', '_')}_{i}"
        if write:
            (root / f"{mod}.bin").write_bytes(chunk)
            (moddir / f"{mod}.py").write_text(f"def get_part_path():\n    return {str(root / f'{mod}.bin')!r}\n")
        modules.append(mod)
        packages.append(f"metasd-fault-part-{i}==1.0")
    return BundledModel(name=name, description="fault test model", modules=tuple(modules), packages=tuple(packages),
                        sha256=hashlib.sha256(data).hexdigest(), gguf_bytes=len(data), tokenizer="tiny")


def _tiny_convert(gguf: Path, out: Path) -> None:
    """Stands in for the GGUF conversion: saves the tiny model and tokenizer into ``out``."""
    from tiny import tiny_qwen, tiny_tokenizer

    tiny_qwen(seed=1).save_pretrained(str(out))
    tiny_tokenizer().save_pretrained(str(out))


_entry_ids = itertools.count()


@pytest.fixture
def fake_bundled(tmp_path, monkeypatch):
    """A registered fake entry, a tmp cache root (``METASD_CACHE``) and a counting tiny conversion."""
    entry = _fake_entry(tmp_path, f"fault-model-{next(_entry_ids)}")
    monkeypatch.syspath_prepend(str(tmp_path / "partmods"))
    monkeypatch.setitem(BUNDLED, entry.name, entry)
    cache = tmp_path / "cache"
    monkeypatch.setenv("METASD_CACHE", str(cache))
    conversions = []
    monkeypatch.setattr(bundled, "_convert_gguf", lambda gguf, out: (conversions.append(out), _tiny_convert(gguf, out)))
    return entry, cache, conversions


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))) if root.exists() else []


# ------------------------------------------------------- 3. a truncated or overwritten cache file


@pytest.mark.parametrize("damage", ["truncate", "overwrite_same_size", "delete"])
def test_damaged_cache_file_is_detected_and_rebuilt(fake_bundled, damage, caplog):
    entry, cache, conversions = fake_bundled
    final = prepare_bundled(entry.name)
    assert len(conversions) == 1
    weights = final / "model.safetensors"
    size = weights.stat().st_size
    if damage == "truncate":  # e.g. a copy that ran out of space, or a crash mid-write of a sync tool
        with open(weights, "r+b") as f:
            f.truncate(size // 2)
    elif damage == "overwrite_same_size":  # same size, other bytes: only the hash can tell
        blob = bytearray(weights.read_bytes())
        blob[-64:] = bytes(64)
        weights.write_bytes(bytes(blob))
    else:
        weights.unlink()
    assert not bundled._cache_complete(entry)
    with caplog.at_level(logging.WARNING, logger="metasd.models.bundled"):
        model, _ = load_model(entry.ref, dtype="fp32")
    assert len(conversions) == 2  # rebuilt, never loaded half
    assert f"the cache of {entry.ref} at {final} is damaged" in caplog.text and str(weights) in caplog.text
    assert weights.stat().st_size == size and bundled._cache_complete(entry) and _leftovers(cache) == []
    assert model.config.num_hidden_layers == 2


def test_metasd_models_shows_a_damaged_cache_and_the_command_to_fix_it(fake_bundled, capsys):
    from metasd.cli import main

    entry, cache, conversions = fake_bundled
    final = prepare_bundled(entry.name)
    assert main(["models"]) == 0
    assert f"{entry.ref}" in capsys.readouterr().out
    (final / "model.safetensors").write_bytes(b"{}")  # overwritten by something else
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if entry.ref in x)
    assert "cache damaged" in line
    assert "model.safetensors has 2 bytes" in out and f"metasd models --prepare {entry.name}" in out
    assert len(conversions) == 1  # listing never rebuilds


def test_damaged_cache_that_cannot_be_rebuilt_names_dir_and_command(fake_bundled, monkeypatch):
    entry, cache, conversions = fake_bundled
    final = prepare_bundled(entry.name)
    (final / "model.safetensors").write_bytes(b"{}")  # overwritten by something else
    monkeypatch.setitem(BUNDLED, entry.name, dataclasses.replace(entry, modules=("metasd_fault_not_installed",),
                                                                 packages=("metasd-fault-gone==1.0",)))
    with pytest.raises(ModelLoadError) as info:
        load_model(entry.ref, dtype="fp32")
    msg = str(info.value)
    assert f"the cache at {final} is damaged" in msg and "model.safetensors has 2 bytes" in msg
    assert f"metasd models --prepare {entry.name}" in msg and "metasd-fault-gone==1.0" in msg
    assert len(conversions) == 1


def test_normal_load_reads_no_file_in_full_and_a_touched_file_is_hashed_once(fake_bundled, monkeypatch):
    entry, cache, conversions = fake_bundled
    final = prepare_bundled(entry.name)
    marker = json.loads((final / CACHE_MARKER).read_text())
    assert marker["format"] == 2 and marker["files"]["model.safetensors"]["bytes"] == (final / "model.safetensors").stat().st_size
    hashed = []
    real_hash = cache_marker.sha256_file
    monkeypatch.setattr(cache_marker, "sha256_file", lambda p: (hashed.append(p.name), real_hash(p))[1])
    assert prepare_bundled(entry.name) == final and hashed == []  # sizes and mtimes only
    st = (final / "model.safetensors").stat()
    os.utime(final / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    assert prepare_bundled(entry.name) == final and hashed == ["model.safetensors"]
    assert prepare_bundled(entry.name) == final and hashed == ["model.safetensors"]  # its new mtime was recorded
    assert len(conversions) == 1


def test_format1_cache_is_upgraded_in_place_not_reconverted(fake_bundled, monkeypatch):
    entry, cache, conversions = fake_bundled
    final = prepare_bundled(entry.name)
    marker = json.loads((final / CACHE_MARKER).read_text())
    del marker["files"]
    (final / CACHE_MARKER).write_text(json.dumps({**marker, "format": 1}))  # written by an older metasd
    assert not bundled._cache_complete(entry)
    # the upgrade reads only the cache: the part packages may be gone
    monkeypatch.setitem(BUNDLED, entry.name, dataclasses.replace(entry, modules=("metasd_fault_not_installed",),
                                                                 packages=("metasd-fault-gone==1.0",)))
    assert next(r for r in bundled.bundled_status() if r["name"] == entry.name)["cached"] is True
    assert prepare_bundled(entry.name) == final and len(conversions) == 1
    upgraded = json.loads((final / CACHE_MARKER).read_text())
    assert upgraded["format"] == 2 and "model.safetensors" in upgraded["files"] and bundled._cache_complete(entry)


# ------------------------------------------------------------- 4. disk full during the conversion


class _FillingFile:
    """A file opened for writing that accepts ``room`` bytes, then fails like a full disk."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        if len(data) > self._room:
            self._f.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("stage", ["assembling", "converting", "marker"])
def test_disk_full_during_first_conversion_leaves_no_cache(fake_bundled, monkeypatch, stage):
    entry, cache, conversions = fake_bundled
    real_open = open
    if stage == "converting":
        def convert_until_full(gguf, out):
            _tiny_convert(gguf, out)  # then the weights file fills the disk half-way
            with real_open(out / "model.safetensors", "r+b") as f:
                f.truncate(f.seek(0, 2) // 2)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(bundled, "_convert_gguf", convert_until_full)
    else:
        target = entry.gguf_filename if stage == "assembling" else CACHE_MARKER

        def filling_open(path, mode="r", *a, **kw):
            f = real_open(path, mode, *a, **kw)
            return _FillingFile(f, 100) if "w" in mode and Path(path).name.startswith(target) else f

        monkeypatch.setattr(bundled, "open", filling_open, raising=False)  # the assembled GGUF
        monkeypatch.setattr(cache_marker, "open", filling_open, raising=False)  # the marker
    with pytest.raises(ModelLoadError) as info:
        prepare_bundled(entry.name)
    msg = str(info.value)
    assert f"the disk holding the model cache {cache} is full" in msg and "No space left on device" in msg
    assert "GB free there" in msg and f"metasd models --prepare {entry.name}" in msg
    assert not (cache / entry.name).exists() and _leftovers(cache) == []
    assert not list(cache.rglob(CACHE_MARKER + "*"))
    monkeypatch.undo()  # space freed: the next load converts
    monkeypatch.setenv("METASD_CACHE", str(cache))
    monkeypatch.setitem(BUNDLED, entry.name, entry)
    monkeypatch.syspath_prepend(str(cache.parent / "partmods"))
    monkeypatch.setattr(bundled, "_convert_gguf", _tiny_convert)
    assert bundled._cache_complete(entry, prepare_bundled(entry.name))


# -------------------------------------------------- 5. two processes converting one bundled model


def _hook_conversion(events: Path) -> tuple:
    """(lock, convert) replacing ``bundled._file_lock`` / ``bundled._convert_gguf``: reaching the lock leaves a
    file in ``events``; a conversion is logged in ``events/../conversions`` and waits until both processes have
    reached the cache lock, so the two really overlap."""
    real_lock = bundled._file_lock

    def lock(path):
        (events / f"at-lock-{os.getpid()}").touch()
        return real_lock(path)

    def convert(gguf, out):
        with open(events.parent / "conversions", "a") as f:
            f.write(f"{os.getpid()}\n")
        _wait_files(events, 2)  # the other process is at (or in) the lock
        _tiny_convert(gguf, out)

    return lock, convert


def _prepare_in_child(root: str, cache: str, name: str, events: str) -> None:
    """Child: register the fake entry (the test wrote its part files) and prepare it, conversion hooked."""
    os.environ["METASD_CACHE"] = cache
    sys.path.insert(0, str(Path(root) / "partmods"))
    entry = _fake_entry(Path(root), name, write=False)
    BUNDLED[entry.name] = entry
    bundled._file_lock, bundled._convert_gguf = _hook_conversion(Path(events))
    print(f"prepared {prepare_bundled(entry.name)}")


def test_two_processes_converting_one_bundled_model_convert_once(tmp_path, monkeypatch):
    name = "fault-model-two-procs"
    cache = tmp_path / "cache"
    events = tmp_path / "events"
    events.mkdir()
    entry = _fake_entry(tmp_path, name)
    # the two processes: a child and this one
    child = _child("_prepare_in_child", str(tmp_path), str(cache), name, str(events), cwd=tmp_path)
    try:
        monkeypatch.setenv("METASD_CACHE", str(cache))
        monkeypatch.syspath_prepend(str(tmp_path / "partmods"))
        monkeypatch.setitem(BUNDLED, name, entry)
        lock, convert = _hook_conversion(events)
        monkeypatch.setattr(bundled, "_file_lock", lock)
        monkeypatch.setattr(bundled, "_convert_gguf", convert)
        here = prepare_bundled(name)
    finally:
        [output] = _finish([child])
    assert child.returncode == 0 and f"prepared {cache / name}" in output, output
    assert here == cache / name
    assert len((tmp_path / "conversions").read_text().split()) == 1
    assert bundled._cache_complete(entry) and _leftovers(cache) == []
