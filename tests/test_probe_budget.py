"""What a load level's probes may lose, and how wide they may draft (``metasd.core.batching.probes.ProbeBudget``).

Beside 16 rows on this CPU a level's first probe drafted 48 nodes a request and its drafter read every prompt first:
52-62 s for 133-145 tokens where plain steps made 16 tokens in 2 s. A probe now drafts at most twice the widest its
level drafted, and a level whose probes lost waits until ``PROBE_SHARE`` of its steps' cost has repaid the loss."""
import pytest

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.batching.probes import PROBE_SHARE, ProbeBudget
from metasd.core.pricing.allocator import Allocation
from metasd.drafters.budgeted import budget_arms

from test_adaptive import _cascade, _linear, _Pending  # noqa: E402


def _alloc(nodes, probe=False):
    return Allocation(list(nodes), max(nodes), 1.0, {}, [0] * len(nodes), float(len(nodes)), probe=probe)


def test_each_step_credits_a_share_of_its_cost_and_a_probe_debits_its_loss():
    budget = ProbeBudget(share=0.1)
    assert budget.open(0) and budget.settle(5.0) is None  # nothing planned: nothing settled
    budget.planned(0, _alloc([0, 0]), replaced=2.0)
    budget.add(0.0, 1)
    budget.add(0.0, 1)
    assert budget.settle(1.0) is None and budget.balance[0] == pytest.approx(0.1)  # a plain step: 0.1 x its cost
    budget.planned(0, _alloc([4, 4], probe=True), replaced=2.0)  # it replaced an allocation of goodput 2 / unit
    budget.add(3.0, 3)  # drafting cost 3, 3 tokens committed
    budget.add(1.0, 1)
    loss = budget.settle(2.0)  # cost 2 + 3 + 1 = 6; the replaced allocation commits 4 tokens at a cost of 2
    assert loss == pytest.approx(6.0 - 4 / 2.0)
    assert budget.balance[0] == pytest.approx(0.1 + 0.1 * 6.0 - 4.0) and not budget.open(0)
    assert budget.open(1)  # each level its own balance
    budget.planned(1, _alloc([8], probe=True), replaced=0.5)
    budget.add(0.0, 9)
    assert budget.settle(2.0) == pytest.approx(2.0 - 9 / 0.5)  # a probe that paid: a negative loss credits
    assert budget.balance[1] == pytest.approx(0.2 + 16.0)
    with pytest.raises(ValueError, match="share"):
        ProbeBudget(share=1.5)


def test_a_probe_drafts_at_most_twice_the_widest_its_level_drafted():
    budget = ProbeBudget()
    assert budget.most(0, 0) == 1 and budget.most(0, 0, least=4) == 4  # a fresh level: the narrowest budget arm
    budget.planned(0, _alloc([3, 0]), replaced=1.0)
    assert budget.most(0, 0) == 6 and budget.most(0, 5) == 10 and budget.most(0, 0, least=16) == 16
    assert budget.most(2, 0) == 1  # another level drafted nothing yet


def dear_level(adaptive, running):
    """An arm and ``running`` requests (prompts read) of a level whose drafting ``adaptive`` has learnt dear (50 units a
    step at every budget), so its allocator keeps them plain."""
    arm = budget_arms(_cascade(), (48,))[0]
    for budget in (1, 2, 4, 16, 48):
        adaptive.learn(arm, [0], budget, budget, draft_cost=50.0, running=running)
    reqs = [_Pending(length=100, max_new_tokens=100_000) for _ in range(running)]
    for r in reqs:
        adaptive._fed[r] = 100
    return arm, reqs


def _probing(running=1, drafting=3.0):
    """An adaptive whose allocator keeps ``running`` requests plain (drafting learnt dear) and a step function: each
    step's forward takes 1 s (1 unit), a probe's drafting costs ``drafting`` units and commits no draft token."""
    adaptive = AdaptiveSpeculation(_linear, max_width=48, price_drafting=True, unit_seconds=1.0)
    arm, reqs = dear_level(adaptive, running)

    def step():
        alloc = adaptive.allocate([arm] * running, reqs)
        for _ in reqs:
            adaptive.probe_budget.add(drafting if alloc.probe else 0.0, 1)
        adaptive.record(alloc, alloc.nodes, running * (1 + max(alloc.nodes)), forward_s=1.0)
        return alloc

    return adaptive, step


