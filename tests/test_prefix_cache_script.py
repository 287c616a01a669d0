"""benchmarks/prefix_cache.py at a tiny size: a 4-turn chat with prefix caching on and off, on a tiny pool on disk;
later turns reuse the history, the answers are the same text, and the JSON holds every repeat and the summary."""
import json

from benchmark_scripts import load_script
from serve_helpers import write_tiny_pool


def test_the_prefix_cache_benchmark_runs_and_reports_paired_ratios(tmp_path):
    script = load_script("prefix_cache")
    out = tmp_path / "prefix.json"
    pool = write_tiny_pool(tmp_path)
    assert script.main(["--pool", str(pool), "--history-tokens", "60", "--turns", "3", "--answer-tokens", "6",
                        "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and len(report["runs"]) == 2
    rows = report["summary"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["same_text"] for r in rows)
    assert rows[0]["cached_tokens"] == [0, 0]
    assert all(c >= rows[0]["prompt_tokens"] for r in rows[1:] for c in r["cached_tokens"])  # the history reused
    assert all(r["ratio_range"][0] <= r["ratio_median"] <= r["ratio_range"][1] for r in rows)
