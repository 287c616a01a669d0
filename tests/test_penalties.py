"""Presence, frequency and repetition penalties (metasd/core/decoding/penalties.py), applied along each draft node's
own path, and before them a logit bias, allowed tokens and bad words (metasd/core/decoding/processing.py): greedy
output token-identical to a plain penalised decoding loop written independently (one full forward per token, the
penalties token by token: ``sampling_check.penalised``) for chains, trees and lookups, alone and through the scheduler;
sampled output distributed as the penalised verifier's through a tree of depth 2 (chi-square); out-of-range values
refused naming the field. Tiny fp32 models."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.decoding.penalties import Penalties, PathPenalizer
from metasd.core.engine import Engine
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from metasd.drafters import FusedDrafter, NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter, SuffixDrafter
from sampling_check import joint_check, penalised
from tiny import tiny_qwen, tiny_tokenizer, tiny_words

WORDS = tiny_words()  # tiny_tokenizer's tokens, by id
PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41, 7, 7, 7, 12, 13]]
SETTINGS = {"presence": dict(presence_penalty=1.5), "frequency": dict(frequency_penalty=0.7),
            "repetition": dict(repetition_penalty=1.8),
            "all": dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3),
            # a logit bias: the same amount at every position, before the penalties (vLLM's order); -100 bans a token
            "bias": dict(logit_bias={12: 1.0, 9: -100.0, 40: 0.8}),
            "bias and repetition": dict(logit_bias={7: 1.0, 33: -1.0}, repetition_penalty=1.8),
            # vLLM's allowed_token_ids: every other token masked (here a few, EOS among them, so drafts still land)
            "allowed": dict(allowed_token_ids=[t for t in range(64) if t not in (1, 9, 12, 33)]),
            "allowed and frequency": dict(allowed_token_ids=[t for t in range(64) if t not in (1, 7, 23)],
                                          frequency_penalty=0.7),
            # vLLM's bad_words: a word of one token banned everywhere, longer ones only after their first tokens
            # (tiny_tokenizer cannot encode w60..w63: its unknown token w6 is matched inside them)
            "bad words": dict(bad_words=["w29 w18", "w16 w53 w48", "w23"]),
            "bad words and repetition": dict(bad_words=["w56", "w48 w23"], repetition_penalty=1.3)}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _drafters():
    soft = lambda: tiny_qwen(seed=0, logit_scale=3.0)  # noqa: E731
    return {"chain": PretrainedDrafter(soft(), k=4, name="chain"),
            "tree": PretrainedTreeDrafter(soft(), nodes=10, depth=4, width=2, name="tree"),
            "lookup": FusedDrafter([SuffixDrafter(max_depth=8, max_nodes=8, name="suffix"),
                                    NGramDrafter(k=4, n_max=2, name="ngram")], enough=4, name="lookup")}


def _plain_penalised(model, prompt: list[int], n: int, **penalties) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(penalised(logits, prompt, out, **penalties).argmax()))
    return out


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_is_plain_penalised_decoding_token_for_token(model, tok, setting):
    penalties = SETTINGS[setting]
    references = [_plain_penalised(model, p, 24, **penalties) for p in PROMPTS]
    unpenalised = [Engine(Verifier(model, tok), None, check_tokenizers=False).generate(p, 24).token_ids
                   for p in PROMPTS]
    assert references != unpenalised, "the penalties changed nothing: the test could not fail"
    for name, drafter in [("none", None), *_drafters().items()]:
        engine = Engine(Verifier(model, tok), drafter, check_tokenizers=False)
        results = [engine.generate(p, 24, **penalties) for p in PROMPTS]
        assert [r.token_ids for r in results] == references, name
        if name in ("chain", "tree"):  # (penalised text repeats little: lookups may find nothing to draft)
            assert sum(r.stats.accepted for r in results) > 0, f"{name}: nothing accepted, the path rows were not read"


def test_scheduler_applies_each_requests_own_penalties(model, tok):
    engine = Engine(Verifier(model, tok), _drafters()["tree"], check_tokenizers=False)
    asks = [(PROMPTS[0], SETTINGS["all"]), (PROMPTS[1], {}), (PROMPTS[1], SETTINGS["repetition"]),
            (PROMPTS[0], SETTINGS["bias"]), (PROMPTS[1], SETTINGS["bad words and repetition"])]
    with Scheduler(engine, max_batch=5) as s:
        handles = [s.submit(p, 20, **kw) for p, kw in asks]
        got = [h.result(timeout=120).token_ids for h in handles]
    assert got == [_plain_penalised(model, p, 20, **kw) for p, kw in asks]


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("name", ["chain", "tree"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_model_drafters_process_their_rows_as_the_verifier_but_for_the_penalties(model, tok, setting, name):
    """A model drafter with the verifier's own weights processes its rows as the verifier's are processed
    (``DraftProcessing``: bias, allowed ids and bad words along each draft path), so under those it drafts exactly
    what the processed verifier picks: every step accepts its best path whole; with its processing off
    (``Engine.mask_drafts``) it drafts the unprocessed model's picks and loses acceptance. The penalties it leaves
    out (they cost the default pool acceptance, BENCHMARKS.md): under penalties alone its drafts are the same either
    way. The output is the same in every case."""
    twin = tiny_qwen(seed=0, logit_scale=4.0)
    drafter = PretrainedDrafter(twin, k=4, name="chain") if name == "chain" else \
        PretrainedTreeDrafter(twin, nodes=8, depth=4, width=2, frontier=1, name="tree")  # best child expanded
    engine = Engine(Verifier(model, tok), drafter, check_tokenizers=False)
    processing = SETTINGS[setting]
    allowed, drafted = set(processing.get("allowed_token_ids", range(64))), []
    real = engine.drafters[0].propose
    engine.drafters[0].propose = lambda ctx: drafted.append(real(ctx)) or drafted[-1]
    texts, accepted, outside, full, drafts = {}, {}, {}, {}, {}
    for masked in (False, True):
        engine.mask_drafts, drafted[:] = masked, []
        results = [engine.generate(p, 24, **processing) for p in PROMPTS]
        texts[masked], accepted[masked] = [r.token_ids for r in results], sum(r.stats.accepted for r in results)
        outside[masked] = sum(int(t) not in allowed for d in drafted for t in d.tokens)
        full[masked] = all(tau == 5 for r in results for tau in r.stats.tokens_per_step[:-1])
        drafts[masked] = [(d.tokens.tolist(), d.parents.tolist()) for d in drafted]
    assert texts[True] == texts[False] == [_plain_penalised(model, p, 24, **processing) for p in PROMPTS]
    if set(processing) <= set(PENALTIES):  # nothing drafters apply: the same drafts
        assert drafts[True] == drafts[False]
    elif not set(processing) & set(PENALTIES):  # the twin drafts the processed verifier's own picks
        assert full[True] and accepted[True] > accepted[False], (setting, accepted)
    else:  # the bias, allowed ids or bad words applied, the penalties not: other drafts
        assert drafts[True] != drafts[False]
    assert outside[True] == 0 and (outside[False] > 0 or "allowed" not in setting), outside


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("mode", ["chain", "dynamic", "rsd_s"])
def test_processing_that_names_ids_past_a_drafters_head(model, tok, mode, sampled):
    """A drafter whose LM head covers the first 48 ids only (``head_vocab``) under processing that names ids past it:
    allowed ids all outside its head (its rows keep their unprocessed values: nothing to sample otherwise), a bias, a
    ban and penalties on them. The output is the verifier's alone, greedy or seeded, and no draft carries a NaN q."""
    head = dict(head_vocab=48)
    drafter = PretrainedDrafter(tiny_qwen(seed=0, logit_scale=4.0), k=4, **head) if mode == "chain" else \
        PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=4.0), nodes=8, depth=3, width=2, mode=mode, **head)
    sampling = dict(temperature=1.0, seed=1) if sampled else {}
    real = drafter.propose
    for processing in (dict(allowed_token_ids=[50, 51, 60]), dict(allowed_token_ids=[50, 51, 60, 7, 12]),
                       dict(repetition_penalty=1.5, logit_bias={55: 5.0, 3: 2.0}),
                       dict(bad_words=["w50", "w7 w55"], frequency_penalty=1.0, min_tokens=3)):
        want = Engine(Verifier(model, tok), None).generate([0, 50, 7, 12, 55], 16, **processing, **sampling)
        engine, drafts = Engine(Verifier(model, tok), drafter, check_tokenizers=False), []
        engine.drafters[0].propose = lambda ctx: drafts.append(real(ctx)) or drafts[-1]
        got = engine.generate([0, 50, 7, 12, 55], 16, **processing, **sampling)
        assert got.token_ids == want.token_ids, processing
        # every q a sampled draft carries is a distribution (a row of nothing would be NaN)
        assert all(bool(torch.isfinite(d.probs).all()) for d in drafts if d.probs is not None), processing

