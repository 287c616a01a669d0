"""A prompt's catch-up while the batch fills (``AdaptiveSpeculation.draft_cost``'s ``joining``): a request's first
draft makes its model drafter read its whole prompt, a one-off the allocator amortizes over the request's remaining
tokens - but while more requests are about to join, that holds only if the arm still drafts at the load they bring.
On this CPU, 16 clients arriving at once drafted at 4 and 8 running requests, paid every prompt's catch-up, and went
plain at 16 (BENCHMARKS.md, the 16-request loss traced in-process)."""
import pytest

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.batching.scheduler import Scheduler
from metasd.drafters.budgeted import budget_arms

from test_adaptive import _budget_arms, _cascade, _engine, _Pending  # noqa: E402
from test_scheduler import MAX_NEW, PROMPTS, tok, verifier_model  # noqa: E402,F401  (fixtures)


def _knee(n):  # cheap up to 24 tokens in a forward (4 rows of 1 + 4 nodes), then every token a whole forward
    return 1.0 + 0.02 * n if n <= 24 else 1.48 + (n - 24)


def _priced():
    adaptive = AdaptiveSpeculation(_knee, max_width=8, price_drafting=True)
    adaptive.width_runs.due = lambda *step: False  # the allocator's own choices: no probe
    arm = budget_arms(_cascade(), (4,))[0]
    for _ in range(20):  # batched at 4 requests, a 4-node draft costs 0.05 one-token forwards and 3 nodes pass
        adaptive.learn(arm, [0, 1, 2], 4, 4, draft_cost=0.05, catch_up=0, running=4)
    adaptive.learn(arm, [0], 4, 4, draft_cost=2.05, catch_up=200)  # a prompt of 200 tokens: 0.01 a token
    return adaptive, arm


def test_the_catch_up_is_charged_whole_when_the_joining_requests_bring_a_load_that_does_not_draft():
    adaptive, arm = _priced()
    assert adaptive.drafts_at(arm, 4) and not adaptive.drafts_at(arm, 16)
    fresh = _Pending(length=200, max_new_tokens=64)
    amortized = 0.05 + 0.01 * 200 * (1 + adaptive.curve(arm).expected(4)) / 64
    assert adaptive.draft_cost(arm, fresh, running=4)(4) == pytest.approx(amortized)
    assert adaptive.draft_cost(arm, fresh, running=4, joining=12)(4) == pytest.approx(0.05 + 2.0)
    assert adaptive.draft_cost(arm, fresh, running=4, joining=12)(0) == 0.0  # no draft, no catch-up
    # joining to a load that still drafts: amortized as before (3 running + 1 joining: the same level, 4 rows)
    assert adaptive.draft_cost(arm, fresh, running=3, joining=1)(4) == pytest.approx(
        adaptive.draft_cost(arm, fresh, running=3)(4))
    adaptive._fed[fresh] = 200  # read already: nothing to charge, whoever joins
    assert adaptive.draft_cost(arm, fresh, running=4, joining=12)(4) == pytest.approx(0.05)


def test_four_fresh_requests_stay_plain_while_twelve_more_join_and_draft_once_read():
    adaptive, arm = _priced()
    fresh = [_Pending(length=200, max_new_tokens=64) for _ in range(4)]
    assert all(n > 0 for n in adaptive.allocate([arm] * 4, fresh).nodes)  # four alone: the prompts repay
    assert adaptive.allocate([arm] * 4, fresh, joining=12).nodes == [0] * 4
    for r in fresh:
        adaptive._fed[r] = 200
    assert all(n > 0 for n in adaptive.allocate([arm] * 4, fresh, joining=12).nodes)  # no prompt to pay: it drafts


def test_the_scheduler_counts_the_requests_about_to_join(verifier_model, tok, monkeypatch):
    seen = []  # per step: (running, joining)
    original = AdaptiveSpeculation.step_plan

    def spy(self, jobs, arms, requests, joining=0):
        seen.append((len(jobs), joining))
        return original(self, jobs, arms, requests, joining)

    monkeypatch.setattr(AdaptiveSpeculation, "step_plan", spy)
    prompts, max_new = PROMPTS * 2, MAX_NEW * 2  # 8 requests, 3 at a time, prompts prefilled 4 tokens a step
    engine = _engine(verifier_model, tok, _budget_arms())
    with Scheduler(engine, max_batch=3, prefill_chunk=4, adaptive=AdaptiveSpeculation(_knee, max_width=4)) as s:
        with s._lock:
            handles = [s.submit(p, n) for p, n in zip(prompts, max_new)]
        got = [h.result(timeout=120) for h in handles]
    assert [len(r.token_ids) for r in got] == max_new
    assert all(running + joining <= 3 for running, joining in seen)
    assert seen[0] == (1, 2)  # the first prompt in: two more admitted, still prefilling
    assert any(joining > 0 and running == 2 for running, joining in seen)
    assert seen[-1][1] == 0  # the last request runs alone, nobody waits


def test_one_plan_per_arm_and_step_answers_every_fresh_request(monkeypatch):
    import metasd.core.batching.adaptive as adaptive_module
    adaptive, arm = _priced()
    calls = []
    original = adaptive_module.plan
    monkeypatch.setattr(adaptive_module, "plan", lambda curves, *a, **k: calls.append(len(curves)) or original(
        curves, *a, **k))
    fresh = [_Pending(length=200, max_new_tokens=64) for _ in range(8)]
    assert adaptive.allocate([arm] * 8, fresh, joining=8).nodes == [0] * 8
    assert calls.count(16) == 1  # drafts_at for 16 rows: once, not once per request


def test_a_draft_cost_read_at_many_budgets_is_its_value_at_each_and_shared_by_requests_with_nothing_to_read():
    adaptive, arm = _priced()
    fresh, read = _Pending(length=200, max_new_tokens=64), _Pending(length=200, max_new_tokens=64)
    adaptive._fed[read] = 200
    ds = [0, 1, 2, 3, 4, 6, 8, 16]
    costs = [adaptive.draft_cost(arm, fresh, running=4),  # amortized catch-up
             adaptive.draft_cost(arm, fresh, running=4, joining=12),  # the catch-up whole
             adaptive.draft_cost(arm, read, running=4), adaptive.draft_cost(arm)]  # none; no load: the average
    for cost in costs:  # the allocator's vectorised read is the scalar one, exactly
        assert cost.many(ds).tolist() == [cost(d) for d in ds] and cost(0) == 0.0
    memo = {}  # a step's: the requests with nothing to read share one cost (the allocator reads it once)
    other = _Pending(length=300, max_new_tokens=64)
    adaptive._fed[other] = 300
    shared = adaptive.draft_cost(arm, read, running=4, memo=memo)
    assert adaptive.draft_cost(arm, other, running=4, memo=memo) is shared
    assert adaptive.draft_cost(arm, fresh, running=4, memo=memo) is not shared  # its own catch-up
    assert adaptive.draft_cost(arm, other, running=16, memo=memo) is not shared  # another level's price
