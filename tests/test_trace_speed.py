"""benchmarks/trace_speed.py on synthetic step traces: a run slowed by a planted factor is read at the same tokens/s
at common speed as its twin, the factor recovered; a run that commits more tokens over the same shapes reads faster;
a trace without the phase timer is an error naming its file."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load_script


@pytest.fixture(scope="module")
def ts():
    return load_script("trace_speed")


def cost(tokens: int, rows: int) -> float:
    return 0.4 + 0.03 * tokens + 0.05 * rows


def write_trace(path, speed: float, committed: int, steps=((4, 20), (4, 36), (3, 27), (2, 18), (1, 5), (4, 20))):
    """One JSON line per step: verify seconds = speed x cost(shape), 0.1 s of drafting at the same speed."""
    with open(path, "w") as f:
        for rows, tokens in steps:
            verify = speed * cost(tokens, rows)
            f.write(json.dumps({"batch": rows, "seconds": verify + 0.1 * speed, "forward_tokens": tokens,
                                "prefill_tokens": 0, "prefill_s": 0.0, "draft_s": 0.1 * speed, "verify_s": verify,
                                "requests": [{"id": f"r{i}", "committed": committed} for i in range(rows)]}) + "\n")
    return str(path)


def test_a_slower_machine_reads_the_same_at_common_speed(ts, tmp_path):
    fast = ts.read_trace("a", write_trace(tmp_path / "fast.jsonl", 1.0, 3))
    slow = ts.read_trace("b", write_trace(tmp_path / "slow.jsonl", 1.5, 3))
    assert slow.tok_s == pytest.approx(fast.tok_s / 1.5)
    s, c, residual = ts.speeds([fast, slow])
    assert s[1] / s[0] == pytest.approx(1.5, rel=1e-6)
    assert s[0] * s[1] == pytest.approx(1.0)  # geometric mean 1
    assert residual == pytest.approx(0.0, abs=1e-9)
    table = ts.report([fast, slow])
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    common = [float(r[-2]) for r in rows if len(r) > 5]
    assert common[0] == pytest.approx(common[1], abs=0.01)


def test_more_tokens_over_the_same_shapes_reads_faster(ts, tmp_path):
    runs = [ts.read_trace("few", write_trace(tmp_path / "a.jsonl", 1.0, 2)),
            ts.read_trace("many", write_trace(tmp_path / "b.jsonl", 1.3, 4))]  # slower machine, twice the tokens
    s, _, _ = ts.speeds(runs)
    at = [r.tok_s_at(f) for r, f in zip(runs, s)]
    assert at[1] == pytest.approx(2 * at[0])
    assert runs[1].tok_s < 2 * runs[0].tok_s  # raw tokens/s hides half of it


def test_a_trace_without_the_timer_names_its_file(ts, tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"batch": 1, "seconds": 1.0, "forward_tokens": 1, "requests": []}) + "\n")
    with pytest.raises(ValueError, match="old.jsonl: line 1 has no verify_s"):
        ts.read_trace("x", path)


def test_the_command_line_needs_two_runs(ts, tmp_path, capsys):
    one = write_trace(tmp_path / "one.jsonl", 1.0, 2)
    with pytest.raises(SystemExit):
        ts.main([f"a={one}"])
    assert "at least two" in capsys.readouterr().err
    assert ts.main([f"a={one}", f"b={write_trace(tmp_path / 'two.jsonl', 2.0, 2)}"]) == 0
    assert "| a | 1 |" in capsys.readouterr().out
