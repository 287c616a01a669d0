"""benchmarks/speed.py's timing loop with fake methods (no model): rotation with plain inside it, repeats, the
untimed margins pass, identity, resume keyed on (prompt, repeat), and the tables."""
import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import speed  # noqa: E402
from metasd.bench.stats import rotation  # noqa: E402


class Probe:
    def encode(self, messages):
        return [len(m["content"]) for m in messages]


QUESTIONS = [SimpleNamespace(question_id=f"q{i}", category=c, group=g, turns=[f"prompt {i}" * (i + 1)])
             for i, (c, g) in enumerate([("writing", "MT"), ("qa", "QA"), ("math_reasoning", "math")])]
REF = [1, 2, 3, 4]


def _fake(calls, name, out=REF, seconds=1.0):
    def run(ids):
        calls.append((name, ids))
        return list(out), seconds, None, None
    return run


@pytest.fixture
def setup(tmp_path):
    calls, margin_calls = [], []
    methods = {speed.PLAIN: _fake(calls, speed.PLAIN, seconds=2.0), speed.ASSISTED: _fake(calls, speed.ASSISTED),
               speed.LOOKUP: _fake(calls, speed.LOOKUP, out=[1, 2, 9, 4], seconds=1.5),
               "pool x": _fake(calls, "pool x", seconds=0.5)}

    def margins_pass(ids):
        margin_calls.append(ids)
        return list(REF), [1.0, 0.5, 0.0625, 2.0]

    def args(**over):
        a = dict(repeats=2, resume=False, out=str(tmp_path / "speed.json"), temperature=0.0, oracle=None)
        a.update(over)
        return argparse.Namespace(**a)

    return calls, margin_calls, methods, margins_pass, args


def test_every_method_plain_included_rotates_and_margins_are_untimed(setup):
    calls, margin_calls, methods, margins_pass, args = setup
    rows = speed.run_repeats(args(), [], QUESTIONS, methods, Probe(), margins_pass)
    timed = calls[len(methods):]  # after the warm-up call of each method
    names = list(methods)
    assert len(rows) == len(QUESTIONS) * 2 and len(timed) == len(rows) * len(names)
    for i, row in enumerate(rows):
        qi, rep = i % len(QUESTIONS), i // len(QUESTIONS)  # interleaved: repeat 0 runs every prompt first
        assert (row["question_id"], row["repeat"]) == (QUESTIONS[qi].question_id, rep)
        order = [name for name, _ in timed[i * len(names):(i + 1) * len(names)]]
        assert order == row["order"] == rotation(names, qi + rep)
        assert list(row["methods"]) == names  # stored in table order
    assert sum(r["order"][0] == speed.PLAIN for r in rows) < len(rows)  # plain is not always first
    assert len(margin_calls) == len(QUESTIONS)  # once per prompt, outside the timed calls
    lookup = [r["methods"][speed.LOOKUP] for r in rows]
    assert all(e["identical"] is False and e["first_divergence"] == 2 for e in lookup)
    assert all(e["plain_top2_margin_at_divergence"] == 0.0625 for e in lookup)
    assert all(r["methods"][speed.PLAIN]["identical"] for r in rows)
    saved = json.loads(Path(args().out).read_text())
    assert saved["references"]["q0"]["margins"] == [1.0, 0.5, 0.0625, 2.0] and len(saved["rows"]) == len(rows)


def test_resume_keys_on_prompt_and_repeat(setup):
    calls, margin_calls, methods, margins_pass, args = setup
    speed.run_repeats(args(repeats=1), [], QUESTIONS, methods, Probe(), margins_pass)
    calls.clear(), margin_calls.clear()
    rows = speed.run_repeats(args(repeats=2, resume=True), [], QUESTIONS, methods, Probe(), margins_pass)
    assert [(r["question_id"], r["repeat"]) for r in rows] == [(q.question_id, rep) for rep in (0, 1) for q in QUESTIONS]
    assert len(calls) == len(methods) * (1 + len(QUESTIONS))  # warm-up + repeat 1 only
    assert margin_calls == []  # the references were saved with repeat 0
    with pytest.raises(SystemExit, match="other arguments"):
        speed.run_repeats(args(resume=True, temperature=1.0), [], QUESTIONS, methods, Probe(), margins_pass)


