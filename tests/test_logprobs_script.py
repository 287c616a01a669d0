"""benchmarks/logprobs_check.py at a tiny size: plain and speculative log-probabilities compared on a tiny pool on disk
(fp32: equal to the last bits), with the --dtype override."""
import json

from benchmark_scripts import load_script
from serve_helpers import write_tiny_pool


def test_the_logprobs_check_compares_plain_and_speculative(tmp_path):
    script, out = load_script("logprobs_check"), tmp_path / "lp.json"
    pool = write_tiny_pool(tmp_path)
    assert script.main(["--pool", str(pool), "--max-new-tokens", "8", "--threads", "1", "--dtype", "fp32",
                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "torch.float32" and len(report["rows"]) == len(script.PROMPTS)
    assert all(r["identical"] and r["common_prefix"] == r["tokens"] for r in report["rows"])
    assert report["max_abs_diff"] < 1e-4
