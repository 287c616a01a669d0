"""benchmarks/host_time.py's scheduler measurement (``--batch``) on tiny stand-ins: every drafter kind runs its
requests together through the scheduler at fixed shapes for exactly the steps asked, and the command writes its rows."""
import json

import pytest

from benchmark_scripts import load_script

host_time = load_script("host_time")


@pytest.mark.parametrize("kind", list(host_time.BATCH_DRAFTERS))
def test_a_scheduler_steps_host_time_is_measured_over_full_batches(kind):
    row = host_time.measure_batch(kind, steps=4, batch=3, vocab=64)
    assert (row["drafter"], row["batch"], row["vocab"], row["steps"]) == (kind, 3, 64, 4)
    assert 0 < row["host_ms_median"] <= row["host_ms_p90"]
    assert row["host_ms_per_request"] == pytest.approx(row["host_ms_median"] / 3)
    assert row["committed_per_step"] >= 3 and row["drafted_per_step"] >= 0
    # the allocator's step_plan timed apart where the pool has one (the served pool's), inside the step's host time
    assert (0 < row["plan_ms_median"] <= row["host_ms_p90"]) if kind == "adaptive" else row["plan_ms_median"] == 0


def test_the_batch_command_writes_one_row_per_drafter_and_batch(tmp_path):
    out = tmp_path / "host.json"
    assert host_time.main(["--batch", "1", "2", "--steps", "3", "--vocab", "64", "--drafters", "none", "suffix",
                           "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["drafter"], r["batch"]) for r in rows] == [("none", 1), ("suffix", 1), ("none", 2), ("suffix", 2)]


def test_the_trie_command_measures_a_suffix_tries_feed(tmp_path):
    out = tmp_path / "trie.json"
    assert host_time.main(["--trie", "8", "--steps", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["depth"], row["tokens"], row["repeats"]) == (8, 6000, 2) and 6000 < row["nodes"] <= 8 * 6000 + 1
    assert 0 < row["us_per_token_min"] <= row["us_per_token_median"] <= row["us_per_token_max"]
