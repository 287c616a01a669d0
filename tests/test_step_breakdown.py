"""benchmarks/step_breakdown.py on a tiny pool: the scheduler built as metasd serve builds it, every phase timed."""
import json

import pytest
import yaml

from benchmark_scripts import load_script
from serve_helpers import write_tiny_pool


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    lines = [{"question_id": str(i), "category": "writing", "turns": [f"tell me about {w} {w} {w}"]}
             for i, w in enumerate(["cats", "dogs", "the sea"])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_the_levels_account_for_their_time_and_an_adaptive_pool_reports_its_prices(tmp_path, questions, capsys):
    script = load_script("step_breakdown")
    pool = write_tiny_pool(tmp_path)
    data = yaml.safe_load(pool.read_text())
    pool.write_text(yaml.safe_dump({**data, "serving": {"adaptive": True, "max_width": 4, "price_drafting": True}}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"tokens": [1, 8, 32], "seconds": [0.01, 0.011, 0.02]}))
    out, trace = tmp_path / "breakdown.json", tmp_path / "trace.jsonl"
    assert script.main(["--pool", str(pool), "--questions", str(questions), "--concurrency", "1", "3",
                        "--max-tokens", "6", "--cost-profile", str(profile), "--out", str(out),
                        "--trace", str(trace)]) == 0
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    assert steps and {1, 3} <= {s["batch"] for s in steps} <= {1, 2, 3}  # every decoding step, one line each
    assert all(len(s["requests"]) == s["batch"] and s["adaptive"]["width"] >= 0 for s in steps)
    assert all(s["adaptive"]["probe"] in (True, False) for s in steps)  # which steps a probe made
    assert all(0 <= s["draft_s"] + s["verify_s"] + s["prefill_s"] <= s["seconds"] + 1e-3 and s["verify_s"] > 0
               for s in steps)  # each step's own phases (a prefill-only step's prefill is not the next step's)
    ratios = steps[-1]["forward_ratios_by_tokens"]  # per load level and token bucket
    assert set(ratios) == {str(lv) for lv in steps[-1]["forward_ratios"]} and all(ratios.values())
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["tokens"] == 6 * r["concurrency"] and r["steps"] >= 1
        assert r["verify_s"] > 0 and r["prefill_s"] > 0 and r["draft_s"] > 0
        timed = r["prefill_s"] + r["draft_s"] + r["verify_s"]  # on the scheduler thread, inside the level's wall
        assert timed <= r["wall_s"] and r["other_s"] == pytest.approx(r["wall_s"] - timed)
        assert r["draft_costs"] is not None and sum(r["arm_steps"].values()) >= r["steps"]
        assert 0 <= r["lookup_only_steps"] <= sum(r["arm_steps"].values())
        assert 0 < r["itl_p50"] <= r["itl_p99"] <= sum(x["seconds"] for x in steps)  # 6 tokens a request: gaps
        assert all(x["batch"] >= 1 and x["seconds"] > 0 for x in r["probes"])
    assert "| 3 |" in capsys.readouterr().out


def test_inter_token_latency_counts_each_requests_gaps_as_a_stream_would():
    from types import SimpleNamespace as NS

    script = load_script("step_breakdown")

    def step(seconds, *commits, probe=False):
        return NS(seconds=seconds, batch_size=len(commits), adaptive=NS(probe=probe, width=4 if probe else 0),
                  requests=[NS(id=rid, committed=k) for rid, k in commits])

    steps = [step(1.0, ("a", 1)),  # a's first token (its TTFT): no sample
             step(0.5),  # a prefill-only step: a waits
             step(2.0, ("a", 4), ("b", 1), probe=True),  # a: 2.5 s for 4 tokens; b's first token
             step(1.0, ("a", 1), ("b", 2))]
    assert script.itl_samples(steps) == [0.625] * 4 + [1.0] + [0.5] * 2
    figures = script.latency(steps)
    assert figures["step_s_max"] == 2.0 and figures["probes"] == [{"batch": 2, "seconds": 2.0, "width": 4}]
    assert figures["itl_p50"] == 0.625 and figures["itl_p99"] == pytest.approx(0.625 + 0.94 * 0.375)


