"""benchmarks/prefix_cache.py at a tiny size: a 3-turn chat with prefix caching off, on for the verifier alone and on
for the verifier and its model drafter, on a tiny pool on disk; later turns reuse the history (the drafter its own
positions of it too), the answers are the same text, and the JSON holds every repeat and the summary."""
import json

import pytest
import yaml

from benchmark_scripts import load_script
from serve_helpers import write_tiny_pool


def test_the_prefix_cache_benchmark_runs_and_reports_paired_ratios(tmp_path):
    script = load_script("prefix_cache")
    out = tmp_path / "prefix.json"
    pool = write_tiny_pool(tmp_path)
    config = yaml.safe_load(pool.read_text())  # a model drafter too: the verifier's twin
    config["drafters"].append({"name": "twin", "type": "pretrained", "model": config["verifier"]["model"],
                               "params": {"k": 3}})
    pool.write_text(yaml.safe_dump(config))
    assert script.main(["--pool", str(pool), "--history-tokens", "60", "--turns", "3", "--answer-tokens", "6",
                        "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and len(report["runs"]) == 2
    assert [list(run) for run in report["runs"]] == [["off", "verifier", "both"], ["verifier", "both", "off"]]
    rows = report["summary"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["same_text"] for r in rows)
    assert rows[0]["cached_tokens"] == [0, 0] and rows[0]["drafter_positions_resumed"] == [0, 0]
    assert all(c >= rows[0]["prompt_tokens"] for r in rows[1:] for c in r["cached_tokens"])  # the history reused
    # the twin started the later turns from its own positions of the history
    assert all(d >= rows[0]["prompt_tokens"] - 8 for r in rows[1:] for d in r["drafter_positions_resumed"])
    assert all(run["verifier"][t]["drafter_positions_resumed"] == 0 for run in report["runs"] for t in range(3))
    for key in ("ttft_both_over_off", "e2e_both_over_verifier"):
        assert all(r[f"{key}_range"][0] <= r[key] <= r[f"{key}_range"][1] for r in rows)

    # where settings' answers differ (never, in fp32 here), the margins pass says where and by how much
    assert script.main(["--pool", str(pool), "--threads", "1", "--margins-of", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["divergences"] == [] and report["summary"] == rows


def test_the_margins_pass_finds_a_divergence_and_reads_plain_decodings_margin(tmp_path):
    script = load_script("prefix_cache")
    pool = write_tiny_pool(tmp_path)
    from metasd.serve.cli import PoolEngine

    engine = PoolEngine.from_file(str(pool), 1)()
    history = script.history_text(engine.tokenizer, 40)
    messages = script.chat_messages(history, {}, "off", 0)
    answer = engine.generate(messages, 6, chat=True)
    changed = answer.token_ids[:3] + [(answer.token_ids[3] + 1) % 60 + 3]
    runs = [{"off": [{"text": answer.text, "token_ids": answer.token_ids}],
             "both": [{"text": engine.tokenizer.decode(changed), "token_ids": changed}]}]
    (found,) = script.divergence_margins(engine, history, runs)
    assert found["token"] == 3 and found["settings"] == ["off", "both"] and found["margin"] >= 0
    import torch

    with torch.inference_mode():
        logits = engine.verifier.model(torch.tensor([engine.encode(messages) + answer.token_ids[:3]])).logits[0, -1]
    top = logits.topk(2).values
    assert found["margin"] == pytest.approx(float(top[0] - top[1]))
    assert found["plain_top2"][0] == engine.tokenizer.decode(answer.token_ids[3:4])
