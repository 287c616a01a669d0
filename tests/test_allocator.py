"""Speculation under load, the pure parts (docs/algorithms.md#speculation-under-load): acceptance curves
(``metasd.core.pricing.acceptance_curve``), the step budget allocator (``metasd.core.pricing.allocator``) and the
goodput reward of a batched step (``metasd.core.pricing.goodput``). No model, no clock: seeded inputs and worked examples.
"""
from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest

from metasd.core.pricing.acceptance_curve import (DEFAULT_GRID, AcceptanceCurve, accepted_within, geometric_prior,
                                                 implied_alpha)
from metasd.core.pricing.allocator import allocate, candidate_widths, expected_goodput, plan
from metasd.core.pricing.goodput import (
    counterfactual_goodput,
    counterfactual_share,
    goodput_reward,
    shared_step_cost,
)
from metasd.core.decoding.rewards import Throughput

# measured on the CPU (1.5B verifier, bf16): ms of one forward by total tokens (8 tokens: between one row of 8, 224 ms,
# and 8 rows of 1, 275 ms); beyond 64 tokens the 32 -> 64 slope continues
MEASURED_MS = [(1, 191.0), (8, 250.0), (32, 420.0), (64, 675.0)]


def measured_cost(n_tokens: int) -> float:
    """The measured forward cost in units of a 1-token forward (piecewise linear through ``MEASURED_MS``)."""
    xs, ys = zip(*MEASURED_MS)
    ms = np.interp(n_tokens, xs, ys) if n_tokens <= xs[-1] else ys[-1] + (n_tokens - xs[-1]) * (675 - 420) / 32
    return float(ms) / 191.0


def affine_cost(n_tokens: int) -> float:
    return 1.0 + 0.05 * (n_tokens - 1)


class Geometric:
    """A curve with a closed form: a chain accepted token by token with probability ``alpha``."""

    grid = DEFAULT_GRID

    def __init__(self, alpha: float):
        self.alpha = alpha

    def expected(self, d: float) -> float:
        return geometric_prior(self.alpha, d)


def random_curve(rng: np.random.Generator) -> AcceptanceCurve:
    """An AcceptanceCurve trained on a random drafter: chains and trees of random sizes and budgets."""
    curve = AcceptanceCurve(decay=float(rng.choice([0.0, 0.5, 0.95])), prior_alpha=float(rng.random()))
    alpha = rng.random()
    for _ in range(int(rng.integers(0, 40))):
        drafted = int(rng.integers(0, 70))
        if rng.random() < 0.5:  # a chain: accepted count
            n = 0
            while n < drafted and rng.random() < alpha:
                n += 1
            path = n
        else:  # a tree path: increasing node indices
            nodes = sorted(rng.choice(drafted, size=min(drafted, int(rng.integers(0, 6))), replace=False).tolist()) \
                if drafted else []
            path = nodes
        budget = drafted + int(rng.integers(0, 20)) if rng.random() < 0.3 else None
        curve.update(path, drafted, budget=budget)
    return curve


def random_cost(rng: np.random.Generator):
    """A positive non-decreasing forward cost: affine, convex or concave (like the measured one)."""
    a, b = 1.0, float(rng.uniform(0.001, 0.3))
    kind = rng.integers(0, 3)
    if kind == 0:
        return lambda n: a + b * (n - 1)
    if kind == 1:
        return lambda n: a + b * (n - 1) + 0.002 * (n - 1) ** 2
    return lambda n: a + b * 8 * np.sqrt(n - 1)


# ---------------------------------------------------------------------------------------------- acceptance curve
def test_accepted_within_is_the_path_prefix_below_the_budget():
    assert accepted_within([0, 3, 9], 1) == 1
    assert accepted_within([0, 3, 9], 3) == 1
    assert accepted_within([0, 3, 9], 4) == 2
    assert accepted_within([0, 3, 9], 10) == 3
    assert accepted_within([], 8) == 0