def test_tables_give_medians_ranges_verdicts_and_outliers(setup):
    calls, margin_calls, methods, margins_pass, args = setup
    rows = speed.run_repeats(args(repeats=3), [], QUESTIONS, methods, Probe(), margins_pass)
    rows[0]["methods"]["pool x"]["seconds"] = 5.0  # one disturbed run of q0 in repeat 0
    text = speed.tables(rows)
    line = next(x for x in text.splitlines() if x.startswith("| pool x |"))
    # plain 4 tok / 2 s, pool 4 / 0.5 s: 4x in repeats 1 and 2; repeat 0 (q0 took 5 s) 12 / 6 = 2 vs 12 / 6 = 2 -> 1x
    assert "| 4.00x [1.00, 4.00] |" in line and "2.00x [0.50, 2.00]" in line  # vs plain; vs assisted (2 tok/s)
    assert "plain(+fix): within noise" in line  # repeat 0's 1.00x touches plain's 1.00
    lookup = next(x for x in text.splitlines() if x.startswith(f"| {speed.LOOKUP} |"))
    assert "plain(+fix): faster" in lookup and "assisted(+fix): slower" in lookup and "| 0/3 | 0.0625, 0.0625, 0.0625 |" in lookup
    assert "| q0 | writing | pool x | 0 | 4 | 5.00 | 0.50 |" in text  # the outlier, by prompt


def _hooked(model) -> bool:
    return getattr(model.get_output_embeddings(), "_metasd_hook", None) is not None


@pytest.mark.parametrize("script", ["speed", "cross_tokenizer"])
def test_baselines_carry_the_lm_head_fix_and_as_shipped_rows_do_not(script, monkeypatch):
    """The rows every ratio is computed against run with the LM-head fix on the verifier and the assistant (applied
    at the call, even where something removed it); the opt-in as-shipped rows run without it and restore it."""
    import importlib

    from metasd.core.execution.hooks import contiguous_lm_head_input, remove_lm_head_hook
    from tiny import tiny_qwen, tiny_tokenizer

    mod = importlib.import_module(script)
    seen = {}

    def fake(name):
        def run(model, *a, **kw):
            assistant = kw.get("assistant_model", a[0] if name == "assisted" else None)
            seen.setdefault(name, []).append((_hooked(model), assistant is None or _hooked(assistant)))
            return [1, 2], 0.1
        return run

    monkeypatch.setattr(mod.baselines, "plain", lambda model, ids, n: fake("plain")(model))
    monkeypatch.setattr(mod.baselines, "assisted", lambda model, assistant, ids, n, **kw: fake("assisted")(model, assistant))
    monkeypatch.setattr(mod.baselines, "prompt_lookup", lambda model, ids, n, k=10: fake("lookup")(model))
    vm, am, tok = tiny_qwen(seed=0), tiny_qwen(seed=1), tiny_tokenizer()
    common = dict(max_new_tokens=4, temperature=0.0, seed=0, k=3, dtype="fp32", extra_pool=None, as_shipped=True,
                  verifier="tiny-v", verifier_quantize="none")
    if script == "speed":
        args = argparse.Namespace(**common, drafter="tiny-d", plain_quantize=None, assistant_quantize=None,
                                  no_drafter=False, llama_cpp=False)
    else:
        args = argparse.Namespace(**common, assistant="tiny-a", assistant_quantize="none", confidence_threshold=None)
    methods = mod.build_methods(args, vm, tok, am, tok)
    assisted = speed.ASSISTED if script == "speed" else mod.UAG
    fixed = [speed.PLAIN, assisted] + ([speed.LOOKUP] if script == "speed" else [])
    shipped = [m for m in methods if m.endswith("(as shipped)")]
    assert len(shipped) == len(fixed) and all("+fix" not in m for m in shipped)
    for name in fixed:
        remove_lm_head_hook(vm), remove_lm_head_hook(am)
        methods[name]([5, 6])
    assert all(call == (True, True) for calls in seen.values() for call in calls), seen
    seen.clear()
    contiguous_lm_head_input(vm), contiguous_lm_head_input(am)  # as a Verifier and a drafter hold them
    for name in shipped:
        methods[name]([5, 6])
        assert _hooked(vm) and _hooked(am)  # restored after the call
    assert all(call == (False, False) if kind == "assisted" else call[0] is False
               for kind, calls in seen.items() for call in calls), seen
