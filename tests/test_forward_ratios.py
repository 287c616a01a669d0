"""The verify forward's measured price against its profile, per load level and token bucket
(metasd/core/pricing/forward_ratios.py), and how the adaptive scheduler prices forwards and probes with it."""
from __future__ import annotations

import pytest

from metasd.core.batching import probes
from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.pricing.allocator import plan
from metasd.core.pricing.forward_profile import ForwardProfile
from metasd.core.pricing.forward_ratios import ForwardRatios, token_bucket
from metasd.drafters.budgeted import budget_arms

from test_adaptive import _cascade, _Pending

#: seconds of a 1.5B verifier forward over n tokens measured on a 2-core CPU without AVX-512 (float32; BENCHMARKS.md):
#: a matrix-vector kernel at 1 token, a matrix-matrix one beyond - flat from 4 to 16 tokens
MEASURED = {1: 0.775, 2: 1.37, 4: 2.03, 8: 1.80, 16: 2.06, 32: 2.55, 64: 3.79}


def _real(n):  # the measured seconds, linear between the measured counts
    ts = sorted(MEASURED)
    lo = max(t for t in ts if t <= n)
    hi = min((t for t in ts if t >= n), default=lo)
    return MEASURED[lo] if hi == lo else MEASURED[lo] + (MEASURED[hi] - MEASURED[lo]) * (n - lo) / (hi - lo)


def test_token_buckets_are_powers_of_two():
    assert [token_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 49, 64, 65)] == [0, 1, 2, 2, 3, 3, 4, 6, 6, 7]


def test_a_forward_is_priced_through_the_measured_points_of_its_level():
    def cost(n):  # a profile: linear in tokens
        return 1.0 + 0.5 * (n - 1)

    ratios = ForwardRatios(cost, decay=0.5)
    assert ratios.price(1, 10) == cost(10) and ratios.widest(1) is None and ratios.level_ratio(1) == 1.0
    ratios.learn(1, 1, 1.0)
    ratios.learn(1, 49, 5.0)  # the profile said 25
    assert ratios.price(1, 1) == 1.0 and ratios.price(1, 49) == 5.0 and ratios.ratio(1, 49) == pytest.approx(0.2)
    assert ratios.price(1, 25) == pytest.approx(1.0 + 4.0 * 24 / 48)  # between two points: linear
    assert ratios.price(1, 97) == pytest.approx(5.0 + 0.2 * (cost(97) - cost(49)))  # beyond: the profile's slope
    ratios.learn(1, 40, 7.0)  # the same bucket: its tokens and price averaged
    assert ratios.points[1][6] == pytest.approx((44.5, 6.0)) and ratios.widest(1) == 49
    assert ratios.by_level[1][6] == pytest.approx(6.0 / cost(44.5))
    ratios.learn(1, 3, 8.0)  # a stall: a narrow forward dearer than the wide ones - never cheaper for more tokens
    prices = [ratios.price(1, n) for n in range(1, 120)]
    assert all(b >= a for a, b in zip(prices, prices[1:])) and ratios.price(1, 44.5) == 8.0
    assert ratios.price(2, 49) == ratios.price(1, 49) and ratios.widest(2) is None  # another level's rows
    ratios.learn(4, 4, 2.0 * cost(4))
    assert ratios.ratio(3, 4) == pytest.approx(2.0) and ratios.level_ratio(4) == pytest.approx(2.0)
    assert ratios.level_ratio(1) > 0  # all its forwards, the stall included (logs)


def test_widths_the_profile_skipped_are_priced_as_measured_once_run_and_a_probe_reads_them_hopefully():
    # the profile's 5 seconds timed 1 and 4 tokens and extrapolated the rest along their segment: 49 tokens at 28x one
    # token's seconds, where it took 4.3x. A forward priced per level alone (one ratio for every width) kept that
    profile = ForwardProfile(tokens=(1, 4), seconds=(MEASURED[1], MEASURED[4]))
    unit = profile.seconds_for(1)
    adaptive = AdaptiveSpeculation(profile.cost, max_width=48, price_drafting=True, unit_seconds=unit)
    plain = plan([], [], profile.cost)
    adaptive.record(plain, [2], 3, forward_s=_real(3))  # a 2-node draft's forward
    forward, hopeful = adaptive.forward_cost(1), adaptive.forward_cost(1, hopeful=True)
    assert forward(3) == pytest.approx(_real(3) / unit)
    assert forward(49) == pytest.approx(forward(3) / profile.cost(3) * profile.cost(49)) and forward(49) > 15
    assert hopeful(49) == pytest.approx(forward(3))  # never run: priced as the widest forward the level ran
    adaptive.record(plain, [48], 49, forward_s=_real(49))  # a probe's
    forward, hopeful = adaptive.forward_cost(1), adaptive.forward_cost(1, hopeful=True)
    assert forward(49) == pytest.approx(_real(49) / unit) and forward(49) < 5  # measured: 4.3x, not 28x
    assert forward(3) == pytest.approx(_real(3) / unit) and hopeful(49) == pytest.approx(forward(49))
    assert forward(3) < forward(17) < forward(49) and forward(17) < profile.cost(17) / 2  # between, interpolated
    prices = [forward(n) for n in range(1, 100)]
    assert all(b >= a for a, b in zip(prices, prices[1:]))


