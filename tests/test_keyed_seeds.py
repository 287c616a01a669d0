"""Seeds that hold under load (docs/architecture.md#random-streams): a seeded sampled request draws every token from
Gumbel noise keyed by (seed, position), so the verifier alone decides it - the text equals plain seeded decoding's
whatever was drafted, and whatever ran beside it when the step's draft budget depends on the other requests. The
keyed rule is exact (chi-square at depth 2) and the noise is a pure function of its key. Tiny fp32 models."""
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.batching.scheduler import Scheduler
from metasd.core.decoding.sampling import KeyedNoise
from metasd.core.engine import Engine
from metasd.core.execution.verifier import Verifier
from metasd.drafters import NGramDrafter, PretrainedDrafter, PretrainedTreeDrafter
from metasd.drafters.budgeted import NoSpeculation, budget_arms
from metasd.policies import make_policy
from sampling_check import joint_check
from tiny import tiny_qwen, tiny_tokenizer

PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0, 50, 9], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40], [0, 13]]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_keyed_noise_is_a_pure_function_of_seed_choice_and_position():
    a, b = KeyedNoise(7), KeyedNoise(7)
    assert torch.equal(a.gumbel(12, 50), b.gumbel(12, 50))
    assert not torch.equal(a.gumbel(12, 50), a.gumbel(13, 50))
    assert not torch.equal(a.gumbel(12, 50), KeyedNoise(8).gumbel(12, 50))
    assert not torch.equal(a.gumbel(12, 50), KeyedNoise(7, choice=1).gumbel(12, 50))
    for t in range(40):  # reading many positions evicts and recomputes the same values
        a.gumbel(t, 50)
    assert torch.equal(a.gumbel(12, 50), b.gumbel(12, 50))


def test_a_keyed_choice_is_an_exact_sample_of_its_distribution():
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    n = 20000
    counts = Counter(int(KeyedNoise(s).choose(p, 3)) for s in range(n))
    assert counts[5] == 0  # probability 0: never chosen
    observed = [counts[i] for i in range(5)]
    assert chisquare(observed, [float(x) * n for x in p[:5]]).pvalue > 1e-4


#: for prompt lookup: a vocabulary of 8 and text the sharp verifier continues as a cycle (tests/test_exact_depth.py)
CYCLE = [3, 0, 4, 7, 6, 2, 5, 2, 5, 2, 5, 2, 5, 2, 5, 2, 5]


@pytest.mark.parametrize("kind", ["chain", "tree", "ngram"])
def test_keyed_speculative_decoding_is_plain_keyed_decoding_token_for_token(tok, kind):
    if kind == "ngram":
        verifier, tokenizer, prompts = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=20.0), None, [CYCLE]
        drafter = NGramDrafter(k=4)
    else:
        verifier, tokenizer, prompts = tiny_qwen(seed=0, logit_scale=2.0), tok, PROMPTS[:2]
        q = tiny_qwen(seed=0, logit_scale=1.5)
        drafter = PretrainedDrafter(q, k=4) if kind == "chain" else PretrainedTreeDrafter(q, nodes=8, depth=3, width=2)
    plain = Engine(Verifier(verifier, tokenizer), [], check_tokenizers=False)
    spec = Engine(Verifier(verifier, tokenizer), drafter, check_tokenizers=False)
    accepted = 0
    for seed in range(6):
        for prompt in prompts:
            want = plain.generate(prompt, 24, temperature=1.0, seed=seed)
            got = spec.generate(prompt, 24, temperature=1.0, seed=seed)
            assert got.token_ids == want.token_ids, (seed, prompt)
            accepted += got.stats.accepted
    assert accepted > 0  # drafts were accepted: the equality is not plain decoding's twice


def _adaptive_engine(tok):
    arms = [*budget_arms(PretrainedDrafter(tiny_qwen(seed=0, logit_scale=1.5), k=6, name="chain"), (1, 3, 6)),
            NoSpeculation()]
    return Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tok), arms, make_policy("per_load", len(arms), seed=0),
                  check_tokenizers=False)


def test_a_seeded_request_gives_the_same_text_alone_and_beside_others_under_a_load_dependent_budget(tok):
    # the allocator's node budget for a request depends on how many run beside it (a forward that costs more per
    # token as the batch grows); with draws from the request's own generator that changed its text (#44)
    engine = _adaptive_engine(tok)
    plain = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tok), [], check_tokenizers=False)
    want = [plain.generate(PROMPTS[0], 30, temperature=1.0, seed=s).token_ids for s in range(3)]

    def cost(n):  # flat up to 8 tokens, then steep: one request drafts deep, four share a shallow width
        return 1.0 + max(n - 8, 0) * 0.3

    widths = set()
    for seed in range(3):
        with Scheduler(engine, max_batch=4, adaptive=AdaptiveSpeculation(cost, max_width=24)) as s:
            s.add_listener(lambda r: widths.add(r.adaptive.width) if getattr(r, "adaptive", None) else None)
            alone = s.submit(PROMPTS[0], 30, temperature=1.0, seed=seed).result(timeout=60).token_ids
        with Scheduler(engine, max_batch=4, adaptive=AdaptiveSpeculation(cost, max_width=24)) as s:
            s.add_listener(lambda r: widths.add(r.adaptive.width) if getattr(r, "adaptive", None) else None)
            others = [s.submit(p, 30, temperature=0.9, seed=100 + i) for i, p in enumerate(PROMPTS[1:])]
            beside = s.submit(PROMPTS[0], 30, temperature=1.0, seed=seed)
            got = beside.result(timeout=60).token_ids
            [h.result(timeout=60) for h in others]
        assert alone == got == want[seed]
    assert len(widths) > 1  # the budget did depend on the load


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_keyed_sampling_follows_the_verifier_at_depth_two(kind):
    sharp = 20.0
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp)
    q = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp / 2)
    drafter = PretrainedDrafter(q, k=3) if kind == "chain" else PretrainedTreeDrafter(q, nodes=6, depth=3, width=2)
    engine = Engine(Verifier(verifier), drafter)
    check = joint_check(engine, [3], 4000, length=3, seeded="keyed")
    assert check.pvalue > 1e-4, check
    assert check.tried_at(2) > 200 and 0 < check.taken_at(2) < check.tried_at(2), check


@pytest.mark.parametrize("mode", ["dynamic", "rsd_c"])
def test_a_tree_drafter_drafts_from_the_verifiers_keyed_noise(tok, mode):
    # the drafter is the verifier's own model (q = p): a tree whose first child at every node is the keyed draw at
    # that node's position holds exactly the path plain keyed decoding takes, so every step accepts the full depth.
    # Ranked by q alone (before the coupling), the verifier's keyed draw was often no child at all
    model = tiny_qwen(seed=0, logit_scale=1.0)
    shape = dict(nodes=14, depth=3, width=2, frontier=4) if mode == "dynamic" else dict(nodes=14, depth=3,
                                                                                         branching=[2])
    engine = Engine(Verifier(model, tok), PretrainedTreeDrafter(model, mode=mode, **shape), check_tokenizers=False)
    plain = Engine(Verifier(model, tok), [], check_tokenizers=False)
    for seed in range(3):
        got = engine.generate(PROMPTS[0], 24, temperature=1.0, seed=seed)
        assert got.token_ids == plain.generate(PROMPTS[0], 24, temperature=1.0, seed=seed).token_ids
        full = [t for t in got.stats.tokens_per_step[:-1]]  # the last step may be cut by max_new_tokens
        assert full == [4] * len(full), (seed, got.stats.tokens_per_step)