def test_a_level_of_more_requests_than_slots_keeps_c_in_flight_as_serve_load_does(tmp_path, questions):
    script = load_script("step_breakdown")
    pool = write_tiny_pool(tmp_path)
    out = tmp_path / "slots.json"
    # 3 prompts, --requests-per-c 2: 6 requests at c=2 (whole passes making >= 4), at most 2 in flight
    assert script.main(["--pool", str(pool), "--questions", str(questions), "--concurrency", "2",
                        "--max-tokens", "4", "--requests-per-c", "2", "--per-group", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    spans = row["request_spans"]
    assert row["requests"] == 6 and [s["prompt"] for s in spans] == [0, 1, 2, 0, 1, 2]
    assert row["tokens"] == sum(s["tokens"] for s in spans) == 24 and all(s["steps"] >= 1 for s in spans)
    for s in spans:  # when each request was sent, the others in flight were fewer than 2
        in_flight = sum(o["sent_s"] <= s["sent_s"] < o["end_s"] for o in spans if o is not s)
        assert in_flight <= 1 and s["sent_s"] <= s["end_s"] <= row["wall_s"]
    assert all(s["sent_s"] < 0.5 for s in spans[:2])  # the first two at once
    assert max(s["end_s"] for s in spans) == pytest.approx(row["wall_s"], abs=0.5)


def test_speculation_off_drafts_nothing(tmp_path, questions):
    script = load_script("step_breakdown")
    pool = write_tiny_pool(tmp_path)
    out = tmp_path / "off.json"
    assert script.main(["--pool", str(pool), "--questions", str(questions), "--concurrency", "2",
                        "--max-tokens", "4", "--off", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["arm_steps"]) == {"none"}
    assert row["widths"] == {} and row["draft_costs"] is None and row["mean_forward_tokens"] <= 2


def test_calibration_compares_each_steps_realized_goodput_with_the_expected_one():
    from types import SimpleNamespace as NS

    script = load_script("step_breakdown")

    def step(width, goodput, seconds, committed, tokens):
        return NS(adaptive=NS(width=width, goodput=goodput, tokens=tokens), seconds=seconds,
                  batch_size=len(committed), requests=[NS(committed=c) for c in committed])

    steps = [step(0, 2.0, 0.2, [1, 1], 2.0),  # plain: 2 tokens in 2 units -> 1.0 a unit, half the 2.0 expected
             step(8, 5.0, 0.4, [6, 4], 10.0),  # drafting: 10 tokens in 4 units -> 2.5, half the 5.0 expected
             step(4, 2.0, 0.1, [3, 1], 2.0)]  # 4 tokens in 1 unit -> 4.0, twice the 2.0 expected
    cal = script.calibration(steps, unit_seconds=0.1)
    assert cal["plain"]["steps"] == 1 and cal["plain"]["realized_over_expected_p50"] == pytest.approx(0.5)
    assert cal["drafting"]["steps"] == 2 and cal["drafting"]["realized_over_expected_p50"] == pytest.approx(1.25)
    # the two sides: plain 2 of 2 tokens, 2 units for an expected 1; drafting 10 of 10 and 4 of 2 tokens (median
    # 1.5), 4 units for 2 and 1 unit for 1 (median 1.5)
    assert cal["plain"]["tokens_realized_over_expected_p50"] == 1.0
    assert cal["plain"]["cost_realized_over_expected_p50"] == pytest.approx(2.0)
    assert cal["drafting"]["tokens_realized_over_expected_p50"] == pytest.approx(1.5)
    assert cal["drafting"]["cost_realized_over_expected_p50"] == pytest.approx(1.5)
    assert cal["drafting"]["committed_mean"] == 7 and cal["drafting"]["batch_mean"] == 2
    assert script.calibration(steps, unit_seconds=None) is None


def test_draft_rows_times_a_tiny_models_batched_forwards(tmp_path):
    from tiny import tiny_qwen, tiny_tokenizer

    model_dir = tmp_path / "tiny"
    tiny_qwen(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "rows.json"
    script = load_script("draft_rows")
    assert script.main(["--model", str(model_dir), "--quantize", "none", "--dtype", "float32", "--prefix", "8",
                        "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["tokens_per_row"]) for r in rows] == script.SHAPES
    for r in rows:
        assert all(t > 0 for t in r["together_ms"]) and (("one_by_one_ms" in r) == (r["rows"] > 1))
