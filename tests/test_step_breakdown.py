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
    out = tmp_path / "breakdown.json"
    assert script.main(["--pool", str(pool), "--questions", str(questions), "--concurrency", "1", "3",
                        "--max-tokens", "6", "--cost-profile", str(profile), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["tokens"] == 6 * r["concurrency"] and r["steps"] >= 1
        assert r["verify_s"] > 0 and r["prefill_s"] > 0 and r["draft_s"] > 0
        timed = r["prefill_s"] + r["draft_s"] + r["verify_s"]  # on the scheduler thread, inside the level's wall
        assert timed <= r["wall_s"] and r["other_s"] == pytest.approx(r["wall_s"] - timed)
        assert r["draft_costs"] is not None and sum(r["arm_steps"].values()) >= r["steps"]
        assert 0 <= r["lookup_only_steps"] <= sum(r["arm_steps"].values())
    assert "| 3 |" in capsys.readouterr().out


def test_speculation_off_drafts_nothing(tmp_path, questions):
    script = load_script("step_breakdown")
    pool = write_tiny_pool(tmp_path)
    out = tmp_path / "off.json"
    assert script.main(["--pool", str(pool), "--questions", str(questions), "--concurrency", "2",
                        "--max-tokens", "4", "--off", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["arm_steps"]) == {"none"}
    assert row["widths"] == {} and row["draft_costs"] is None and row["mean_forward_tokens"] <= 2