def test_a_probe_rates_widths_never_run_at_the_widest_forward_run():
    # a lone request drafting 2 nodes whose arm accepts up to 6 tokens at any budget: at the profile's extrapolated
    # price a wide probe is rated far below the 2-node allocation and the probe drafts 4 nodes; at the hopeful price
    # (the widest forward run) it drafts the widest width, and its forward is then measured
    profile = ForwardProfile(tokens=(1, 4), seconds=(MEASURED[1], MEASURED[4]))
    adaptive = AdaptiveSpeculation(profile.cost, max_width=48, price_drafting=True, unit_seconds=profile.seconds_for(1))
    arm = budget_arms(_cascade(), (48,))[0]
    for _ in range(20):
        adaptive.learn(arm, list(range(6)), 48, 48, draft_cost=0.05, running=1)
    adaptive.record(plan([], [], profile.cost), [2], 3, forward_s=_real(3))
    request = _Pending(length=100, max_new_tokens=64)
    adaptive._fed[request] = 100
    curves, costs = [adaptive.curve(arm)], [adaptive.draft_cost(arm, request, running=1)]
    narrow = plan(curves, [2], adaptive.forward_cost(1), max_width=2, draft_costs=costs)
    args = (narrow, curves, [48], adaptive.forward_cost(1), costs, 48)
    assert probes.probe(*args).nodes == [4]  # every wider width rated under the floor: the best-rated one
    assert probes.probe(*args, hopeful=adaptive.forward_cost(1, hopeful=True)).nodes == [48]


def test_a_level_prices_widths_beyond_its_own_through_the_shape_another_level_measured():
    # the one-request level measured forwards of 1 to 49 tokens (a probe's); four requests have run plain steps only
    # (4 tokens). Their 8-node drafts (36 tokens) cost what the machine's shape says - the one-request level's points
    # scaled to four requests' 4-token forward - not the profile's extrapolation of 1 and 4 tokens (~5x dearer)
    profile = ForwardProfile(tokens=(1, 4), seconds=(MEASURED[1], MEASURED[4]))
    unit = profile.seconds_for(1)
    ratios = ForwardRatios(profile.cost)
    for n in (1, 5, 17, 49):
        ratios.learn(1, n, _real(n) / unit)
    slow = 1.3  # four rows' attention and a slower moment
    ratios.learn(4, 4, slow * _real(4) / unit)
    assert ratios.shape(4) == 1 and ratios.shape(1) is None
    assert ratios.price(4, 36) == pytest.approx(slow * _real(4) / unit * ratios.price(1, 36) / ratios.price(1, 4))
    # within a quarter of the real cost: the one-request level's points at 1 and 5 tokens read 4 tokens cheaper than
    # it is (the kernel's step from 1 to 2 tokens lies between them)
    assert slow * _real(36) / unit < ratios.price(4, 36) < 1.25 * slow * _real(36) / unit
    assert ratios.price(4, 4) == pytest.approx(slow * _real(4) / unit)  # its own point, as measured
    extrapolated = ratios.price(4, 4) / profile.cost(4) * profile.cost(36)
    assert extrapolated > 4 * ratios.price(4, 36)
    # a probe reads hopefully only the widths no level ran: 132 tokens as 49 at this level, not as its own 4
    assert ratios.hopeful(4, 132) == pytest.approx(ratios.price(4, 49)) and ratios.price(4, 49) < ratios.price(4, 132)
    assert ratios.hopeful(4, 36) == pytest.approx(ratios.price(4, 36)) and ratios.price(4, 36) > ratios.price(4, 4)
    ratios.learn(4, 132, slow * 2 * _real(64) / unit)  # then measured: the level's own point, the shape no longer
    assert ratios.shape(4) is None and ratios.shape(1) == 4
    assert ratios.price(4, 132) == pytest.approx(slow * 2 * _real(64) / unit)
