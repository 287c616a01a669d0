"""Acceptance rules on hand-built token arrays, and exactness by enumeration on a toy language."""
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from metasd.core.decoding.acceptance import accept_greedy, accept_match, accept_rejection
from metasd.core.decoding.sampling import SamplingParams, process_logits
from metasd.core.execution.tree import Draft, ancestor_mask, node_depths
from sampling_check import chi_square


# ---------------------------------------------------------------- greedy on hand-built arrays
def test_greedy_chain_accepts_longest_matching_prefix():
    draft = Draft.chain([5, 7, 9])
    #              row: 0  1  2  3   (row i+1 scores the token after node i)
    argmax = torch.tensor([5, 7, 4, 1])
    acc = accept_greedy(draft, argmax)
    assert acc.path == [0, 1] and acc.bonus == 4
    assert accept_greedy(draft, torch.tensor([5, 7, 9, 2])).path == [0, 1, 2]
    assert accept_greedy(draft, torch.tensor([5, 7, 9, 2])).bonus == 2
    assert accept_greedy(draft, torch.tensor([3, 7, 9, 2])).path == []
    assert accept_greedy(Draft.empty(), torch.tensor([6])).bonus == 6


def test_greedy_tree_follows_matching_branch():
    # root -> {a=1 (node0), b=2 (node1)}; node1 -> {c=3 (node2), d=4 (node3)}; node3 -> e=5 (node4)
    draft = Draft(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 1, 1, 3])
    argmax = torch.tensor([2, 9, 4, 9, 5, 8])  # root wants 2 -> node1; node1 wants 4 -> node3; node3 wants 5 -> node4
    acc = accept_greedy(draft, argmax)
    assert acc.path == [1, 3, 4] and acc.bonus == 8


def test_tree_structure_helpers():
    parents = torch.tensor([-1, -1, 1, 1, 3])
    assert node_depths(parents).tolist() == [1, 1, 2, 2, 3]
    mask = ancestor_mask(parents)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for row, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3], 4: [0, 2, 4], 5: [0, 2, 4, 5]}.items():
        expected[row, ancestors] = True
    assert torch.equal(mask, expected)
    with pytest.raises(ValueError, match="parents"):
        Draft(tokens=[1, 2], parents=[1, -1])
    t = Draft(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 1, 1, 3]).truncated(2)
    assert t.tokens.tolist() == [1, 2, 3, 4] and t.parents.tolist() == [-1, -1, 1, 1]


def test_a_batchs_inputs_show_each_query_its_prefix_its_ancestors_and_itself():
    # batch_inputs builds them from each shape's cached layout: check every cell against the definition
    from metasd.core.execution.batch_verifier import batch_inputs
    from metasd.core.execution.tree import DeviceTokens

    rng = np.random.default_rng(0)
    drafts = [Draft.empty(), Draft.chain([5, 6, 7]), Draft(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 1, 1, 3])]
    for n in (4, 9):  # random trees, the second twice (one shape cached, two drafts)
        parents = [int(rng.integers(-1, i)) for i in range(n)]
        drafts += [Draft(list(range(10, 10 + n)), parents), Draft(DeviceTokens(torch.arange(n)), parents)]
    lengths, pendings = [3, 0, 7, 2, 5, 5, 1][: len(drafts)], list(range(90, 90 + len(drafts)))
    ids, pos, mask = batch_inputs(lengths, pendings, drafts)
    B, N = len(drafts), 1 + max(len(d) for d in drafts)
    W = max(lengths) + N
    assert ids.shape == pos.shape == (B, N) and mask.shape == (B, 1, N, W)
    for b, (length, draft) in enumerate(zip(lengths, drafts)):
        n, parents = len(draft), draft.parents.tolist()
        ancestors = [{0}]  # index 0: the pending token; node i: index i + 1
        for i, p in enumerate(parents):
            ancestors.append(ancestors[p + 1] | {i + 1})
        for q in range(N):
            seen = set(range(length)) | ({length + j for j in ancestors[q]} if q <= n else {length + q})
            assert [c for c in range(W) if mask[b, 0, q, c]] == sorted(seen), (b, q)
        depth = [len(a) - 1 for a in ancestors]
        assert pos[b].tolist() == [length + d for d in depth] + list(range(length + n + 1, length + N))
        on_host = draft.tokens.tolist() if draft.on_host else [0] * n
        assert ids[b].tolist() == [pendings[b], *on_host] + [0] * (N - n - 1)


