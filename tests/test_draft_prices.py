"""Drafting priced per load level and node budget (``metasd.core.pricing.draft_prices``): a price learnt with one
request drafting 32-node trees does not price four requests drafting 4-node ones (batched drafting shares each
forward; fewer nodes run fewer levels)."""
import pytest

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.pricing.draft_prices import DraftPrices
from metasd.drafters.budgeted import budget_arms

from test_adaptive import _cascade, _linear, _Pending  # noqa: E402


def test_a_price_is_read_back_per_level_and_interpolated_between_budgets():
    prices = DraftPrices(decay=0.5)
    assert prices.price("arm", 0, 8) is None and not prices.known("arm", 0)
    prices.learn("arm", 0, 4, 1.0)
    prices.learn("arm", 0, 16, 4.0)
    prices.learn("arm", 0, 16, 2.0)  # an exponential average: 0.5 * 4 + 0.5 * 2
    assert prices.price("arm", 0, 16) == pytest.approx(3.0)
    assert prices.price("arm", 0, 10) == pytest.approx(1.0 + (3.0 - 1.0) * 6 / 12)  # linear between 4 and 16
    assert prices.price("arm", 0, 2) == pytest.approx(0.5)  # below the smallest: in proportion to the nodes
    assert prices.price("arm", 0, 48) == pytest.approx(3.0)  # above the largest: the widest learnt
    assert prices.price("arm", 0, 0) == 0.0  # no nodes, no drafting
    assert prices.price("other", 0, 4) is None  # nothing learnt for another arm
    # a level not learnt borrows pessimistically: never scaled down for more rows to share a forward with
    assert prices.price("arm", 2, 4) == pytest.approx(1.0)
    prices.learn("arm", 2, 0, 9.0)  # a step that did not draft teaches nothing
    assert not prices.known("arm", 2)
    prices.learn("arm", 3, 4, 0.8)  # level 3 (8 rows): cheaper than alone, dearer scaled to fewer rows
    assert prices.price("arm", 4, 4) == pytest.approx(1.0)  # the dearest learnt level's: level 0's
    assert prices.price("arm", 2, 4) == pytest.approx(0.8 * 8 / 4)  # level 3's, scaled up to 4 rows: above level 0's
    assert prices.price("arm", 1, 4) == pytest.approx(0.8 * 8 / 2)
    assert prices.price("arm", 3, 4) == pytest.approx(0.8)  # its own, once learnt
    assert prices.to_dict()["arm@level3"] == {4: 0.8}
    del prices._table[("arm", 3)]
    assert prices.to_dict() == {"arm@level0": {4: 1.0, 16: pytest.approx(3.0)}}
    with pytest.raises(ValueError, match="decay"):
        DraftPrices(decay=1.0)


def test_a_price_learnt_alone_does_not_keep_four_requests_from_drafting():
    adaptive = AdaptiveSpeculation(_linear, max_width=16, price_drafting=True)
    adaptive.width_runs.due = lambda *step: False  # the allocator's own choices: no probe (a level's 2nd step has one)
    arm = budget_arms(_cascade(), (4, 16))[1]
    for _ in range(10):  # alone, any draft costs 3 one-token forwards a step: not worth drafting at all
        for budget in (2, 4, 16):
            adaptive.learn(arm, [0, 1], budget, budget, draft_cost=3.0, running=1)
    assert adaptive.allocate([arm]).nodes == [0]
    reqs = [_Pending(length=10, max_new_tokens=64) for _ in range(4)]
    for r in reqs:
        adaptive._fed[r] = 10
    # four running, not drafted at yet: the lone price, borrowed pessimistically (not scaled down to a request's
    # share of a 4-row forward) - not worth it until the level measures its own
    assert adaptive.draft_cost(arm, reqs[0], running=4)(4) == pytest.approx(3.0)
    assert adaptive.allocate([arm] * 4, reqs).nodes == [0] * 4
    for _ in range(10):  # batched, a request's share of a 4-node draft is small: it keeps drafting
        adaptive.learn(arm, [0, 1], 4, 4, draft_cost=0.05, running=4)
    assert adaptive.draft_prices.price("cascade", 2, 4) == pytest.approx(0.05)
    assert all(n > 0 for n in adaptive.allocate([arm] * 4, reqs).nodes)
    assert adaptive.draft_cost(arm, reqs[0], running=1)(4) == pytest.approx(3.0)  # alone: its own price
    assert adaptive.allocate([arm]).nodes == [0]


def test_a_level_not_learnt_borrows_through_the_forwards_shape():
    """A fresh level borrows a learnt level's price pessimistically: scaled up where a request's share of a forward
    is larger (by how a forward's cost grows with its rows: fewer rows, or a steep forward), never down - on a
    forward linear in its tokens (a CPU past a few rows) the price per request does not halve from 8 requests to 16
    (a 16-request level's first step priced so drafted and caught up every prompt at once), and at two threads 4
    requests' narrow probes lent 8 requests a price under the one they measured (BENCHMARKS.md)."""
    def linear(n):  # cost grows with every token: sharing a forward saves nothing
        return float(n)

    def flat(n):  # a launch-bound forward (a GPU): its cost does not grow with its rows
        return 1.0

    def steep(n):  # dearer per row with more rows (a forward past the cache, threads contending)
        return float(n) ** 1.5

    rows = (1, 2, 4, 8, 16, 32)
    for shape, at_16, at_4 in ((linear, 0.6, 0.6), (flat, 0.6, 1.2), (None, 0.6, 1.2), (steep, 0.6 * 2 ** 0.5, 0.6)):
        prices = DraftPrices(decay=0.5, level_rows=rows, shape=shape)
        prices.learn("arm", 3, 4, 0.6)  # learnt at 8 requests
        assert prices.share(3) == pytest.approx((shape or (lambda n: 1.0))(8) / 8 / (shape or (lambda n: 1.0))(1))
        assert prices.price("arm", 4, 4) == pytest.approx(at_16)  # at 16, not drafted at yet: never scaled down
        assert prices.price("arm", 2, 4) == pytest.approx(at_4)  # scaled up where a request's share is larger
        assert prices.price("arm", 3, 4) == pytest.approx(0.6)  # a level's own price is read as learnt
    with pytest.raises(ValueError, match="shape"):
        DraftPrices(shape=3.0)
    # the scheduler's prices borrow through its forward's cost (the start-up profile)
    adaptive = AdaptiveSpeculation(linear, max_width=16, price_drafting=True)
    adaptive.draft_prices.learn("cascade", 3, 4, 0.6)
    assert adaptive.draft_prices.price("cascade", 4, 4) == pytest.approx(0.6)
