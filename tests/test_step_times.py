"""What a step costs beside its priced parts (``metasd.core.pricing.step_times``): the forward slower than profiled
and the step's own work, learnt per load level from the steps the scheduler ran, and charged by the allocator - a
plain step that really costs far more than its profiled forward makes drafting pay where the profile alone says it
does not."""
import pytest

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.pricing.step_times import StepTimes
from metasd.drafters.budgeted import budget_arms

from test_adaptive import _budget_arms, _cascade, _engine, _plain, _Pending, _serve  # noqa: E402
from test_scheduler import tok, verifier_model  # noqa: E402,F401  (fixtures)


def _flat(n):  # a forward of n tokens: one unit, plus a little per token
    return 1.0 + 0.01 * n


def test_scale_and_overhead_are_learnt_per_level_and_read_back():
    times = StepTimes(_flat, unit_seconds=0.1, decay=0.5)
    assert times.at(2) == (1.0, 0.0) and times.step_cost(2)(4) == pytest.approx(_flat(4))  # nothing seen: the profile
    # 4 requests, a 4-token forward modeled at 0.104 s ran 0.208 s; the step took 0.35 s with 0.05 s of drafting
    times.observe(2, 4, verify_s=0.208, step_s=0.35, drafting_s=0.05)
    assert times.at(2) == (pytest.approx(2.0), pytest.approx(0.92))  # (0.35 - 0.208 - 0.05) / 0.1
    times.observe(2, 4, verify_s=0.104, step_s=0.204, drafting_s=0.0)  # averaged: k (2 + 1) / 2, o (0.92 + 1) / 2
    assert times.at(2) == (pytest.approx(1.5), pytest.approx(0.96))
    assert times.step_cost(2)(36) == pytest.approx(1.5 * _flat(36) + 0.96)
    assert times.at(3) == times.at(2) and times.at(0) == times.at(2)  # levels not seen borrow the nearest
    times.observe(0, 1, verify_s=0.101, step_s=0.121, drafting_s=0.0)
    assert times.at(1) == times.at(0)  # levels 0 and 2 are both one away: the lower lends
    times.observe(0, 1, verify_s=0.0, step_s=0.5, drafting_s=0.0)  # no forward measured: teaches nothing
    assert times.to_dict()[0] == {"scale": pytest.approx(1.0), "overhead": pytest.approx(0.2)}
    with pytest.raises(ValueError, match="unit_seconds"):
        StepTimes(_flat, unit_seconds=0.0)


def test_a_step_slower_than_its_profile_makes_drafting_pay_at_four_requests():
    adaptive = AdaptiveSpeculation(_flat, max_width=16, price_drafting=True, unit_seconds=0.1, min_gain=1.2)
    arm = budget_arms(_cascade(), (8,))[0]
    reqs = [_Pending(length=10, max_new_tokens=64) for _ in range(4)]
    for r in reqs:
        adaptive._fed[r] = 10
    for _ in range(10):  # drafts accept 2 tokens a step; a request's share of any draft costs 0.9 forwards
        for budget in (1, 2, 4, 8):
            adaptive.learn(arm, [0, 1][:budget], budget, budget, draft_cost=0.9, running=4)
    # by the profile, 2 nodes (the best width): (4 + 8) / (1.12 + 3.6) = 2.5 against plain's 4 / 1.04 = 3.8
    assert adaptive.allocate([arm] * 4, reqs).nodes == [0] * 4
    for _ in range(10):  # served: a plain 4-row step runs its forward 1.5x slower and does 2 forwards' work beside it
        adaptive.record(adaptive.allocate([arm] * 4, reqs), [0] * 4, 4, verify_s=0.156, step_s=0.356, prefilled=False)
    assert adaptive.step_times.at(2) == (pytest.approx(1.5), pytest.approx(2.0))
    # 2 nodes: (4 + 8) / (1.5 * 1.12 + 3.6 + 2) = 1.65 against 4 / (1.5 * 1.04 + 2) = 1.12: drafting pays (1.47x)
    assert adaptive.allocate([arm] * 4, reqs).nodes == [2] * 4
    before = adaptive.step_times.to_dict()
    adaptive.record(adaptive.allocate([arm] * 4, reqs), [0] * 4, 4, verify_s=1.0, step_s=9.0, prefilled=True)
    assert adaptive.step_times.to_dict() == before  # a step that prefilled a prompt is not a step's price


def test_the_scheduler_teaches_step_times_and_outputs_stay_exact(verifier_model, tok):
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    adaptive = AdaptiveSpeculation(_flat, max_width=12, price_drafting=True, unit_seconds=1e-3)
    got, steps = _serve(engine, adaptive)
    assert [r.token_ids for r in got] == expected
    learnt = adaptive.step_times.to_dict()
    assert learnt and all(v["scale"] > 0 and v["overhead"] >= 0 for v in learnt.values())
    assert AdaptiveSpeculation(_flat, max_width=12).step_times is None  # modeled drafting: the profile alone