def test_one_verified_draft_samples_every_smaller_budget():
    curve = AcceptanceCurve(grid=(1, 2, 4, 8, 16, 32), decay=0.5)
    curve.update([0, 3, 9], 16)  # a tree: nodes 0 -> 3 -> 9 accepted out of 16
    assert curve.counts.tolist() == [1, 1, 1, 1, 1, 0]
    assert curve.means.tolist() == [1, 1, 2, 2, 3, 0]
    curve.update(2, 4, budget=32)  # a chain of 4 (the drafter stopped early under a budget of 32): 2 accepted
    assert curve.counts.tolist() == [2, 2, 2, 2, 2, 1]
    assert curve.means.tolist() == [1, 1.5, 2, 2, 2.5, 2]  # 8, 16, 32 would have drafted the same 4 nodes
    with pytest.raises(ValueError, match="does not fit"):
        curve.update([0, 5], 4)


def test_estimator_is_the_plain_mean_first_then_exponential():
    curve = AcceptanceCurve(grid=(8,), decay=0.9)  # memory 10 samples
    for x in (2, 4, 6):
        curve.update(x, 8)
    assert curve.means[0] == pytest.approx(4.0)  # plain mean of the first samples, no pull towards 0
    for _ in range(100):
        curve.update(6, 8)
    for _ in range(60):
        curve.update(1, 8)
    assert curve.means[0] == pytest.approx(1.0, abs=0.02)  # tracks the drift; a plain mean would be ~4
    assert curve.n_eff()[0] == pytest.approx(10.0)


def test_prior_for_unseen_budgets():
    curve = AcceptanceCurve(prior_alpha=0.5, prior_weight=1.0)
    np.testing.assert_allclose(curve.values(), [geometric_prior(0.5, d) for d in DEFAULT_GRID])
    for _ in range(30):
        curve.update(5, 8)  # only budgets <= 8 are seen
    values = dict(zip(DEFAULT_GRID, curve.values().tolist()))
    seen8 = (1 * geometric_prior(0.5, 8) + 20 * 5) / 21  # prior worth one sample, n_eff capped at 20
    assert values[8] == pytest.approx(seen8)
    alpha = implied_alpha(seen8, 8)  # beyond the widest seen budget: the chain 8's value implies
    assert geometric_prior(alpha, 8) == pytest.approx(seen8)
    for d in (16, 32, 48, 64):
        assert values[d] == pytest.approx(geometric_prior(alpha, d)) and values[d] > seen8
    assert values[1] == pytest.approx((geometric_prior(0.5, 1) + 20 * 1) / 21)  # seen points keep their means
    assert curve.expected(200) == pytest.approx(values[64])


