"""Structured output through the engine (metasd/core/decoding/processing.py): the grammar mask applied to every draft
row along its own path keeps decoding lossless - greedy output token-identical to a plain constrained loop written
independently (one forward per token, the committed prefix's mask from a fresh grammar state) for chains, trees and
lookups, alone and through the scheduler; sampled output distributed as the constrained verifier's through a tree of
depth 2 (chi-square). Tiny fp32 models over a byte-level BPE trained in the test (tests/test_constraints.py)."""
import json

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install -e '.[structured]')")

from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.constraints import Constraint, apply_mask, compile_constraint, reachable_nodes  # noqa: E402
from metasd.core.engine import Engine  # noqa: E402
from metasd.core.execution.verifier import Verifier  # noqa: E402
from metasd.drafters import FusedDrafter, NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter  # noqa: E402
from sampling_check import joint_check  # noqa: E402
from test_constraints import EOS, SCHEMA, TOKENIZERS, check_schema  # noqa: E402
from tiny import tiny_qwen  # noqa: E402

TOK = TOKENIZERS["bpe"]
V = len(TOK)
PROMPTS = [[5, 9, 33], [7, 12, 9, 33, 12, 9, 41, 5]]
SPECS = {"json_schema": Constraint.json_schema(SCHEMA), "json_object": Constraint.json_object(),
         "regex": Constraint.regex(r"[0-9]{3}-[a-z]{1,4}(\.[a-z]{1,3}){0,2}")}


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=3, vocab=V, logit_scale=3.0, eos=EOS)


def _drafters():
    soft = lambda: tiny_qwen(seed=3, vocab=V, logit_scale=2.0, eos=EOS)  # noqa: E731 - softer than the verifier
    return {"chain": PretrainedDrafter(soft(), k=4, name="chain"),
            "tree": PretrainedTreeDrafter(soft(), nodes=10, depth=4, width=2, name="tree"),
            "lookup": FusedDrafter([SuffixDrafter(max_depth=8, max_nodes=8, name="suffix"),
                                    NGramDrafter(k=4, n_max=2, name="ngram")], enough=4, name="lookup")}


def _plain_constrained(model, prompt: list[int], spec: Constraint, n: int) -> list[int]:
    """Constrained greedy decoding, token by token: the mask after the committed tokens, then the argmax."""
    state = compile_constraint(TOK, spec, [EOS]).new_state()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
            token = int(apply_mask(logits, state.mask(V)).argmax())
            out.append(token)
            state.accept_tokens([token])
            if token == EOS:
                break
    return out


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_is_plain_constrained_decoding_token_for_token(model, kind):
    spec = SPECS[kind]
    references = [_plain_constrained(model, p, spec, 60) for p in PROMPTS]
    for name, drafter in [("none", None), *_drafters().items()]:
        engine = Engine(Verifier(model, TOK), drafter, check_tokenizers=False)
        results = [engine.generate(p, 60, constraint=spec) for p in PROMPTS]
        assert [r.token_ids for r in results] == references, name
        if name in ("chain", "tree") and kind != "regex":  # (unmasked drafts rarely fit the regex's few tokens)
            assert sum(r.stats.accepted for r in results) > 0, f"{name}: nothing accepted, the path rows were not read"
    for ids in references:
        text = TOK.decode([t for t in ids if t != EOS])
        if kind == "json_schema" and ids[-1] == EOS:
            check_schema(json.loads(text))
        elif kind == "json_object" and ids[-1] == EOS:
            assert isinstance(json.loads(text), dict)


def test_the_scheduler_applies_each_requests_own_constraint(model):
    engine = Engine(Verifier(model, TOK), _drafters()["tree"], check_tokenizers=False)
    asks = [(PROMPTS[0], SPECS["json_schema"]), (PROMPTS[1], None), (PROMPTS[1], SPECS["regex"])]
    with Scheduler(engine, max_batch=3) as s:
        handles = [s.submit(p, 40, constraint=c) for p, c in asks]
        got = [h.result(timeout=120).token_ids for h in handles]
    plain = Engine(Verifier(model, TOK), None, check_tokenizers=False).generate(PROMPTS[1], 40).token_ids
    assert got == [_plain_constrained(model, PROMPTS[0], SPECS["json_schema"], 40), plain,
                   _plain_constrained(model, PROMPTS[1], SPECS["regex"], 40)]