def test_top_k_top_p_processing():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and torch.allclose(p.sum(), torch.tensor(1.0))
    assert process_logits(logits, SamplingParams()).tolist() == [1, 0, 0, 0]
    for bad in (dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(min_p=-0.1),
                dict(min_p=1.5), dict(min_p=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_min_p_processing():
    """min-p keeps the tokens at least min_p times as likely as the most likely one, renormalised."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.3))  # threshold 0.15: 0.15 stays
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    assert process_logits(logits, SamplingParams(temperature=1.0, min_p=1.0)).tolist() == [1, 0, 0, 0]
    assert process_logits(logits, SamplingParams(temperature=1.0, min_p=0.0)).allclose(torch.tensor([.5, .3, .15, .05]))


@pytest.mark.parametrize("settings", [dict(min_p=0.05), dict(top_k=40, min_p=0.1), dict(top_p=0.9, min_p=0.02),
                                      dict(temperature=0.6, top_k=20, top_p=0.8, min_p=0.01)])
def test_processing_matches_transformers_warpers(settings):
    """temperature, top-k, top-p and min-p in transformers' order, against transformers' own warpers (an independent
    implementation) on random logits rows."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    settings = {"temperature": 1.0, **settings}
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3  # [rows, vocab]
    warpers = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if settings.get("top_k"):
        warpers.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p"):
        warpers.append(TopPLogitsWarper(settings["top_p"]))
    warpers.append(MinPLogitsWarper(settings["min_p"]))
    reference = warpers(torch.zeros(6, 1, dtype=torch.long), logits.clone()).softmax(-1)
    ours = process_logits(logits, SamplingParams(**settings))
    assert ((ours > 0) == (reference > 0)).all() and torch.allclose(ours, reference, atol=1e-6)
    assert (reference == 0).sum() > 0  # the warpers dropped something: the comparison is not vacuous


# ---------------------------------------------------------------- exactness by enumeration
V = 4


class ToyLanguage:
    """Next-token tables p(. | prefix) for prefixes of length <= 3 over a vocabulary of V tokens."""

    def __init__(self, seed: int, alpha: float):
        rng = np.random.default_rng(seed)
        self.table = {
            prefix: torch.tensor(rng.dirichlet([alpha] * V), dtype=torch.float32)
            for n in range(4)
            for prefix in itertools.product(range(V), repeat=n)
        }

    def __call__(self, prefix) -> torch.Tensor:
        return self.table[tuple(prefix)]


def _exact_pairs(p: ToyLanguage) -> torch.Tensor:
    return torch.stack([p(())[a] * p((a,)) for a in range(V)])  # [V, V]: P(x1 = a, x2 = b)


def _chain_sample(p, q, g, depth=2, rule=accept_rejection, with_probs=True):
    tokens, probs = [], []
    for _ in range(depth):
        dist = q(tokens)
        tokens.append(int(torch.multinomial(dist, 1, generator=g)))
        probs.append(dist)
    draft = Draft.chain(tokens, torch.stack(probs) if with_probs else None)
    rows = torch.stack([p(tokens[:i]) for i in range(depth + 1)])
    acc = rule(draft, rows, g)
    return [tokens[i] for i in acc.path] + [acc.bonus]


def _tree_sample(p, q, g, without_replacement=True, flag=None):
    """Two root children drawn from q(()) (without or with replacement), one grandchild under each."""
    root_q = q(())
    first = int(torch.multinomial(root_q, 1, generator=g))
    if without_replacement:
        rest = root_q.clone()
        rest[first] = 0
        second = int(torch.multinomial(rest / rest.sum(), 1, generator=g))
    else:
        second = int(torch.multinomial(root_q, 1, generator=g))
    kids = [int(torch.multinomial(q((c,)), 1, generator=g)) for c in (first, second)]
    draft = Draft(tokens=[first, second, kids[0], kids[1]], parents=[-1, -1, 0, 1],
                  probs=torch.stack([root_q, root_q, q((first,)), q((second,))]),
                  without_replacement=without_replacement if flag is None else flag)
    rows = torch.stack([p(()), p((first,)), p((second,)), p((first, kids[0])), p((second, kids[1]))])
    acc = accept_rejection(draft, rows, g)
    return [int(draft.tokens[i]) for i in acc.path] + [acc.bonus]


def _pair_pvalue(sampler, p: ToyLanguage, n: int, seed: int) -> float:
    """Chi-square p-value of n sampled pairs against the exact ones (``sampling_check.chi_square``: pairs expected
    fewer than 5 times pooled into one cell)."""
    g = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(n):
        out = sampler(g)
        if len(out) < 2:  # continue with plain decoding from the verifier (exact by definition)
            out = out + [int(torch.multinomial(p(out), 1, generator=g))]
        counts[tuple(out[:2])] += 1
    exact = {(a, b): float(pr) for (a, b), pr in np.ndenumerate(_exact_pairs(p).double().numpy())}
    return chi_square(counts, exact, n)[0]


@pytest.fixture(scope="module")
def toy():
    # peaked tables (alpha 0.3): duplicate siblings are frequent, so a wrong rule shows
    p = ToyLanguage(seed=1, alpha=0.3)
    q = ToyLanguage(seed=11, alpha=0.3)
    return p, q


N = 12000


def test_chain_rejection_sampling_is_exact(toy):
    p, q = toy
    assert _pair_pvalue(lambda g: _chain_sample(p, q, g), p, N, seed=0) > 1e-3


def test_chain_sample_and_match_is_exact(toy):
    p, q = toy
    assert _pair_pvalue(lambda g: _chain_sample(p, q, g, rule=accept_match, with_probs=False), p, N, seed=1) > 1e-3


def test_tree_recursive_rejection_without_replacement_is_exact(toy):
    p, q = toy
    assert _pair_pvalue(lambda g: _tree_sample(p, q, g), p, N, seed=2) > 1e-3


def test_tree_recursive_rejection_with_replacement_is_exact(toy):
    p, q = toy
    assert _pair_pvalue(lambda g: _tree_sample(p, q, g, without_replacement=False), p, N, seed=3) > 1e-3


def test_tree_sample_and_match_is_exact(toy):
    p, q = toy

    def sampler(g):
        root_q = q(())
        a, b = torch.multinomial(root_q, 2, replacement=False, generator=g).tolist()
        draft = Draft(tokens=[a, b, int(torch.multinomial(q((a,)), 1, generator=g))], parents=[-1, -1, 0])
        rows = torch.stack([p(()), p((a,)), p((b,)), p((a, int(draft.tokens[2])))])
        acc = accept_match(draft, rows, g)
        return [int(draft.tokens[i]) for i in acc.path] + [acc.bonus]

    assert _pair_pvalue(sampler, p, N, seed=4) > 1e-3


# The statistical test must be able to fail: wrong rules give a tiny p-value.
def test_wrong_rule_always_accept_is_detected(toy):
    p, q = toy

    def accept_all(draft, rows, g):
        from metasd.core.decoding.acceptance import Acceptance
        return Acceptance(list(range(len(draft))), int(torch.multinomial(rows[-1], 1, generator=g)))

    assert _pair_pvalue(lambda g: _chain_sample(p, q, g, rule=accept_all), p, N, seed=5) < 1e-6


def test_with_replacement_verified_as_without_is_detected(toy):
    p, q = toy
    sampler = lambda g: _tree_sample(p, q, g, without_replacement=False, flag=True)  # noqa: E731
    assert _pair_pvalue(sampler, p, N, seed=6) < 1e-6