def test_rows_are_penalised_along_their_own_path():
    pen = PathPenalizer(Penalties(frequency=1.0), prompt_ids=[1])
    logits = torch.zeros(4, 5)  # [n+1, vocab]: root and three nodes
    draft = Draft(tokens=torch.tensor([2, 3, 2]), parents=torch.tensor([-1, 0, -1]))  # 2 -> 3, and a sibling 2
    pen.commit([4, 4])
    out = pen.apply(logits, draft.paths())
    assert out[0].tolist() == [0, 0, 0, 0, -2]  # committed: token 4 twice
    assert out[1].tolist() == [0, 0, -1, 0, -2]  # after node 0 (token 2)
    assert out[2].tolist() == [0, 0, -1, -1, -2]  # after node 1: the path 2, 3
    assert out[3].tolist() == [0, 0, -1, 0, -2]  # the sibling's path holds its own 2 only
    assert logits.abs().sum() == 0  # the verifier's logits are not touched (log-probabilities read them raw)


#: sampled processing, each from the first tokens plain sampling drew (``plain``) on the 8-token pair below
SAMPLED = {"penalties": lambda plain: dict(presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=1.5),
           # the unbiased first token made less likely, another more
           "bias": lambda plain: dict(logit_bias={plain[0]: -4.0, (plain[0] + 1) % 8: 3.0}),
           # the first tokens plain sampling drew, not allowed
           "allowed": lambda plain: dict(allowed_token_ids=sorted(set(range(8)) - {plain[0], plain[1]})),
           # the third token plain sampling drew banned after the second, and token 5 anywhere (a word a token)
           "bad words": lambda plain: dict(bad_words=[f"{WORDS[plain[1]]} {WORDS[plain[2]]}", WORDS[5]])}


