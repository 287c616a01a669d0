"""A probe reads a budget sampled only a few times at its upper confidence bound (``AcceptanceCurve.hopeful_many``).

Seen on one request over HTTP (coding prompts, a CPU without AVX512-BF16): the level's first 16-node draft accepted 1
token; its 4-node probes then accepted 4, 4, 0, 2, 4, 4, 4, 3 - a mediocre mean, often accepted whole. Read as the
chain the 4-node budget implies, 16 nodes rated below 4, every probe drafted 4 nodes for 180 steps and the 16-node
budget kept its one unlucky sample; 16-node drafts made later accepted 15, 14 and 7."""
import pytest

from metasd.core.pricing.acceptance_curve import AcceptanceCurve, geometric_prior, implied_alpha
from metasd.core.batching.probes import probe
from metasd.core.pricing.allocator import Allocation

FOUR_NODE_PROBES = [4, 4, 0, 2, 4, 4, 4, 3]  # accepted tokens of the 4-node probes after the unlucky draft


def _unlucky_then_narrow() -> AcceptanceCurve:
    curve = AcceptanceCurve()
    curve.update([0], 16)  # the level's first wide draft: 16 nodes, 1 accepted
    for accepted in FOUR_NODE_PROBES:
        curve.update(list(range(accepted)), 4)
    return curve


def test_a_budget_sampled_once_is_read_at_its_upper_confidence_bound():
    curve = _unlucky_then_narrow()
    learnt = curve.expected(16)
    chain = geometric_prior(implied_alpha(curve.expected(4), 4), 16)  # the hope the 4-node budget alone gives
    assert learnt < 2.5 and chain < 3.5
    n = curve.n_eff()[4]  # grid point 16: one sample
    assert n == 1
    bound = learnt + (16 - learnt) * curve.prior_weight / (curve.prior_weight + n)
    hopeful = curve.hopeful_many([1, 2, 4, 8, 16, 64])
    assert hopeful[4] == pytest.approx(bound) and hopeful[4] > 2.5 * chain
    assert hopeful[:3].tolist() == curve.expected_many([1, 2, 4]).tolist()  # the well-sampled budgets as learnt
    assert hopeful[5] == pytest.approx(hopeful[4])  # a budget never sampled: no bound of its own (the prior's hope)
    assert all(b >= a for a, b in zip(hopeful, hopeful[1:]))
    assert all(h <= d for h, d in zip(hopeful, [1, 2, 4, 8, 16, 64]))
    assert curve.expected(16) == learnt  # the allocator's own reading is unchanged


def test_the_bound_shrinks_as_the_budget_samples_come_in():
    curve = _unlucky_then_narrow()
    gaps = []
    for _ in range(6):  # wide drafts as bad as the first: the hope goes
        gaps.append(float(curve.hopeful_many([16])[0] - curve.expected(16)))
        curve.update([0], 16)
    assert all(b < a for a, b in zip(gaps, gaps[1:])) and gaps[0] > 5
    for _ in range(20):
        curve.update([0], 16)
    assert curve.hopeful_many([16]).tolist() == curve.expected_many([16]).tolist()  # as well sampled: read as learnt


def _forward(n):  # one request on a CPU: the forward grows with its tokens
    return 1.0 + 0.05 * n


def _drafting(d):  # drafting priced per step: dear, one verifier forward and more per node of depth
    return 0.0 if d <= 0 else 1.0 + 0.3 * d


def test_a_probe_after_one_unlucky_wide_draft_samples_the_wide_budget_again():
    curve = _unlucky_then_narrow()
    plain = Allocation([0], 0, 1.0 / _forward(1), {0: 1.0 / _forward(1)}, [0], 1.0)
    out = probe(plain, [curve], [48], _forward, [_drafting], 48, least=4, most=32)
    assert out.probe and out.nodes == [16]  # rated 1.3x the plain step at its bound; 4 nodes 0.97x
    for _ in range(10):  # the wide budget sampled, as bad as its first draft: the probes go back to narrow
        curve.update([0], 16)
    again = probe(plain, [curve], [48], _forward, [_drafting], 48, least=4, most=32)
    assert again.probe and again.nodes == [4]