def test_sampled_tokens_follow_the_constrained_verifier_through_a_tree_of_depth_2():
    verifier = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=8.0, eos=EOS)
    spec = Constraint.regex(r"[a-d]{2,4}")
    # a drafter that knows the grammar's alphabet (its logits pushed down outside it), so that its drafts are valid
    # often enough for depth 2 to be decided both ways; its q is what it drew from, hook included
    alphabet = torch.tensor([t == EOS or set(TOK.decode([t])) <= set("abcd") for t in range(V)])
    draft_model = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=4.0, eos=EOS)
    draft_model.lm_head.register_forward_hook(lambda m, i, out: out.masked_fill(~alphabet, -30.0))
    drafter = PretrainedTreeDrafter(draft_model, mode="rsd_s", width=3, nodes=6, depth=2)
    check = joint_check(Engine(Verifier(verifier, TOK), drafter, check_tokenizers=False), [5], 2000, length=3,
                        constraint=spec)
    assert check.pvalue > 1e-4, check
    assert check.taken_at(2) >= 100 and check.tried_at(2) - check.taken_at(2) >= 50, check


def test_a_bad_constraint_is_refused_naming_the_field(model):
    engine = Engine(Verifier(model, TOK), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="pattern"):
        engine.generate(PROMPTS[0], 5, constraint=Constraint.regex("[unclosed"))


def test_json_whitespace_is_bounded_between_items():
    """At most 8 whitespace characters between JSON tokens (metasd's default, ``JSON_DEFAULTS``): with free
    whitespace a model can spend every token on blanks and never close the object."""
    tok = TOKENIZERS["bytes"]  # one character per token
    state = compile_constraint(tok, Constraint.json_object(), [EOS]).new_state()
    space = tok.encode(" ", add_special_tokens=False)
    state.accept_tokens(tok.encode("{", add_special_tokens=False) + space * 8)
    assert not state.mask(len(tok))[space[0]]  # a ninth blank is not allowed
    assert state.mask(len(tok))[tok.encode('"', add_special_tokens=False)[0]]  # a key is


def test_a_tokenizer_that_cannot_write_the_grammar_is_refused():
    from tiny import tiny_tokenizer

    words = tiny_tokenizer()  # word-level: no '{' in it
    engine = Engine(Verifier(tiny_qwen(seed=0, eos=1), words), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^(tokenizer: llguidance cannot use|constraint: .*cannot write any text)"):
        engine.generate([0, 7], 5, constraint=Constraint.json_object())


@pytest.mark.parametrize("name", ["chain", "tree"])
def test_model_drafters_draft_inside_the_grammar_and_gain_acceptance(model, name):
    # drafts masked along their own paths (DraftGuide): every drafted node is one the grammar allows, the output is
    # unchanged, and where the grammar leaves few tokens (a regex) masked drafts are accepted far more often
    spec = SPECS["regex"]
    reachable, accepted = [], {}
    engine = Engine(Verifier(model, TOK), _drafters()[name], check_tokenizers=False)
    real = engine.drafters[0].propose

    def spying(ctx):
        draft = real(ctx)
        if engine.mask_drafts and len(draft):
            masks = ctx.grammar.tree_masks(draft.parents, draft.tokens, V)
            reachable.append(bool(reachable_nodes(masks, draft.parents, draft.tokens).all()))
            below_eos = [i for i, p in enumerate(draft.parents.tolist()) if p >= 0 and int(draft.tokens[p]) == EOS]
            assert not below_eos, "drafted past an end-of-sequence token: rows no answer keeps"
        return draft
    engine.drafters[0].propose = spying
    texts = {}
    for masked in (False, True):
        engine.mask_drafts = masked
        results = [engine.generate(p, 40, constraint=spec) for p in PROMPTS]
        texts[masked] = [r.token_ids for r in results]
        accepted[masked] = sum(r.stats.accepted for r in results)
        for r in results:  # the step counts hold the kept tokens only, not those accepted past the end
            assert r.stats.committed == len(r.token_ids) and r.stats.accepted < len(r.token_ids)
    assert texts[True] == texts[False]
    assert reachable and all(reachable), "a masked draft left the grammar"
    assert accepted[True] > 2 * max(accepted[False], 1), accepted


@pytest.mark.parametrize("mode", ["rsd_c", "rsd_s"])
def test_sampling_through_grammar_masked_tree_drafts_is_exact(mode):
    # as above, but the drafter knows nothing of the grammar: its q is masked by it (the guide), and the draft carries
    # the masked q it drew from, which rejection sampling uses
    verifier = tiny_qwen(seed=5, vocab=V, layers=1, logit_scale=8.0, eos=EOS)
    draft_model = tiny_qwen(seed=6, vocab=V, layers=1, logit_scale=4.0, eos=EOS)
    shape = {"branching": [3, 1]} if mode == "rsd_c" else {"width": 3}
    drafter = PretrainedTreeDrafter(draft_model, mode=mode, nodes=6, depth=2, **shape)
    check = joint_check(Engine(Verifier(verifier, TOK), drafter, check_tokenizers=False), [5], 2000, length=3,
                        constraint=Constraint.regex(r"[a-d]{2,4}"))
    assert check.pvalue > 1e-4, check
    assert check.taken_at(2) >= 100 and check.tried_at(2) - check.taken_at(2) >= 50, check
