"""benchmarks/processing.py's bookkeeping: the ratios it reports are geometric means over prompts of each repeat's
tokens/s, medians over complete repeats only, and it counts where processed and unprocessed drafts gave other tokens."""
import math

import pytest

from benchmark_scripts import load_script

processing = load_script("processing")


def _row(rep, prompt, method, tps):
    return {"repeat": rep, "prompt": prompt, "setting": "s", "method": method, "tokens_per_s": tps,
            "tokens_per_step": 2.0 if method != "plain" else 1.0, "token_ids": [1, 2]}


def test_ratios_are_geometric_means_over_prompts_and_medians_over_complete_repeats():
    rows = []
    for rep, (a, b) in enumerate([(2.0, 8.0), (4.0, 4.0), (1.0, 1.0)]):  # processed/unprocessed per prompt
        rows += [_row(rep, 0, "plain", 1.0), _row(rep, 0, "processed", a), _row(rep, 0, "unprocessed", 1.0),
                 _row(rep, 1, "plain", 1.0), _row(rep, 1, "processed", b), _row(rep, 1, "unprocessed", 1.0)]
    rows += [_row(3, 0, "plain", 1.0), _row(3, 0, "processed", 100.0)]  # a repeat still running: left out
    rows[-3]["token_ids"] = [1, 3]  # repeat 2, prompt 1, unprocessed: other tokens
    out = processing.summarize(rows, ["s"])["s"]
    assert [p["processed/unprocessed"] for p in out["per_repeat"]] == pytest.approx([4.0, 4.0, 1.0])
    assert out["processed/unprocessed"]["median"] == pytest.approx(4.0)
    assert out["processed/unprocessed"]["range"] == pytest.approx([1.0, 4.0])
    assert out["processed/plain"]["median"] == pytest.approx(math.sqrt(16.0))
    assert out["processed == unprocessed"] == "5/6"  # one run's tokens differ
    assert out["processed == plain"] == "6/6"


def test_settings_refuse_a_tokenizer_that_splits_the_banned_tokens():
    class Splitting:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]
    with pytest.raises(ValueError, match="spells ',' or ' the' as several tokens"):
        processing.settings(Splitting())