def test_beyond_the_widest_seen_budget_is_never_below_it_nor_the_prior():
    curve = AcceptanceCurve(prior_alpha=0.5)
    for _ in range(30):
        curve.update(0, 2)  # nothing accepted at budgets 1, 2
    values = dict(zip(DEFAULT_GRID, curve.values().tolist()))
    assert values[4] == pytest.approx(geometric_prior(0.5, 4))  # implied alpha ~0: the prior is higher
    assert implied_alpha(0.0, 4) == 0.0 and implied_alpha(4.0, 4) == 1.0
    assert implied_alpha(geometric_prior(0.3, 8), 8) == pytest.approx(0.3, abs=1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_curve_is_monotone_and_at_most_d(seed):
    curve = random_curve(np.random.default_rng(seed))
    values = curve.values()
    assert np.all(np.diff(values) >= 0) and np.all(values <= curve.grid) and np.all(values >= 0)
    ds = np.linspace(0, 80, 321)
    e = curve.expected_many(ds)
    assert np.all(np.diff(e) >= -1e-12) and np.all(e <= ds + 1e-12)
    assert curve.expected(0) == 0.0


def test_curve_monotone_when_wider_budgets_saw_worse_drafts():
    curve = AcceptanceCurve(grid=(1, 2, 4, 8), decay=0.9)  # memory 10 samples
    for _ in range(10):
        curve.update(4, 4)  # narrow drafts accepted in full
    for _ in range(3):
        curve.update(0, 8)  # the rare wide drafts failed at once
    n_eff, prior = curve.n_eff(), curve.prior
    raw = (prior + n_eff * curve.means) / (1 + n_eff)
    assert raw[3] < raw[2]  # the raw estimates violate monotonicity ...
    pooled = ((1 + n_eff[2]) * raw[2] + (1 + n_eff[3]) * raw[3]) / (2 + n_eff[2] + n_eff[3])
    values = curve.values()
    assert np.all(np.diff(values) >= 0)
    assert values[2] == pytest.approx(pooled) and values[3] == pytest.approx(pooled)  # ... pooled, weighted by counts


def test_curve_state_roundtrip():
    curve = random_curve(np.random.default_rng(3))
    blob = json.dumps(curve.state_dict())
    restored = AcceptanceCurve(decay=curve.decay, prior_alpha=curve.prior_alpha)
    restored.load_state_dict(json.loads(blob))
    np.testing.assert_array_equal(restored.values(), curve.values())
    with pytest.raises(ValueError, match="grid"):
        AcceptanceCurve(grid=(1, 2)).load_state_dict(json.loads(blob))


# ---------------------------------------------------------------------------------------------- allocator
def random_batch(rng: np.random.Generator, *, priced: bool | None = None):
    B = int(rng.integers(0, 13))
    curves = [None if rng.random() < 0.15 else (random_curve(rng) if rng.random() < 0.5 else Geometric(rng.random()))
              for _ in range(B)]
    caps = rng.integers(0, 65, size=B).tolist()
    max_width = None if rng.random() < 0.5 else int(rng.integers(0, 65))
    if priced is None:
        priced = rng.random() < 0.5
    draft_costs = None
    if priced:
        slopes = rng.uniform(0.0, 0.4, size=B)
        draft_costs = [None if rng.random() < 0.2 else (lambda d, s=float(s): s * d) for s in slopes]
    return curves, caps, max_width, draft_costs, random_cost(rng)


@pytest.mark.parametrize("seed", range(200))
def test_allocation_stays_in_budget_keeps_pending_tokens_and_is_deterministic(seed):
    curves, caps, max_width, draft_costs, cost = random_batch(np.random.default_rng(seed))
    a = plan(curves, caps, cost, max_width=max_width, draft_costs=draft_costs)
    assert len(a.nodes) == len(curves)
    for d, cap, curve in zip(a.nodes, caps, curves):
        assert isinstance(d, int) and 0 <= d <= cap  # d = 0: the pending token alone, still verified
        assert max_width is None or d <= max_width
        assert curve is not None or d == 0
    if curves:
        assert a.goodput == pytest.approx(expected_goodput(curves, a.nodes, cost, draft_costs=draft_costs))
        assert a.goodput == max(a.table.values()) and a.table[a.width] == a.goodput
        assert max(a.nodes) <= a.width
        # the tokens it expects to commit: the pending token per request plus each curve's acceptance at its budget
        assert a.tokens == pytest.approx(len(curves) + sum(0.0 if cu is None else min(max(cu.expected(d), 0.0), d)
                                                           for cu, d in zip(curves, a.nodes)))
    again = plan(curves, caps, cost, max_width=max_width, draft_costs=draft_costs)
    assert again == a
    assert allocate(curves, caps, cost, max_width=max_width, draft_costs=draft_costs) == a.nodes


def test_no_speculation_when_acceptance_is_nil_and_the_cost_steep():
    curve = AcceptanceCurve()
    for _ in range(50):
        curve.update(0, 64)  # nothing ever accepted
    steep = lambda n: float(n)  # every token costs a full forward  # noqa: E731
    a = plan([curve] * 4, [64] * 4, steep)
    assert a.nodes == [0, 0, 0, 0] and a.width == 0
    assert a.goodput == pytest.approx(4 / steep(4))


def test_wide_drafts_at_batch_one_with_high_acceptance_and_the_measured_costs():
    a = plan([Geometric(0.9)], [64], measured_cost)
    assert a.width >= 8 and a.nodes == [a.width]
    assert a.width == 16  # worked: (1 + a(16)) / cost(17) = 8.33 / 1.64 = 5.07 beats w = 8 (4.55) and 32 (4.33)
    assert a.goodput == pytest.approx(5.07, abs=0.01)


def test_width_shrinks_as_the_batch_grows_with_the_measured_costs():
    widths = [plan([Geometric(0.9)] * B, [64] * B, measured_cost).width for B in (1, 2, 4, 8, 16, 32)]
    assert widths == sorted(widths, reverse=True)
    assert widths[0] >= 4 * widths[-1]
    assert widths == [16, 16, 8, 4, 4, 2]


def test_padding_prices_every_row_at_the_widest_draft():
    """Three requests that cannot speculate (cap 0) beside one that can: its width pads all four rows, so it stays
    narrow (w = 4, not B = 1's 16): the forward is 4 x 5 tokens, not 4 + 4."""
    curve = Geometric(0.9)
    a = plan([curve] * 4, [64, 0, 0, 0], measured_cost)
    assert a.nodes == [4, 0, 0, 0]
    assert a.goodput == pytest.approx((4 + curve.expected(4)) / measured_cost(4 * 5))
    assert expected_goodput([curve] * 4, [4, 0, 0, 0], measured_cost) == pytest.approx(a.goodput)


def brute_force_fixed_widths(curves, caps, cost, widths):
    """Goodput of every fixed common width w (d_i = min(w, cap_i), 0 without a curve)."""
    out = {}
    for w in widths:
        nodes = [0 if cu is None else min(w, c) for cu, c in zip(curves, caps)]
        out[w] = expected_goodput(curves, nodes, cost)
    return out


@pytest.mark.parametrize("seed", range(100))
def test_allocator_beats_or_equals_every_fixed_width(seed):
    rng = np.random.default_rng(1000 + seed)
    curves, caps, _, _, cost = random_batch(rng, priced=False)
    if not curves:
        return
    top = max(caps)
    a = plan(curves, caps, cost)
    # the scanned candidates: every one of them is a fixed width the allocator weighed
    for w, g in brute_force_fixed_widths(curves, caps, cost, candidate_widths(curves, caps)).items():
        assert a.goodput >= g - 1e-12, (w, g, a.goodput)
    # every integer width, when the allocator scans them all
    full = plan(curves, caps, cost, widths=range(top + 1))
    for w, g in brute_force_fixed_widths(curves, caps, cost, range(top + 1)).items():
        assert full.goodput >= g - 1e-12, (w, g, full.goodput)
    # with piecewise-linear curves (AcceptanceCurve) and an affine cost the default candidates suffice: between two
    # candidates the goodput is linear / affine in w, so its best is at one of them
    curves = [cu if isinstance(cu, AcceptanceCurve) else None for cu in curves]
    a = plan(curves, caps, affine_cost)
    for w, g in brute_force_fixed_widths(curves, caps, affine_cost, range(top + 1)).items():
        assert a.goodput >= g - 1e-12, (w, g, a.goodput)


@pytest.mark.parametrize("seed", range(60))
def test_allocator_with_drafting_costs_matches_exhaustive_search(seed):
    rng = np.random.default_rng(5000 + seed)
    B = int(rng.integers(1, 4))
    grid = (1, 2, 4, 8, 16)
    curves = [Geometric(float(rng.random())) for _ in range(B)]
    for cu in curves:
        cu.grid = grid
    caps = rng.choice([0, 3, 8, 16], size=B).tolist()
    slopes = rng.uniform(0.0, 0.3, size=B)
    draft_costs = [lambda d, s=float(s): s * d for s in slopes]
    cost = random_cost(rng)
    a = plan(curves, caps, cost, draft_costs=draft_costs)
    options = [[d for d in sorted({0, *grid, cap}) if d <= cap] for cap in caps]
    best = max(expected_goodput(curves, list(nodes), cost, draft_costs=draft_costs)
               for nodes in itertools.product(*options))
    assert a.goodput >= best - 1e-12
    assert a.goodput == pytest.approx(best)


def test_a_curve_or_cost_shared_by_requests_is_read_once_and_allocates_as_copies_would():
    reads = []

    class Counted(Geometric):
        def expected_many(self, ds):
            reads.append(self)
            return np.array([self.expected(int(d)) for d in ds])

    class Cost:
        def __init__(self, slope):
            self.slope = slope

        def __call__(self, d):
            return self.slope * d

        def many(self, ds):
            reads.append(self)
            return self.slope * np.asarray(ds, dtype=np.float64)

    curve, cost = Counted(0.7), Cost(0.02)
    curve.grid = (1, 2, 4, 8, 16)
    shared = plan([curve] * 16, [4, 16] * 8, affine_cost, draft_costs=[cost] * 16)
    assert reads == [curve, cost]  # one read each for the 16 requests
    copies = [Counted(0.7) for _ in range(16)]
    for cu in copies:
        cu.grid = curve.grid
    alone = plan(copies, [4, 16] * 8, affine_cost, draft_costs=[Cost(0.02) for _ in range(16)])
    assert len(reads) == 2 + 32 and shared == alone and shared.width > 0

    class Both(Counted):  # one object as a request's curve and as its drafting cost: read as each
        many = Cost.many
        __call__ = Cost.__call__

    both = Both(0.7)
    both.grid, both.slope = curve.grid, 0.02
    assert plan([both] * 16, [4, 16] * 8, affine_cost, draft_costs=[both] * 16) == shared


def goodput_of_options(curves, alternatives, draft_costs, choice, cost):
    """Expected goodput of ``choice`` (per request: (option, d)), option 0 the arm's curve and cost."""
    picked = [((cu, fn) if o == 0 else alts[o - 1]) for (o, _), cu, fn, alts in zip(choice, curves, draft_costs,
                                                                                   alternatives)]
    return expected_goodput([cu for cu, _ in picked], [d for _, d in choice], cost,
                            draft_costs=[fn for _, fn in picked])


@pytest.mark.parametrize("seed", range(60))
def test_allocator_with_alternatives_matches_exhaustive_search(seed):
    rng = np.random.default_rng(7000 + seed)
    B = int(rng.integers(1, 4))
    grid = (1, 2, 4, 8, 16)

    def geometric():
        cu = Geometric(float(rng.random()))
        cu.grid = grid
        return cu

    def drafting():  # a fixed part (a catch-up) and a part per node, 0 without drafting
        fixed, slope = float(rng.uniform(0.0, 2.0)), float(rng.uniform(0.0, 0.3))
        return lambda d: fixed + slope * d if d > 0 else 0.0

    curves = [geometric() for _ in range(B)]
    caps = rng.choice([0, 3, 8, 16], size=B).tolist()
    draft_costs = [drafting() for _ in range(B)]
    alternatives = [None if rng.random() < 0.3 else [(geometric(), drafting()) for _ in range(int(rng.integers(1, 3)))]
                    for _ in range(B)]
    cost = random_cost(rng)
    a = plan(curves, caps, cost, draft_costs=draft_costs, alternatives=alternatives)
    choices = [[(o, d) for o in range(1 + len(alts or [])) for d in sorted({0, *grid, *caps}) if d <= cap]
               for cap, alts in zip(caps, alternatives)]
    best = max(goodput_of_options(curves, alternatives, draft_costs, list(c), cost)
               for c in itertools.product(*choices))
    assert a.goodput == pytest.approx(best)
    # the allocation returned is the one valued: its options and nodes give its goodput
    assert goodput_of_options(curves, alternatives, draft_costs, list(zip(a.options, a.nodes)), cost) == \
        pytest.approx(a.goodput)
    assert all(o == 0 for o, d in zip(a.options, a.nodes) if d == 0)


def test_a_request_whose_drafter_must_catch_up_drafts_with_its_cheap_alternative():
    model, lookup = Geometric(0.8), Geometric(0.6)
    catch_up = lambda d: 10.0 if d > 0 else 0.0  # noqa: E731 - the model has a long prompt to read first
    free = lambda d: 0.0  # noqa: E731
    alone = plan([model], [16], measured_cost, draft_costs=[catch_up])
    assert alone.nodes == [0] and alone.options == [0]  # the catch-up does not pay: a plain step
    a = plan([model], [16], measured_cost, draft_costs=[catch_up], alternatives=[[(lookup, free)]])
    assert a.options == [1] and a.nodes[0] > 0 and a.goodput > alone.goodput
    # without the catch-up the arm's own curve, better, is chosen
    b = plan([model], [16], measured_cost, draft_costs=[free], alternatives=[[(lookup, free)]])
    assert b.options == [0] and b.nodes[0] > 0
    with pytest.raises(ValueError, match="alternatives"):
        plan([model], [16], measured_cost, alternatives=[None, None])


def test_a_request_whose_drafting_does_not_pay_drafts_less():
    cheap, dear = (lambda d: 0.0), (lambda d: 0.5 * d)  # the second drafter: half a verifier forward per node
    curves, caps = [Geometric(0.9), Geometric(0.9)], [16, 16]
    a = plan(curves, caps, measured_cost, draft_costs=[cheap, dear])
    assert a.nodes[0] == a.width and 0 <= a.nodes[1] < a.nodes[0]
    free = plan(curves, caps, measured_cost)
    assert free.nodes[0] == free.nodes[1] == free.width  # free drafting: everyone drafts to the width


def test_max_width_and_requests_without_curves():
    a = plan([Geometric(0.99), None, Geometric(0.99)], [64, 64, 4], measured_cost, max_width=8)
    assert a.nodes[1] == 0 and a.nodes[0] <= 8 and a.nodes[2] <= 4
    assert plan([], [], measured_cost).nodes == []
    assert allocate([None, None], [8, 8], measured_cost) == [0, 0]
    with pytest.raises(ValueError, match="caps"):
        allocate([Geometric(0.5)], [8, 8], measured_cost)
    with pytest.raises(ValueError, match="cost"):
        allocate([Geometric(0.5)], [8], lambda n: 0.0)


# ---------------------------------------------------------------------------------------------- goodput reward
def test_shared_step_cost_and_goodput_on_a_worked_batch():
    rows = [1, 5, 3, 9]  # B = 4, N = 9: the forward runs 36 tokens
    assert affine_cost(36) == pytest.approx(2.75)
    share = shared_step_cost(affine_cost, rows, 2, 0.5)
    assert share == pytest.approx(2.75 / 4 + 0.5)  # 1.1875
    assert goodput_reward(3, share) == pytest.approx(3 / 1.1875)
    drafting = [0.0, 0.2, 0.5, 0.4]
    shares = [shared_step_cost(affine_cost, rows, i, c) for i, c in enumerate(drafting)]
    assert sum(shares) == pytest.approx(affine_cost(36) + sum(drafting))  # the shares add up to the step's cost
    # plain decoding at batch 1 scores 1.0; at batch 8 on the measured costs, ~6 per request
    assert goodput_reward(1, shared_step_cost(measured_cost, [1], 0)) == pytest.approx(1.0)
    assert goodput_reward(1, shared_step_cost(measured_cost, [1] * 8, 0)) == pytest.approx(8 * 191 / 250)


def test_counterfactual_of_a_smaller_budget_recomputes_the_forward():
    rows = [1, 5, 3, 9]
    # the widest row at d' = 2: N' = 5, the forward shrinks to 20 tokens
    assert counterfactual_share(affine_cost, rows, 3, 2, 0.1) == pytest.approx(affine_cost(20) / 4 + 0.1)
    # a row below the width saves only its drafting: N stays 9
    assert counterfactual_share(affine_cost, rows, 1, 0, 0.0) == pytest.approx(affine_cost(36) / 4)
    assert counterfactual_goodput(affine_cost, rows, 3, 2, 1.0, 0.1) == pytest.approx(2 / (affine_cost(20) / 4 + 0.1))
    # d' = the verified budget: the factual share
    assert counterfactual_share(affine_cost, rows, 3, 8, 0.3) == pytest.approx(shared_step_cost(affine_cost, rows, 3, 0.3))


def test_at_batch_one_goodput_is_the_throughput_reward():
    d, drafting, committed = 6, 0.7, [11, 12, 13, 14]  # 3 accepted + the bonus
    share = shared_step_cost(measured_cost, [1 + d], 0, drafting)
    step = SimpleNamespace(committed=committed, cost=measured_cost(1 + d) + drafting)
    assert goodput_reward(len(committed), share) == pytest.approx(Throughput().step(step))
    cf = SimpleNamespace(n_accepted=1)  # budget 2 would have accepted 1
    assert counterfactual_goodput(measured_cost, [1 + d], 0, 2, 1, 0.2) == pytest.approx(
        Throughput().counterfactual(cf, measured_cost(3) + 0.2))


def test_goodput_rejects_bad_rows():
    with pytest.raises(ValueError, match="pending"):
        shared_step_cost(affine_cost, [0, 3], 0)
    with pytest.raises(ValueError, match="row 2"):
        shared_step_cost(affine_cost, [1, 3], 2)


def test_min_gain_keeps_a_step_plain_unless_drafting_is_expected_to_gain_that_much():
    curves, caps = [Geometric(0.5)], [4]
    cost = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    free = plan(curves, caps, cost)
    gain = free.goodput / free.table[0]  # the best drafting width's goodput over the plain step's
    assert free.width > 0 and gain > 1.2
    assert plan(curves, caps, cost, min_gain=gain - 0.01).nodes == free.nodes
    kept = plan(curves, caps, cost, min_gain=gain + 0.01)
    assert kept.nodes == [0] and kept.width == 0 and kept.table == free.table  # every width still weighed, logged
    for bad in (0.99, float("nan"), True):
        with pytest.raises(ValueError, match="min_gain"):
            plan(curves, caps, cost, min_gain=bad)
