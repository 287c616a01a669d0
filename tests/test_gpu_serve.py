"""benchmarks/gpu_serve.py's CPU dry run (the tiny shapes): what a GPU session runs to measure ``metasd serve``
trace-replayed - serve-prep, then serve_load against metasd's plain batched path and the serving pool replaying the
default pool's recorded acceptance, repeats resumed into one result - end to end, every answer the same text from
both servers in every repeat. (``transformers serve`` is left out here: its command is tested in test_serve_load.)"""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_serve  # noqa: E402


def test_the_dry_run_serves_the_trace_through_both_servers(tmp_path):
    out = tmp_path / "out"
    assert gpu_serve.main(["--device", "cpu", "--dry-run", "--out", str(out), "--servers", "plain", "adaptive",
                           "--concurrency", "1", "2", "--repeats", "2", "--threads", "1", "--budget-s", "600"]) == 0
    rows = json.loads((out / "gpu_serve.json").read_text())["rows"]
    assert sorted((r["server"], r["concurrency"], r["repeat"]) for r in rows) == sorted(
        (s, c, k) for s in ("plain", "adaptive") for c in (1, 2) for k in (0, 1))
    requests = [q for r in rows for q in r["requests"]]
    assert requests and all(q["ok"] for q in requests), [q.get("error") for q in requests if not q["ok"]]
    texts: dict = {}
    for r in rows:
        for q in r["requests"]:
            texts.setdefault(q["question_id"], set()).add(q["text"])
    assert len(texts) == 8 and all(len(t) == 1 for t in texts.values())  # 8 groups, one prompt each: exact
    adaptive = [r for r in rows if r["server"] == "adaptive"]
    assert max(r["mean_tokens_per_step"] for r in adaptive) > 1.0  # it drafted, and its drafts were accepted
    assert all(r["mean_tokens_per_step"] == 1.0 for r in rows if r["server"] == "plain")
    for r in rows:  # each level's graph counters read from the server's /metrics: on a CPU, nothing captured
        assert r["graphs"]["verify_captured"] == r["graphs"]["draft_captured"] == 0, r["graphs"]
        assert r["warmup_graphs"]["verify_capture_s"] == 0.0


def test_a_server_that_fails_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    """A server that cannot start (here: a command that exits at once, as a first contact with a device might) is
    named in the result with its error and left out of later repeats; the other server's repeats all run."""
    import serve_load

    real = serve_load.server_command

    def command(spec, *a, **k):
        if spec.name == "plain":
            return [sys.executable, "-c", "import sys; sys.exit(3)", "--port", "1"]
        return real(spec, *a, **k)

    monkeypatch.setattr(serve_load, "server_command", command)
    out = tmp_path / "out"
    assert gpu_serve.main(["--device", "cpu", "--dry-run", "--out", str(out), "--servers", "plain", "adaptive",
                           "--concurrency", "1", "--repeats", "2", "--threads", "1", "--budget-s", "600"]) == 0
    result = json.loads((out / "gpu_serve.json").read_text())
    assert list(result["failed"]) == ["plain"] and "exited with 3" in result["failed"]["plain"]
    assert result["repeats_run"] == 2
    assert sorted((r["server"], r["repeat"]) for r in result["rows"]) == [("adaptive", 0), ("adaptive", 1)]