def test_a_level_whose_probe_lost_probes_again_only_once_its_steps_repaid_the_loss():
    adaptive, step = _probing()
    allocs = [step() for _ in range(2)]
    assert [a.probe for a in allocs] == [False, True] and allocs[1].nodes == [1]  # a fresh level's first: 1 node
    balance = adaptive.probe_budget.balance[0]
    plain = adaptive.forward_cost(1)(1)  # the step the probe replaced: 1 token at the forward's price (1 s measured)
    assert plain == pytest.approx(1.0) and balance == pytest.approx(PROBE_SHARE * (1.0 + 4.0) - (4.0 - plain))
    waiting = int(-balance / PROBE_SHARE) + 1  # plain steps of 1 unit until the balance is >= 0 again
    assert not any(step().probe for _ in range(waiting - 1))
    assert not adaptive.probe_budget.open(0)
    assert not step().probe and adaptive.probe_budget.open(0)
    after = [step() for _ in range(16)]
    probes = [a for a in after if a.probe]
    assert probes and probes[0].nodes == [2]  # twice the widest the level drafted
    assert after.index(probes[0]) == 3  # a run of 4 steps (its second probe) counted from the reopening


def test_a_level_whose_probes_pay_keeps_probing_on_its_own_schedule():
    adaptive, step = _probing(drafting=0.0)
    allocs = [step() for _ in range(31)]
    probes = [i for i, a in enumerate(allocs) if a.probe]
    assert probes == [1, 5, 13, 29]  # runs of 2, 4, 8 and 16 steps: never held back
    assert [allocs[i].nodes for i in probes] == [[1], [2], [4], [8]]  # each twice the widest before it
    assert adaptive.probe_budget.open(0)


def test_a_probe_makes_no_drafter_read_a_prompt_the_balance_does_not_cover():
    """Beside 16 rows on a CPU whose forward is flat in tokens, a level's first probe made every request's drafter
    read its prompt (8 s for 61 tokens, plain steps 16 tokens in 0.37 s): a request whose drafter has its prompt to
    read joins a probe only where the level's balance covers its catch-up, the cheapest first."""
    budget = ProbeBudget()
    alloc = _alloc([0, 0, 0, 2])
    reach = [16, 16, 16, 16]
    catch_up = [10.0, 0.0, 20.0, 30.0]  # request 1 is caught up; request 3 drafts already (the allocator's choice)
    assert budget.affordable(0, reach, alloc, catch_up) == [0, 16, 0, 16]  # a fresh level: balance 0
    budget.balance[0] = 12.0
    assert budget.affordable(0, reach, alloc, catch_up) == [16, 16, 0, 16]  # 10 covered, 10 + 20 not
    budget.balance[0] = 25.0
    assert budget.affordable(0, reach, alloc, catch_up) == [16, 16, 0, 16]  # the cheapest first, not the 20 alone
    budget.balance[0] = 30.0
    assert budget.affordable(0, reach, alloc, catch_up) == [16, 16, 16, 16]
    budget.balance[0] = -5.0
    assert budget.affordable(0, reach, alloc, catch_up) == [0, 16, 0, 16]

    # in the scheduler's allocation: requests never drafted for, their catch-up learnt at 0.1 a token
    adaptive = AdaptiveSpeculation(_linear, max_width=48, price_drafting=True, unit_seconds=1.0)
    arm = budget_arms(_cascade(), (48,))[0]
    for nodes in (1, 2, 4, 16, 48):
        adaptive.learn(arm, [0], nodes, nodes, draft_cost=50.0, running=2)  # drafting dear: the allocator stays plain
    adaptive.catch_up_rates["cascade"] = 0.1
    reqs = [_Pending(length=100, max_new_tokens=100_000), _Pending(length=200, max_new_tokens=100_000)]

    def step():
        alloc = adaptive.allocate([arm] * 2, reqs)
        adaptive.record(alloc, alloc.nodes, 2 * (1 + max(alloc.nodes)), forward_s=1.0)
        return alloc

    assert not any(step().probe for _ in range(8))  # 10 and 20 units of catch-up, the balance 5% of 1 unit a step
    level = 1  # load_level(2)
    adaptive.probe_budget.balance[level] = 12.0
    probes = [a for a in (step() for _ in range(4)) if a.probe]
    assert probes and probes[0].nodes[0] > 0 and probes[0].nodes[1] == 0  # the cheaper catch-up only
    for r in reqs:  # both read their text: probes as before
        adaptive._fed[r] = r.length
    adaptive.probe_budget.balance[level] = 0.0
    probes = [a for a in (step() for _ in range(16)) if a.probe]
    assert probes and all(n > 0 for n in probes[0].nodes)
