"""benchmarks/structured.py at a tiny size: five methods per prompt (plain and speculative, with and without the JSON
schema or the tool-call grammar, and speculative with the drafters' masks off) on a tiny byte-level pool on disk; the
JSON holds every row, the paired ratios and the identity counts."""
import json

import pytest
import yaml

pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install -e '.[structured]')")

from benchmark_scripts import load_script  # noqa: E402
from test_constraints import EOS, byte_bpe  # noqa: E402
from tiny import tiny_qwen  # noqa: E402


def test_the_structured_output_benchmark_runs_and_reports_paired_ratios(tmp_path):
    tok = byte_bpe(340)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tiny_qwen(seed=3, vocab=len(tok), logit_scale=3.0, eos=EOS, context=1024).save_pretrained(tmp_path / "verifier")
    tok.save_pretrained(tmp_path / "verifier")
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"verifier": {"model": str(tmp_path / "verifier"), "dtype": "fp32"},
                                    "drafters": [{"name": "chain", "type": "pretrained",
                                                  "model": str(tmp_path / "verifier"), "params": {"k": 3}}]}))
    script, out = load_script("structured"), tmp_path / "structured.json"
    prompts = len(script.PROMPTS)
    assert script.main(["--pool", str(pool), "--max-new-tokens", "12", "--repeats", "2", "--threads", "1",
                        "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and len(report["rows"]) == 2 * prompts * 5
    s = report["summary"]
    for key in ("ratio", "R_m"):
        assert len(s["per_repeat"]) == 2 and s[key]["range"][0] <= s[key]["median"] <= s[key]["range"][1]
    # greedy: speculative = plain, schema or not, drafts masked or not
    assert s["compared"] == 2 * prompts * 3 and s["identical_to_plain"] == 2 * prompts * 3
    constrained = [r for r in report["rows"] if r["method"] == "plain+schema"]
    assert all(r["text"].startswith("<tool_call>" if r["prompt"] == prompts - 1 else "{") for r in constrained)