@pytest.mark.parametrize("kind", sorted(SAMPLED))
def test_sampled_tokens_follow_the_processed_verifier_through_a_tree_of_depth_2(kind):
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=20.0)
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=10.0), mode="rsd_s", width=3,
                                    nodes=6, depth=2)
    engine = Engine(Verifier(verifier, tiny_tokenizer(8)), drafter)
    processing = SAMPLED[kind](engine.generate([3], 3, temperature=1.0, seed=0).token_ids)
    check = joint_check(engine, [3], 2000, length=3, **processing)
    assert check.pvalue > 1e-4, check
    assert check.taken_at(2) >= 100 and check.tried_at(2) - check.taken_at(2) >= 50, check


@pytest.mark.parametrize("bias, message", [({70: 1.0}, "token id 70 is outside the vocabulary (0..63)"),
                                           ({-1: 1.0}, "token id -1 is outside"), ({"5": 1.0}, "token id '5'"),
                                           ({5: 101.0}, "the bias of token 5 must be a number in [-100, 100]"),
                                           ({5: float("nan")}, "must be a number in [-100, 100], got nan"),
                                           ([5], "logit_bias must map token ids to numbers")])
def test_a_bad_logit_bias_is_refused_naming_the_field(model, tok, bias, message):
    engine = Engine(Verifier(model, tok), None, check_tokenizers=False)
    with pytest.raises(ValueError, match="^logit_bias") as e:
        engine.generate([0, 5], 3, logit_bias=bias)
    assert message in str(e.value)


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("repetition_penalty", 0.0), ("presence_penalty", "1"),
                                          ("repetition_penalty", True)])
def test_out_of_range_penalties_are_refused_naming_the_field(model, tok, field, value):
    engine = Engine(Verifier(model, tok), None, check_tokenizers=False)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        engine.generate([0, 5], 3, **{field: value})
