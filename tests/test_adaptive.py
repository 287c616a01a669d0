"""Adaptive speculation in the scheduler (metasd/core/batching/adaptive.py): the load reaches the policy, the allocator
sizes every draft, steps are priced by their share of the batched forward - and outputs stay exact. Tiny fp32 models."""
from types import SimpleNamespace

import pytest
import torch

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.decoding.request_features import LOAD_LEVELS, load_level
from metasd.core.engine import Engine
from metasd.core.pricing.goodput import shared_step_cost
from metasd.core.decoding.request import Request
from metasd.core.batching.scheduler import Scheduler, SchedulerStep
from metasd.core.execution.verifier import Verifier
from metasd.drafters import FusedDrafter, PretrainedTreeDrafter, SuffixDrafter
from metasd.drafters.budgeted import NoSpeculation, budget_arms
from metasd.policies import make_policy
from tiny import tiny_qwen

# the scheduler tests' prompts (different lengths, a one-token prompt, repetitions) and their tiny models
from test_scheduler import MAX_NEW, PROMPTS, tok, verifier_model  # noqa: E402,F401  (fixtures)


def _cascade(layers: int = 2):  # configs/default.yaml's pool on tiny models
    return FusedDrafter([SuffixDrafter(max_depth=16, max_nodes=16, name="suffix"),
                         PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0, layers=layers), mode="dynamic",
                                               nodes=12, depth=6, width=3, min_path_prob=0.3, name="model")],
                        enough=6, name="cascade")


def _budget_arms(layers: int = 2):
    inner = _cascade(layers)
    return [*budget_arms(inner, (2, 6, 16)), NoSpeculation()]


def _engine(model, tok, drafters, policy="per_load", **kw):
    policy = make_policy(policy, len(drafters), seed=0) if policy else None
    return Engine(Verifier(model, tok), drafters, policy=policy, check_tokenizers=False, **kw)


def _plain(model, tok, prompts=PROMPTS):  # Engine.generate without drafters (per_load needs the scheduler's load)
    engine = Engine(Verifier(model, tok), None, check_tokenizers=False)
    return [engine.generate(p, n).token_ids for p, n in zip(prompts, MAX_NEW)]


def _serve(engine, adaptive, prompts=PROMPTS, max_new=MAX_NEW, **submit):
    steps = []
    with Scheduler(engine, max_batch=4, adaptive=adaptive) as s:
        s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) and r.batch_size else None)
        with s._lock:  # every request queued before the scheduler thread may start any (they start together)
            handles = [s.submit(p, n, **submit) for p, n in zip(prompts, max_new)]
        return [h.result(timeout=120) for h in handles], steps


def _linear(n):  # a forward whose cost grows slowly with its tokens: drafting pays
    return 1.0 + 0.02 * n


def test_greedy_outputs_exact_and_every_draft_within_its_budget(verifier_model, tok):
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    adaptive = AdaptiveSpeculation(_linear, max_width=12)
    got, steps = _serve(engine, adaptive)
    assert [r.token_ids for r in got] == expected
    assert steps and all(s.adaptive is not None for s in steps)
    for s in steps:
        a = s.adaptive
        assert len(a.nodes) == s.batch_size == len(s.requests)  # every running request verified, pending token in
        assert max(a.nodes) <= a.width <= 12
        assert all(r.drafted <= d for r, d in zip(s.requests, a.nodes))
        assert all(r.committed >= 1 for r in s.requests)
        assert s.forward_tokens == s.batch_size * (1 + max(r.drafted for r in s.requests))
        assert a.width in a.table
    assert sum(r.stats.drafted for r in got) > 0 and sum(r.stats.accepted for r in got) > 0
    assert set(adaptive.curves) == {"cascade"}  # the budget arms share the inner drafter's curve


def test_steep_cost_gives_width_zero_and_exact_outputs(verifier_model, tok, monkeypatch):
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms())
    proposals = []
    drafting = FusedDrafter.drafting  # what a request runs to draft (propose runs it too)
    monkeypatch.setattr(FusedDrafter, "drafting", lambda self, ctx: proposals.append(ctx) or drafting(self, ctx))
    got, steps = _serve(engine, AdaptiveSpeculation(lambda n: float(n) ** 3, max_width=16))
    assert [r.token_ids for r in got] == expected
    assert all(s.adaptive.width == 0 and set(s.adaptive.nodes) == {0} for s in steps)
    assert sum(r.stats.drafted for r in got) == 0
    assert proposals == []  # width 0: the drafter is not asked to draft at all (its work would be thrown away)


def test_flat_cost_and_a_drafter_that_is_always_right_draft_wide(verifier_model, tok):
    # the verifier's own model as a tree drafter: its greedy chain is always accepted
    drafter = PretrainedTreeDrafter(verifier_model, nodes=24, depth=12, width=2, name="self")
    engine = _engine(verifier_model, tok, [drafter], policy=None)
    got, steps = _serve(engine, AdaptiveSpeculation(lambda n: 1.0, max_width=24), max_new=[60] * 4)
    widths = [s.adaptive.width for s in steps]
    assert min(widths) >= 16, widths
    assert sum(r.stats.accepted for r in got) / sum(r.stats.steps for r in got) >= 3


def test_drafting_is_priced_once_the_arm_has_drafted(verifier_model, tok, monkeypatch):
    # a drafter four times as deep as the tiny verifier: once its drafting cost is learnt, the allocator stops
    # drafting where a draft's expected tokens do not pay for it (and the allocator is told the cost). (With batched
    # drafting a request pays its share of drafter forwards shared with the others - measured with a drafter twice as
    # deep, 0.86 verifier steps a step against 2.05 when each drafted alone: too little to make it stop.)
    seen = []
    original = AdaptiveSpeculation.allocate

    def spy(self, arms, requests=None, joining=0):
        alloc = original(self, arms, requests, joining)
        seen.append((dict(self.draft_costs), alloc.width))
        return alloc

    monkeypatch.setattr(AdaptiveSpeculation, "allocate", spy)
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(layers=8))
    got, steps = _serve(engine, AdaptiveSpeculation(_linear, max_width=16, price_drafting=True))
    assert [r.token_ids for r in got] == expected
    assert seen[0][0] == {} and seen[0][1] > 0  # nothing learnt yet: drafting looks free, the first step drafts
    learnt = [(costs, w) for costs, w in seen if costs]
    assert learnt and learnt[0][0]["cascade"] > 1.0  # metered: its share of the deep drafter's forwards
    assert [w for _, w in learnt[-5:]] == [0] * 5  # priced, drafting stops paying for itself
    assert AdaptiveSpeculation(_linear).draft_cost(NoSpeculation()) is None


def test_the_load_reaches_a_per_load_policy(verifier_model, tok):
    engine = _engine(verifier_model, tok, _budget_arms(), persistent_policy=True)
    policy = engine.policy
    levels = []
    for j, inner in enumerate(policy.policies):
        def spy(context=None, _select=inner.select, _j=j):
            levels.append(_j)
            return _select(context)
        inner.select = spy
    adaptive = AdaptiveSpeculation(_linear, max_width=16)
    _serve(engine, adaptive, PROMPTS[:1], MAX_NEW[:1])  # alone: 1 running request, level 0
    assert levels and set(levels) == {0}
    levels.clear()
    _serve(engine, adaptive, [PROMPTS[0]] * 4, [20] * 4)  # 4 together (same length: they run together throughout)
    assert levels and set(levels) == {2}  # 3-4 running


def test_a_step_given_no_draft_still_rewards_the_arm_selected(verifier_model, tok):
    # width 0 (a steep cost) skips the drafter, not the policy: every step's selection is observed
    engine = _engine(verifier_model, tok, _budget_arms(), persistent_policy=True)
    observed = []
    for inner in engine.policy.policies:
        def spy(arm, reward, context=None, _observe=inner.observe):
            observed.append(arm)
            return _observe(arm, reward, context)
        inner.observe = spy
    got, steps = _serve(engine, AdaptiveSpeculation(lambda n: float(n) ** 3, max_width=16))
    assert all(s.adaptive.width == 0 for s in steps)
    assert len(observed) == sum(r.stats.steps for r in got) > 0


def test_each_step_is_priced_at_its_share_of_the_forward(verifier_model, tok, monkeypatch):
    calls = []
    original = Request.finish_step

    def spy(self, out, **kw):
        calls.append((kw.get("cost"), self.pending_drafting[0], len(self._pending_step.draft)))
        return original(self, out, **kw)

    monkeypatch.setattr(Request, "finish_step", spy)
    engine = _engine(verifier_model, tok, _budget_arms())
    steps = []
    adaptive = AdaptiveSpeculation(_linear, max_width=16)  # drafting not priced by the allocator (the default)
    with Scheduler(engine, max_batch=4, adaptive=adaptive) as s:
        s.add_listener(lambda r: steps.append(list(calls)) or calls.clear()
                       if isinstance(r, SchedulerStep) and r.batch_size else None)
        with s._lock:  # all queued before the first step: steps of several requests are sure to come
            handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        for h in handles:
            h.result(timeout=120)
    worked = [st for st in steps if len(st) > 1 and any(c[2] for c in st)]
    assert worked, "no step with several requests and a draft"
    for st in worked:
        rows = [1 + drafted for _, _, drafted in st]
        for i, (cost, draft_cost, _) in enumerate(st):
            assert cost == pytest.approx(shared_step_cost(_linear, rows, i, draft_cost))
    assert any(dc > 0 for st in worked for _, dc, _ in st)  # the model drafter's work is in the share


def test_counterfactual_drafts_are_priced_by_the_pricer_passed_to_finish_step(verifier_model, tok, monkeypatch):
    priced = []
    original = Request.finish_step

    def spy(self, out, *, verify_pricer=None, **kw):
        assert verify_pricer is not None  # the adaptive scheduler passes its share of the forward
        return original(self, out, verify_pricer=lambda n: priced.append(n) or verify_pricer(n), **kw)

    monkeypatch.setattr(Request, "finish_step", spy)
    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    got, _ = _serve(engine, AdaptiveSpeculation(_linear, max_width=16))
    assert got and priced  # the budget arms' and none's counterfactuals were priced through it


def test_sampled_request_gives_the_same_tokens_whatever_runs_beside_it(verifier_model, tok):
    def run(prompts, max_new, seeds):
        drafter = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0), nodes=8, depth=3, width=2, name="tree")
        engine = _engine(verifier_model, tok, [drafter], policy=None)
        with Scheduler(engine, max_batch=4, adaptive=AdaptiveSpeculation(lambda n: 1.0, max_width=16)) as s:
            handles = [s.submit(p, n, temperature=1.0, seed=sd) for p, n, sd in zip(prompts, max_new, seeds)]
            return [h.result(timeout=120).token_ids for h in handles]

    alone = run(PROMPTS[:1], [24], [7])[0]
    together = run(PROMPTS, [24, 9, 31, 14], [7, 1, 2, 3])[0]
    assert together == alone


def test_adaptive_arguments_are_checked(verifier_model, tok):
    with pytest.raises(ValueError, match="max_width"):
        AdaptiveSpeculation(_linear, max_width=-1)
    with pytest.raises(ValueError, match="unit_seconds"):
        AdaptiveSpeculation(_linear, unit_seconds=0.0)
    with pytest.raises(ValueError, match="min_gain"):
        AdaptiveSpeculation(_linear, min_gain=0.5)
    for bad in (0.5, float("inf"), "3", True):
        with pytest.raises(ValueError, match="probe_stall"):
            AdaptiveSpeculation(_linear, probe_stall=bad)
    assert AdaptiveSpeculation(_linear, probe_stall=3).probe_stall == 3.0
    assert AdaptiveSpeculation(_linear).probe_stall is None  # no bound by default
    with pytest.raises(ValueError, match="cost"):
        AdaptiveSpeculation(3.0)
    engine = _engine(verifier_model, tok, _budget_arms())
    with pytest.raises(ValueError, match="adaptive"):
        Scheduler(engine, adaptive=_linear)


@pytest.mark.parametrize("serving, field", [({"adaptive": "yes"}, "serving.adaptive"),
                                            ({"max_width": -1}, "serving.max_width"),
                                            ({"profile": {"token_counts": [0, 4]}}, "serving.profile.token_counts"),
                                            ({"profile": {"max_seconds": 0}}, "serving.profile.max_seconds"),
                                            ({"width": 8}, "serving.width"),
                                            ({"min_gain": 0.9}, "serving.min_gain"),
                                            ({"probe_stall": 0.5}, "serving.probe_stall"),
                                            ({"draft_cost": "guessed"}, "serving.draft_cost"),
                                            ({"defer_catch_up": True}, "serving.defer_catch_up")])
def test_serving_config_errors_name_the_field(serving, field):
    from metasd.config import ConfigError, parse_pool_config

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_pool_config({"verifier": {"model": "bundled:x"}, "serving": serving})


def test_the_adaptive_pool_file_parses():
    from metasd.config import read_pool_config

    config = read_pool_config("configs/pools/serve_adaptive.yaml")
    assert config.serving.adaptive and config.policy.name == "per_load" and config.feedback == "full"
    assert config.arm_names == ["cascade@4", "cascade@16", "cascade@48"]  # a plain step is the allocator's choice
    assert not read_pool_config(None).serving.adaptive  # the default pool is unchanged
    assert config.serving.probe_stall == 2.0  # the served pool bounds a probe's stall (BENCHMARKS.md)
    assert read_pool_config(None).serving.probe_stall is None  # no bound unless a pool sets one
    assert read_pool_config("configs/pools/serve_adaptive.yaml", {"serving": {"adaptive": True, "probe_stall": 3}}
                            ).serving.probe_stall == 3.0


@pytest.mark.parametrize("content, message", [("{", "not JSON"),
                                              ('{"tokens": [1, 4]}', "seconds: missing"),
                                              ('{"tokens": [1, 4], "seconds": [0.1, 0.2], "wat": 1}', "wat: unknown")])
def test_serve_with_a_bad_cost_profile_fails_before_serving(tmp_path, capsys, monkeypatch, content, message):
    pytest.importorskip("fastapi")
    import yaml

    from metasd.cli import main
    from metasd.serve import cli as serve_cli
    from serve_helpers import write_tiny_pool

    pool = write_tiny_pool(tmp_path)
    data = yaml.safe_load(pool.read_text())
    pool.write_text(yaml.safe_dump({**data, "serving": {"adaptive": True}}))
    bad = tmp_path / "profile.json"
    bad.write_text(content)
    monkeypatch.setattr(serve_cli, "_serve_here", lambda *a: pytest.fail("served despite the bad profile"))
    assert main(["serve", "--pool", str(pool), "--cost-profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and message in err


def test_serve_settings_build_an_adaptive_scheduler_from_a_saved_profile(verifier_model, tok):
    from metasd.core.pricing.forward_profile import ForwardProfile
    from metasd.serve.cli import SchedulerSettings

    profile = ForwardProfile(tokens=[1, 16, 64], seconds=[0.01, 0.012, 0.03], name="saved")
    serving = {"adaptive": True, "max_width": 8, "price_drafting": True, "draft_cost": "measured", "min_gain": 1.25,
               "defer_catch_up": True, "probe_stall": 2.0, "profile": {"token_counts": None, "max_seconds": 5.0}}
    scheduler = SchedulerSettings(2, 4, False, serving, profile.to_dict()).make(_engine(verifier_model, tok,
                                                                                        _budget_arms()))
    try:
        assert scheduler.adaptive is not None and scheduler.adaptive.max_width == 8
        assert scheduler.adaptive.price_drafting
        assert scheduler.adaptive.cost(64) == pytest.approx(3.0)
        assert scheduler.adaptive.unit_seconds == pytest.approx(0.01)  # drafting priced in 1-token forwards
        assert scheduler.adaptive.min_gain == 1.25 and scheduler.adaptive.defer_catch_up
        assert scheduler.adaptive.probe_stall == 2.0
    finally:
        scheduler.close()
    modeled = SchedulerSettings(2, 4, False, {**serving, "draft_cost": "modeled"}, profile.to_dict()).make(
        _engine(verifier_model, tok, _budget_arms()))
    try:
        assert modeled.adaptive.unit_seconds is None  # the meter's model prices drafting
    finally:
        modeled.close()
    plain = SchedulerSettings(2, 4).make(_engine(verifier_model, tok, None, policy=None))
    assert plain.adaptive is None
    plain.close()


class _Pending:
    """What ``AdaptiveSpeculation`` reads of a request around its step (no model)."""

    def __init__(self, length=10, max_new_tokens=20, new=0, seconds=0.0, modeled=0.0):
        self.length, self.max_new_tokens, self.new_ids = length, max_new_tokens, [0] * new
        self.pending_drafting = (modeled, seconds, 0)

    @property
    def tokens_left(self):
        return self.max_new_tokens - len(self.new_ids)


def test_drafting_is_priced_by_its_measured_seconds_in_one_token_forwards():
    measured = AdaptiveSpeculation(_linear, unit_seconds=0.25)
    assert measured.drafting_cost(_Pending(seconds=0.5, modeled=0.1)) == pytest.approx(2.0)  # 0.5 s / 0.25 s
    assert AdaptiveSpeculation(_linear).drafting_cost(_Pending(seconds=0.5, modeled=0.1)) == pytest.approx(0.1)


def test_a_one_off_catch_up_is_learnt_per_token_and_amortized_over_the_request():
    adaptive = AdaptiveSpeculation(_linear, max_width=8)
    arm = budget_arms(_cascade(), (4,))[0]
    adaptive.learn(arm, [0], 4, 4, draft_cost=0.5, catch_up=2)  # a steady step: its cost is the average
    assert adaptive.draft_costs["cascade"] == pytest.approx(0.5) and "cascade" not in adaptive.catch_up_rates
    adaptive.learn(arm, [0], 4, 4, draft_cost=10.5, catch_up=100)  # a prompt's catch-up: per token, above steady
    assert adaptive.draft_costs["cascade"] == pytest.approx(0.5)  # the average is not moved by the one-off
    assert adaptive.catch_up_rates["cascade"] == pytest.approx(0.1)  # (10.5 - 0.5) / 100
    fresh = _Pending(length=200, max_new_tokens=40, new=0)  # never drafted: 200 tokens to catch up, 40 to go
    a4 = adaptive.curve(arm).expected(4)
    price = adaptive.draft_cost(arm, fresh)
    assert price(0) == 0.0
    assert price(4) == pytest.approx(0.5 + 0.1 * 200 / 40 * (1 + a4))  # share of the one-off per committed token
    adaptive._fed[fresh] = 195  # it drafted at length 195: 5 tokens behind, within max_width - the steady price
    assert adaptive.draft_cost(arm, fresh)(4) == pytest.approx(0.5) and adaptive.catch_up(arm, fresh) == 0.0
    assert adaptive.read_cost(arm, fresh) == pytest.approx(0.1 * 5)  # what a probe's stall counts (test_probe_stall)
    assert adaptive.draft_cost(arm)(4) == pytest.approx(0.5)  # no request: the steady price


class _Finishing(_Pending):
    """A request at the end of its step (``AdaptiveSpeculation.finish``): it commits two tokens; its draft of 4 nodes
    had its first node accepted."""

    draft_budget, max_draft_nodes = None, None

    def __init__(self, length, seconds, catch_up):
        super().__init__(length=length, max_new_tokens=64, seconds=seconds, modeled=0.1)
        self.pending_drafting = (0.1, seconds, catch_up)
        self.last_step = SimpleNamespace(path=[0], drafted=4, cut=False)

    def finish_step(self, out, **kwargs):
        self.length += 2
        return [1, 2], False


def test_a_drafting_step_after_plain_ones_is_priced_without_its_backlog():
    # a request that decoded plain for 6 steps has 6 tokens its drafters never read; the step it drafts again
    # catches them up - a one-off, priced at the arm's rate per caught-up token, not the price of drafting 4 nodes
    # (else every plain run would make drafting look dearer: each probe out of a plain run would teach it)
    adaptive = AdaptiveSpeculation(_linear, max_width=8, unit_seconds=0.25)
    arm = budget_arms(_cascade(), (4,))[0]
    adaptive.catch_up_rates["cascade"] = 0.1  # one-token forwards per caught-up token
    behind = _Finishing(length=110, seconds=0.625, catch_up=7)  # 2.5 one-token forwards of drafting
    adaptive._fed[behind] = 104
    adaptive.finish(behind, None, 0.1, [5], 0, arm, 4)
    assert adaptive.draft_prices.price("cascade", load_level(1), 4) == pytest.approx(2.5 - 0.1 * 6)
    assert adaptive._fed[behind] == 112 and adaptive.unfed(behind) == 0
    steady = AdaptiveSpeculation(_linear, max_width=8, unit_seconds=0.25)
    steady.catch_up_rates["cascade"] = 0.1
    drafted_last = _Finishing(length=110, seconds=0.625, catch_up=2)  # its drafters read everything but its bonus
    steady._fed[drafted_last] = 110
    steady.finish(drafted_last, None, 0.1, [5], 0, arm, 4)
    assert steady.draft_prices.price("cascade", load_level(1), 4) == pytest.approx(2.5)
    assert adaptive.draft_costs["cascade"] == pytest.approx(1.9) and steady.draft_costs["cascade"] == pytest.approx(2.5)


def test_the_catch_up_price_keeps_a_short_request_from_drafting():
    # two running requests, one long prompt about to finish: its drafter's catch-up does not pay, the other drafts
    adaptive = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True)
    arm = budget_arms(_cascade(), (4,))[0]
    for _ in range(20):
        adaptive.learn(arm, [0, 1, 2], 4, 4, draft_cost=0.05, catch_up=0)
    adaptive.learn(arm, [0], 4, 4, draft_cost=20.05, catch_up=1000)  # 0.02 per caught-up token
    short, steady = _Pending(length=1000, max_new_tokens=3, new=1), _Pending(length=1000, max_new_tokens=64)
    adaptive._fed[steady] = 1000
    alloc = adaptive.allocate([arm, arm], [short, steady])
    assert alloc.nodes == [0, 4]
    adaptive._fed[short] = 1000  # once caught up, it drafts too
    assert adaptive.allocate([arm, arm], [short, steady]).nodes == [4, 4]


def test_a_request_that_drafted_is_not_charged_its_prompt_again(verifier_model, tok, monkeypatch):
    # the scheduler records where each request's drafters stand after a step it drafted in: the next step prices
    # only the tokens committed since (<= max_width + 1), not the prompt's catch-up again
    seen = []
    original = AdaptiveSpeculation.allocate

    def spy(self, arms, requests=None, joining=0):
        alloc = original(self, arms, requests, joining)
        seen.append([(id(r), self.unfed(r), d) for r, d in zip(requests, alloc.nodes)])
        return alloc

    monkeypatch.setattr(AdaptiveSpeculation, "allocate", spy)
    engine = _engine(verifier_model, tok, _budget_arms())
    got, _ = _serve(engine, AdaptiveSpeculation(_linear, max_width=4))
    assert [len(r.token_ids) for r in got] == MAX_NEW
    checked = 0
    for before, step in zip(seen, seen[1:]):
        drafted = {rid for rid, _, d in before if d > 0}  # drafted in the step before: caught up but its commits
        for rid, unfed, _ in step:
            if rid in drafted:
                assert unfed <= 4 + 1
                checked += 1
    assert checked > 5
    assert max(unfed for step in seen[:1] for _, unfed, _ in step) > 5  # a new request: its whole prompt


def test_metasd_serve_without_a_pool_serves_the_adaptive_pool(monkeypatch):
    pytest.importorskip("fastapi")
    from metasd.cli import main
    from metasd.config import default_serve_pool_path, read_pool_config
    from metasd.serve import cli as serve_cli

    got = {}
    monkeypatch.setattr(serve_cli, "_serve_here", lambda recipe, settings, *a: got.update(recipe=recipe,
                                                                                         settings=settings) or 0)
    assert main(["serve"]) == 0
    assert got["recipe"].parse() == read_pool_config(default_serve_pool_path())
    assert default_serve_pool_path().read_text() == open("configs/pools/serve_adaptive.yaml").read()  # packaged
    assert got["settings"].adaptive["adaptive"] and got["settings"].adaptive["price_drafting"]
    assert got["recipe"].parse().arm_names == ["cascade@4", "cascade@16", "cascade@48"]


def _caught_up_arm(adaptive, rate=0.5, budget=4):
    """A cascade budget arm whose model's catch-up the adaptive has learnt to cost ``rate`` per token."""
    arm = budget_arms(_cascade(), (budget,))[0]
    for _ in range(20):
        adaptive.learn(arm, [0, 1, 2], 4, 4, draft_cost=0.05, catch_up=0)
    adaptive.learn(arm, [0], 4, 4, draft_cost=0.05 + rate * 1000, catch_up=1000)
    return arm


def test_a_request_whose_model_must_catch_up_drafts_with_the_lookups_alone():
    deferring = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True, defer_catch_up=True)
    arm = _caught_up_arm(deferring)
    fresh = _Pending(length=1000, max_new_tokens=8)  # its whole prompt to read, 8 tokens to go: the model cannot pay
    a = deferring.allocate([arm], [fresh])
    assert a.options == [1] and a.nodes[0] > 0  # the suffix lookup drafts alone
    assert deferring.lookup_alternative(arm, fresh) is not None
    plain = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True)
    assert plain.allocate([_caught_up_arm(plain)], [fresh]).nodes == [0]  # without it: a plain step
    deferring._fed[fresh] = 1000  # caught up: the arm drafts in full, no alternative offered
    assert deferring.lookup_alternative(arm, fresh) is None
    assert deferring.allocate([arm], [fresh]).options == [0]
    # a lookup-only step teaches the request's own lookup curve, not the arm's (nor another request's)
    other = _Pending(length=1000, max_new_tokens=8)
    before, prior = deferring.curve(arm).values().copy(), deferring.lookup_curve(other).values().copy()
    deferring.learn(arm, [], 4, 4, draft_cost=0.0, lookup=deferring.lookup_curve(fresh))
    assert deferring.curve(arm).values().tolist() == before.tolist()
    assert deferring.lookup_curve(other).values().tolist() == prior.tolist()
    assert deferring.lookup_curve(fresh).expected(4) < deferring.lookup_curve(other).expected(4)
    assert "cascade/lookup" in deferring.draft_costs
    # an arm with no lookup in it has no alternative
    model_only = budget_arms(PretrainedTreeDrafter(tiny_qwen(seed=0), nodes=4, depth=2, name="model"), (4,))[0]
    assert deferring.lookup_alternative(model_only, _Pending(length=1000)) is None
    with pytest.raises(ValueError, match="defer_catch_up needs price_drafting"):
        AdaptiveSpeculation(_linear, defer_catch_up=True)


def test_a_probe_keeps_a_request_on_its_lookups_and_widens_the_others():
    # a probe drafts the model wider to measure it; a request the allocator put on its lookups alone (its model would
    # first read 1000 unread tokens at a steep catch-up) keeps its lookups and nodes - before, a probe gave it the
    # model's option and the whole catch-up
    adaptive = AdaptiveSpeculation(lambda n: 1.0 + 0.3 * n, max_width=16, price_drafting=True, defer_catch_up=True)
    arm = _caught_up_arm(adaptive, rate=1.0, budget=16)
    fresh, steady = _Pending(length=1000, max_new_tokens=8), _Pending(length=100, max_new_tokens=64)
    adaptive._fed[steady] = 100
    first = adaptive.allocate([arm, arm], [fresh, steady])
    assert first.options == [1, 0]
    probe = _next_probe(adaptive, lambda: adaptive.allocate([arm, arm], [fresh, steady]))
    allocated = adaptive.allocate([arm, arm], [fresh, steady])  # the allocator's own choice for the same step
    assert probe.options == [1, 0] and probe.nodes[0] == allocated.nodes[0] > 0  # its lookups, its nodes
    assert probe.nodes[1] > allocated.nodes[1]  # the other drafts wider
    alone = _next_probe(adaptive, lambda: adaptive.allocate([arm], [fresh]))  # no one left to widen: no probe
    assert alone is None


def test_lookup_only_steps_keep_the_model_out_and_outputs_exact(verifier_model, tok, monkeypatch):
    # the cascade's model is priced out by a steep catch-up: every request drafts with the suffix lookup alone while
    # its prompt is unread - the model is never asked and the output is the verifier's
    asked = []
    drafting = PretrainedTreeDrafter.drafting  # what a request (or a fused drafter) runs to draft with it
    monkeypatch.setattr(PretrainedTreeDrafter, "drafting", lambda self, ctx: asked.append(ctx) or drafting(self, ctx))
    engine = _engine(verifier_model, tok, _budget_arms())
    adaptive = AdaptiveSpeculation(_linear, max_width=2, price_drafting=True, defer_catch_up=True)
    adaptive.draft_costs["cascade"], adaptive.catch_up_rates["cascade"] = 0.01, 100.0
    got, steps = _serve(engine, adaptive, prompts=[p * 4 for p in PROMPTS])  # prompts of 4 to 76 tokens
    assert [r.token_ids for r in got] == _plain(verifier_model, tok, [p * 4 for p in PROMPTS])
    lookup_steps = sum(o == 1 for s in steps for o in s.adaptive.options)
    assert lookup_steps > 0 and "cascade/lookup" in {**adaptive.draft_costs, **adaptive.catch_up_rates}
    assert sum(r.stats.drafted for r in got) > 0  # the suffix lookup drafted
    assert asked == []  # the model never drafted: every drafting step was lookup-only


def test_a_lookup_only_step_does_not_ask_an_arm_with_no_lookup_in_it(verifier_model, tok, monkeypatch):
    asked = []
    drafting = PretrainedTreeDrafter.drafting  # what a request (or a fused drafter) runs to draft with it
    monkeypatch.setattr(PretrainedTreeDrafter, "drafting", lambda self, ctx: asked.append(ctx) or drafting(self, ctx))
    model = PretrainedTreeDrafter(tiny_qwen(seed=0), nodes=4, depth=2, name="model")
    request = Request(_engine(verifier_model, tok, [model], policy=None), PROMPTS[0], 8)
    request._start()
    request.select_arm()
    assert len(request.propose(4, lookup_only=True)) == 0 and asked == []  # a plain step: the model is not asked
    request._pending_step = None
    request.select_arm()
    request.propose(4)
    assert len(asked) == 1 and not asked[0].lookup_only


def test_a_request_with_its_own_draft_budget_teaches_the_shared_curves_nothing(verifier_model, tok):
    # one client's draft_budget 0 (or 1) was recorded as if the allocator's whole budget had been rejected: enough
    # such requests switched speculation off for everyone. A request that sets its own budget stays out of the curves.
    from metasd.core.batching.request_handle import RequestOptions

    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    adaptive = AdaptiveSpeculation(_linear, max_width=12)
    for budget in (0, 1):
        got, _ = _serve(engine, adaptive, options=RequestOptions(draft_budget=budget))
        assert all(r.stats.drafted <= budget * r.stats.steps for r in got)
    assert all(int(c.counts.sum()) == 0 for c in adaptive.curves.values())
    _serve(engine, adaptive)
    assert sum(int(c.counts.sum()) for c in adaptive.curves.values()) > 0


def test_counterfactual_drafting_is_priced_in_the_played_arms_units():
    # with drafting priced by measured seconds, the other arms' drafting (modeled only) is scaled by the measured /
    # modeled ratio of the drafting seen, not added in modeled units beside measured ones
    from types import SimpleNamespace

    measured = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True, unit_seconds=0.1)
    step = lambda modeled, seconds: SimpleNamespace(pending_drafting=(modeled, seconds, 0))  # noqa: E731
    assert measured.modeled_scale(step(0.0, 0.0)) == 1.0  # nothing seen yet
    assert measured.modeled_scale(step(2.0, 0.4)) == pytest.approx(2.0)  # 0.4 s = 4 units for 2 modeled
    assert measured.modeled_scale(step(0.0, 0.0)) == pytest.approx(2.0)  # a lookup step keeps the ratio
    assert 2.0 < measured.modeled_scale(step(1.0, 0.5)) < 5.0  # a running average moving toward 5
    modeled = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True)
    assert modeled.modeled_scale(step(2.0, 0.4)) == 1.0  # modeled drafting: already in the same units


def test_the_scheduler_hands_the_scale_to_each_step(verifier_model, tok, monkeypatch):
    expected, scales = _plain(verifier_model, tok), []
    finish = Request.finish_step
    monkeypatch.setattr(Request, "finish_step", lambda self, out, **kw: scales.append(kw.get("modeled_scale"))
                        or finish(self, out, **kw))
    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    got, _ = _serve(engine, AdaptiveSpeculation(_linear, max_width=12, price_drafting=True, unit_seconds=1e-3))
    assert [r.token_ids for r in got] == expected
    assert scales and all(s is not None for s in scales) and any(s != 1.0 for s in scales)


def test_the_forward_is_priced_at_its_measured_ratio_to_the_profile_per_load_level():
    # 4 requests with a caught-up arm whose 4-node drafts commit ~3 tokens: its drafting price sits between what a
    # plain step and a drafting step cost at the profile's price and at twice it. Measured forwards twice as dear as
    # profiled make the saved forwards worth twice as much: the allocator then drafts
    from types import SimpleNamespace

    adaptive = AdaptiveSpeculation(_linear, max_width=4, price_drafting=True, unit_seconds=0.25)
    arm = budget_arms(_cascade(), (4,))[0]
    for _ in range(20):
        adaptive.learn(arm, [0, 1, 2], 4, 4, draft_cost=0.0, running=4)
    a = adaptive.curve(arm).expected(4)
    price = 1.5 * ((1 + a) * _linear(4) - _linear(20)) / 4  # plain and drafting tie at 1.5x the profile
    for _ in range(20):
        adaptive.learn(arm, [0, 1, 2], 4, 4, draft_cost=price, running=4)
    steady = [_Pending(length=100, max_new_tokens=64) for _ in range(4)]
    for r in steady:
        adaptive._fed[r] = 100
    assert adaptive.forward_ratio(4) == 1.0 and adaptive.allocate([arm] * 4, steady).nodes == [0] * 4
    plain = SimpleNamespace(width=0, goodput=1.0, table={}, options=[], tokens=4.0, probe=False)
    adaptive.record(plain, [0] * 4, 4, forward_s=2 * 0.25 * _linear(4))  # a plain step took 2x its profiled price
    assert adaptive.forward_ratio(4) == pytest.approx(2.0)
    assert adaptive.forward_ratio(3) == pytest.approx(2.0) and adaptive.forward_ratio(1) == pytest.approx(2.0)
    assert min(adaptive.allocate([arm] * 4, steady).nodes) > 0
    # every verify price of the level reads it: the step's share and a counterfactual's
    assert adaptive.step_cost([5, 5, 5, 5], 0, 0.3) == pytest.approx(2.0 * _linear(20) / 4 + 0.3)
    assert adaptive.pricer([5, 1, 1, 1], 1)(4) == pytest.approx(2.0 * _linear(20) / 4)
    adaptive.record(plain, [0], 1, forward_s=0.25 * _linear(1))  # alone: the profile's price, its own level
    assert adaptive.forward_ratio(1) == pytest.approx(1.0) and adaptive.forward_ratio(4) == pytest.approx(2.0)
    adaptive.record(plain, [0] * 4, 4, forward_s=0.25 * _linear(4))  # an exponential average, toward 1
    assert 1.0 < adaptive.forward_ratio(4) < 2.0
    modeled = AdaptiveSpeculation(_linear, max_width=4)  # no unit: a forward's seconds cannot be put in its units
    modeled.record(plain, [0] * 4, 4, forward_s=1.0)
    assert modeled.forward_ratios == {} and modeled.forward_ratio(4) == 1.0


def test_the_scheduler_hands_each_forwards_seconds_to_the_adaptation(verifier_model, tok):
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(), feedback="full")
    adaptive = AdaptiveSpeculation(_linear, max_width=12, price_drafting=True, unit_seconds=1e-3)
    got, steps = _serve(engine, adaptive)
    assert [r.token_ids for r in got] == expected
    levels = {load_level(s.batch_size) for s in steps}
    assert set(adaptive.forward_ratios) == levels and all(r > 0 for r in adaptive.forward_ratios.values())


def test_a_level_that_decodes_plain_for_long_drafts_one_step_to_measure_its_prices_again():
    # drafting priced far above what it saves: the allocator keeps every step plain, and a level that decodes plain
    # never measures its drafting again - so a run of plain steps (2, then 4, 8, 16, 16, ...: a level's first probe
    # comes early, later ones at most every PROBE_EVERY steps) ends with a step that drafts once, at the width the
    # allocator rated best, each request up to its cap; the step's price then updates the level's estimate
    from metasd.core.batching.probes import PROBE_EVERY, PROBE_FIRST

    adaptive = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True, unit_seconds=0.25)
    arm = budget_arms(_cascade(), (4,))[0]
    for _ in range(20):
        adaptive.learn(arm, [0, 1], 4, 4, draft_cost=50.0, running=2)
    steady = [_Pending(length=100, max_new_tokens=64) for _ in range(2)]
    for r in steady:
        adaptive._fed[r] = 100
    allocs = [adaptive.allocate([arm, arm], steady) for _ in range(30)]
    probes = [i for i, a in enumerate(allocs) if a.width > 0]
    assert (PROBE_FIRST, PROBE_EVERY) == (2, 16) and probes == [1, 5, 13, 29]  # after runs of 2, 4, 8 and 16 steps
    w = allocs[-1].width  # the widest width scanned: its draft samples every narrower budget
    assert w == max(allocs[-1].table) == 4  # the arm's cap
    assert allocs[-1].nodes == [w, w] and allocs[-1].options == [0, 0]
    for _ in range(PROBE_EVERY - 1):  # a request without an arm never drafts, in a probe either
        assert adaptive.allocate([arm, None], steady).nodes == [0, 0]
    assert adaptive.allocate([arm, None], steady).nodes == [w, 0]
    alone = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True)
    assert all(alone.allocate([None, None], steady).nodes == [0, 0] for _ in range(40))
    unpriced = AdaptiveSpeculation(lambda n: 1.0 + 10.0 * n, max_width=8)  # plain by the forward alone: no probe
    assert all(unpriced.allocate([arm, arm], steady).width == 0 for _ in range(2 * PROBE_EVERY))


def test_a_level_that_drafts_narrow_for_long_drafts_one_step_wider_to_measure_the_wider_prices_again():
    # 2 nodes learnt cheap, 4 and 8 learnt dear: the allocator keeps drafting 2 and never measures the wider prices
    # again - so a run of steps at that width (2, 4, 8, 16, 16, ...) ends with one drafting at the wider width it
    # rated best
    from metasd.core.batching.probes import PROBE_EVERY

    adaptive = AdaptiveSpeculation(_linear, max_width=8, price_drafting=True, unit_seconds=0.25)
    arm = budget_arms(_cascade(), (8,))[0]
    for budget, cost in ((2, 0.1), (4, 50.0), (8, 50.0)):
        for _ in range(20):
            adaptive.learn(arm, [0, 1], budget, budget, draft_cost=cost, running=1)
    steady = [_Pending(length=100, max_new_tokens=64)]
    adaptive._fed[steady[0]] = 100
    allocs = [adaptive.allocate([arm], steady) for _ in range(30)]
    assert [i for i, a in enumerate(allocs) if a.width != 2] == [1, 5, 13, 29]
    probe = allocs[-1]
    assert probe.width == max(probe.table) == 8  # the widest scanned: one draft samples every budget up to 8
    assert probe.nodes == [8] and probe.table[8] <= probe.table[2]  # not the model's choice
    from metasd.core.pricing.allocator import expected_goodput
    priced = [adaptive.draft_cost(arm, steady[0], running=1)]  # the record's goodput: the probe's own 8 nodes
    own = expected_goodput([adaptive.curve(arm)], [8], adaptive.forward_cost(1), draft_costs=priced)
    assert probe.goodput == pytest.approx(own) and own < probe.table[8]
    capped = budget_arms(_cascade(), (2,))[0]  # nothing wider is possible: no probe
    assert all(adaptive.allocate([capped], steady).nodes == [2] for _ in range(2 * PROBE_EVERY))


def test_a_draft_shallower_than_the_requests_last_tokens_still_teaches_the_curves(verifier_model, tok):
    # every request here has fewer tokens left than the 48 nodes the allocator may give, and a draft of the tiny
    # cascade is at most 6 deep (16 for a suffix match): a draft the remaining tokens did not bound is what the budget
    # buys and is learnt - only one that reached the depth bound is left out (before, every step was: a 64-token answer
    # taught the 48-node budget nothing after its first 16 tokens)
    expected = [Engine(Verifier(verifier_model, tok), None, check_tokenizers=False).generate(p, 12).token_ids
                for p in PROMPTS]
    engine = _engine(verifier_model, tok, [FusedDrafter([SuffixDrafter(max_depth=4, max_nodes=8, name="suffix"),
                                                         PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0),
                                                                               mode="dynamic", nodes=12, depth=3,
                                                                               width=3, name="model")],
                                                        enough=6, name="cascade")], policy=None)
    adaptive = AdaptiveSpeculation(lambda n: 1.0, max_width=48)  # a flat forward: the widest draft is the best
    got, steps = _serve(engine, adaptive, max_new=[12] * len(PROMPTS))
    assert [r.token_ids for r in got] == expected
    assert min(s.adaptive.width for s in steps if s.adaptive.width > 0) > 12  # every draft's budget beyond the 12
    drafting = sum(1 for s in steps for r in s.requests if r.drafted > 0)
    learnt = int(adaptive.curves["cascade"].counts[0])  # the 1-node budget: every learnt draft samples it
    assert drafting > 0 and learnt >= drafting - 2 * len(PROMPTS)  # at most the last steps of each request cut


def _wide_probes(adaptive, nodes=48):
    """Let every load level's probes draft up to ``nodes`` nodes, as a level that drafted ``nodes // 2`` already may
    (``ProbeBudget.most``): the tests of what a probe drafts within that bound."""
    adaptive.probe_budget.widest = dict.fromkeys(range(len(LOAD_LEVELS) + 1), nodes // 2)
    return adaptive


def _next_probe(adaptive, step):
    """What ``step()`` returns at the next probe (it is called until the adaptive's probe count grows, at most
    ``PROBE_EVERY`` times; None if none came)."""
    from metasd.core.batching.probes import PROBE_EVERY

    before = sum(adaptive.width_runs.probes.values())
    for _ in range(PROBE_EVERY):
        out = step()
        if sum(adaptive.width_runs.probes.values()) > before:
            return out
    return None


def test_probe_runs_grow_from_two_steps_to_probe_every_per_load_level():
    # a level starts from priors (the start-up profile's forward extrapolated from 1 and 4 tokens, no drafting
    # measured): with a fixed 16-step run four requests decoded 14-15 plain steps before their first draft and two
    # requests 13 with none (BENCHMARKS.md) - the first probe of a level comes after 2 steps, each later one after
    # twice the run before, up to PROBE_EVERY; a change of width or a step where nothing wider was possible starts
    # the run again, and each level keeps its own count
    from metasd.core.batching.probes import PROBE_EVERY, PROBE_FIRST, WidthRuns

    runs = WidthRuns()

    def gaps(level, n):
        due = [i for i in range(n) if runs.due(level, 0, True)]
        return [b - a for a, b in zip([-1] + due, due)]

    assert (PROBE_FIRST, PROBE_EVERY) == (2, 16)
    assert gaps(0, 62) == [2, 4, 8, 16, 16, 16]
    assert gaps(1, 6) == [2, 4] and runs.period(0) == 16 and runs.period(1) == 8  # its own count
    assert [runs.due(2, w, True) for w in (0, 2, 2)] == [False, False, True]  # a new width starts the run
    assert [runs.due(2, 0, True), runs.due(2, 0, False)] + [runs.due(2, 0, True) for _ in range(4)] == \
        [False, False, False, False, False, True]  # nothing wider possible: the run starts again


def test_a_probe_drafts_the_widest_width_rated_nearly_as_good_as_the_choice():
    # one verified draft samples every narrower budget, but a 48-node probe beside many rows costs several plain
    # steps (at 8 requests on this CPU: 3.4-4.0 s at 20-21 tokens/s against ~27 for plain steps, with a floor of
    # half): the probe takes the widest width rated >= PROBE_FLOOR x the allocation, else the best-rated wider one
    from metasd.core.batching.probes import PROBE_FLOOR
    from metasd.core.pricing.allocator import Allocation

    adaptive = _wide_probes(AdaptiveSpeculation(_linear, max_width=48, price_drafting=True))

    def probed(table, caps=(48, 48)):
        plain = Allocation([0] * len(caps), 0, table[0], dict(table), [0] * len(caps), float(len(caps)))
        return _next_probe(adaptive, lambda: adaptive.probe(plain, [None] * len(caps), list(caps), _linear))

    assert PROBE_FLOOR == 0.9
    assert probed({0: 3.0, 2: 2.95, 8: 2.8, 48: 1.6}).nodes == [8, 8]  # 48 rated under the floor: left out
    assert probed({0: 3.0, 2: 1.0, 8: 0.5, 48: 0.3}).nodes == [2, 2]  # none at the floor: the best-rated wider
    # ... or the widest rated within PROBE_FLOOR of that one: where every width rates under a plain step, a per-step
    # drafting price favours the narrowest by a little, and a lone request probed with 1 node in 15 of 20 probes
    assert probed({0: 3.0, 2: 2.0, 8: 1.9, 48: 0.3}).nodes == [8, 8]
    assert probed({0: 3.0, 1: 2.2, 2: 2.0, 8: 2.05, 48: 2.0}).nodes == [48, 48]
    assert probed({0: 3.0, 2: 2.9, 8: 2.95, 48: 2.8}, caps=(48, 4)).nodes == [48, 4]  # each row within its cap


def test_a_probe_drafts_no_fewer_nodes_than_the_narrowest_budget_arm(monkeypatch):
    # a lone request locked into plain steps rated 1 node best and probed with it (BENCHMARKS.md, "A start-up profile
    # of 30 s instead of 5 s, tried"): a 1-node draft samples no budget the arms choose among (4, 16, 48), so a curve
    # one unlucky first draft had learnt low stayed low; a probe drafts at least the narrowest sibling budget
    from metasd.core.batching import probes
    from metasd.core.pricing.allocator import Allocation

    ratings = {1: 0.77, 2: 0.67, 4: 0.67, 8: 0.45, 16: 0.48}
    assert probes.probe_width(ratings, 1.06) == 1 and probes.probe_width(ratings, 1.06, least=4) == 4
    assert probes.probe_width({1: 0.77, 2: 0.67}, 1.06, least=4) == 2  # never beyond the widest reachable
    arms = budget_arms(_cascade(), (4, 16, 48))
    assert probes.narrowest(arms, lambda d: d.budget) == 4 and probes.narrowest(arms[:1], lambda d: d.budget) == 0
    adaptive = _wide_probes(AdaptiveSpeculation(_linear, max_width=48, price_drafting=True))
    plain = Allocation([0], 0, 1.06, {0: 1.06, **ratings}, [0], 1.0)
    for least, nodes in ((0, [1]), (4, [4])):
        got = _next_probe(adaptive, lambda: adaptive.probe(plain, [None], [48], _linear, least=least))
        assert got.nodes == nodes
    floors, real = [], probes.probe  # through the allocator: the narrowest budget among the request's siblings
    monkeypatch.setattr(probes, "probe", lambda *a: floors.append(a[8]) or real(*a))  # its ``least``
    adaptive.learn(arms[2], [], 16, 48, draft_cost=5.0, running=1)  # one 16-node draft: nothing accepted, dear
    for i, can_switch in enumerate((True, False)):
        request = _Switchable(arms, can_switch=can_switch, length=100, max_new_tokens=64)
        adaptive._fed[request] = 100
        assert _next_probe(adaptive, lambda: adaptive.step_plan([i], [arms[1]], [request])) is not None
    assert floors == [4, 0]  # a request the policy's choice binds (no siblings to switch to): no floor


class _Switchable(_Pending):
    """A request stand-in whose arm a probe may switch among its drafters (``Request.can_switch_arm``)."""

    def __init__(self, drafters, can_switch=True, **kw):
        super().__init__(**kw)
        self.drafters, self.can_switch_arm, self.switched = drafters, can_switch, []

    def switch_arm(self, drafter):
        self.switched.append(drafter.name)


def test_a_probe_drafts_with_a_wider_sibling_arm_than_the_narrow_one_the_policy_chose():
    # one request: its first 16-node draft accepted 2 nodes, then 2-node drafts accepted 2 - the wide budgets keep
    # that one sample and the allocator drafts 2 nodes; the policy's arms score alike (each drafts the same 2 nodes)
    # and it settled on cascade@4. A probe rated by the curve and capped by that arm drafted 4 nodes and never sampled
    # the wide budgets again (BENCHMARKS.md, "Budget arms as exploration"); it is rated hopefully and drafts with the
    # entry's widest arm instead
    adaptive = _wide_probes(AdaptiveSpeculation(_linear, max_width=48, price_drafting=True, unit_seconds=0.25))
    arms = budget_arms(_cascade(), (4, 16, 48))
    adaptive.learn(arms[1], [0, 1], 16, 16, draft_cost=0.3, running=1)
    for _ in range(20):
        adaptive.learn(arms[0], [0, 1], 2, 2, draft_cost=0.1, running=1)
    request = _Switchable(arms, length=100, max_new_tokens=64)
    adaptive._fed[request] = 100
    chosen = adaptive.step_plan([1], [arms[0]], [request])
    assert chosen.nodes == {1: 2} and not chosen.alloc.probe  # the allocator's choice
    probe = _next_probe(adaptive, lambda: adaptive.step_plan([1], [arms[0]], [request]))
    assert probe.nodes == {1: 48} and probe.arms == {1: arms[2]} and request.switched == []  # the scheduler switches
    assert probe.alloc.probe and adaptive.record(probe.alloc, [48], 49).probe  # the step's record says so (traces)
    assert not adaptive.record(chosen.alloc, [2], 3).probe
    adaptive.probe_budget.balance.clear()  # those records settled the probe's (modeled) loss: the level probes again
    fixed = _Switchable(arms, can_switch=False, length=100, max_new_tokens=64)  # a policy that may not be overruled
    adaptive._fed[fixed] = 100
    capped = _next_probe(adaptive, lambda: adaptive.step_plan([2], [arms[0]], [fixed]))
    assert capped.nodes == {2: 4} and capped.arms == {2: arms[0]} and fixed.switched == []
    bounded = _Switchable(arms, length=100, max_new_tokens=64)  # KV rows reserved for 16 draft nodes
    bounded.max_draft_nodes = 16
    adaptive._fed[bounded] = 100
    within = _next_probe(adaptive, lambda: adaptive.step_plan([3], [arms[0]], [bounded]))
    assert within.nodes == {3: 16} and within.arms == {3: arms[1]}


def test_a_probe_stays_within_the_requests_tokens_left():
    # a draft deeper than a request's tokens left less one is cut by its last tokens and teaches nothing
    # (``StepRecord.cut``): the 8-token warm-up request's 48-node probe was, and it spent its level's first probe
    adaptive = AdaptiveSpeculation(_linear, max_width=48, price_drafting=True, unit_seconds=0.25)
    arms = budget_arms(_cascade(), (4, 16, 48))
    for _ in range(20):
        adaptive.learn(arms[0], [0, 1], 2, 2, draft_cost=0.1, running=1)
    short = _Switchable(arms, length=100, max_new_tokens=8, new=1)  # 7 tokens left: a 6-node draft stays whole
    adaptive._fed[short] = 100
    assert adaptive.reach(arms[0], 4, short) == 6
    probe = _next_probe(adaptive, lambda: adaptive.step_plan([1], [arms[0]], [short]))
    assert probe.nodes == {1: 6} and probe.arms == {1: arms[1]}  # cascade@16 holds the 6 nodes
    last = _Switchable(arms, length=100, max_new_tokens=8, new=7)  # its last token: nothing a draft could add
    assert adaptive.reach(arms[0], 4, last) == 0
    assert _next_probe(adaptive, lambda: adaptive.step_plan([2], [arms[0]], [last])) is None
    bounded = _Switchable(arms, length=100, max_new_tokens=64)
    bounded.max_draft_nodes = 16
    assert adaptive.reach(arms[0], 4, bounded) == 16 and adaptive.reach(arms[0], 4, None) == 4  # no request: no sibling


def test_a_request_whose_switch_to_a_probes_arm_fails_fails_alone(verifier_model, tok, monkeypatch):
    # the scheduler switches a probed request to its wider sibling arm (``Request.switch_arm``) inside its per-request
    # guard: the first switch raises, that request alone ends with the error, the others finish as the verifier's
    import metasd.core.batching.probes as probes_module

    monkeypatch.setattr(probes_module, "PROBE_EVERY", 2)
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(), policy="ucb", feedback="full")
    monkeypatch.setattr(engine.policy, "select", lambda context=None: 0)  # cascade@2: every probe switches
    broken = []

    def switch(self, drafter):
        if not broken:
            broken.append(self)
            raise RuntimeError("switch failed")

    monkeypatch.setattr(Request, "switch_arm", switch)
    adaptive = _wide_probes(AdaptiveSpeculation(lambda n: 1.0 + 0.5 * n, max_width=16, price_drafting=True,
                                                unit_seconds=1e-3), nodes=16)
    with Scheduler(engine, max_batch=4, adaptive=adaptive) as s:
        with s._lock:
            handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        outcomes = []
        for h in handles:
            try:
                outcomes.append(h.result(timeout=120).token_ids)
            except RuntimeError as e:
                outcomes.append(str(e))
    assert len(broken) == 1 and outcomes.count("switch failed") == 1
    assert all(o == e for o, e in zip(outcomes, expected) if o != "switch failed")


def test_a_curve_read_hopefully_rates_budgets_sampled_less_than_the_narrow_one_as_its_acceptance_implies():
    from metasd.core.pricing.acceptance_curve import AcceptanceCurve, geometric_prior, implied_alpha

    curve = AcceptanceCurve()
    assert curve.hopeful_many([8]).tolist() == curve.expected_many([8]).tolist()  # no samples: the prior
    curve.update([0, 1], 16)  # one unlucky wide draft
    for _ in range(20):
        curve.update([0, 1], 2)
    assert curve.expected(16) < 2.0  # pooled with the 2-node budget: flat
    alpha = implied_alpha(curve.expected(2), 2)
    hopeful = curve.hopeful_many([1, 2, 4, 16, 64])
    assert hopeful[:2].tolist() == curve.expected_many([1, 2]).tolist()  # the well-sampled budgets as learnt
    assert hopeful[3] == pytest.approx(geometric_prior(alpha, 16)) and hopeful[3] > 2 * curve.expected(16)
    assert all(b >= a for a, b in zip(hopeful, hopeful[1:])) and all(h <= d for h, d in zip(hopeful, [1, 2, 4, 16, 64]))
    for _ in range(300):  # narrow drafts for long, a wide one every 16th step: the wide budget's memory fills too
        curve.update([0, 1], 16 if _ % 16 == 0 else 2)
    assert curve.counts[4] * 8 < curve.counts[1] and curve.n_eff()[4] == curve.n_eff()[1]
    assert curve.hopeful_many([16]).tolist() == curve.expected_many([16]).tolist()  # read as learnt


def test_a_switched_arm_drafts_and_is_what_the_policy_learns(verifier_model, tok, monkeypatch):
    # end to end: the policy always picks the 2-node arm, probes every other step switch to a wider sibling; outputs
    # stay the verifier's, the wider drafts are verified, and the policy is told which arm drafted
    import metasd.core.batching.probes as probes_module

    monkeypatch.setattr(probes_module, "PROBE_EVERY", 2)
    expected = _plain(verifier_model, tok)
    engine = _engine(verifier_model, tok, _budget_arms(), policy="ucb", feedback="full")
    observed = []
    inner_observe = engine.policy.observe
    monkeypatch.setattr(engine.policy, "select", lambda context=None: 0)  # cascade@2
    monkeypatch.setattr(engine.policy, "observe", lambda arm, rewards, context=None: (observed.append(arm),
                                                                                      inner_observe(arm, rewards,
                                                                                                    context)))
    adaptive = _wide_probes(AdaptiveSpeculation(lambda n: 1.0 + 0.5 * n, max_width=16, price_drafting=True,
                                                unit_seconds=1e-3), nodes=16)
    got, steps = _serve(engine, adaptive)
    assert [r.token_ids for r in got] == expected
    assert max(r.drafted for s in steps for r in s.requests) > 2  # a probe's draft, beyond cascade@2's cap
    assert 0 in observed and {1, 2} & set(observed)
    req = Request(engine, "x", 4)
    assert req.can_switch_arm
    with pytest.raises(RuntimeError, match="selected arm"):
        req.switch_arm(engine.drafters[1])
    for policy, feedback in (("round_robin", "full"), ("ucb", "bandit")):  # learns no counterfactual / one arm
        assert not Request(_engine(verifier_model, tok, _budget_arms(), policy=policy, feedback=feedback), "x",
                           4).can_switch_arm
    own = Request(engine, "x", 4)
    own.draft_budget = 2  # its drafts are cut: they say nothing of a wider arm's
    assert not own.can_switch_arm
    # a policy that weighs a played arm's reward by its probability (Hedge's arms scored only when played) is biased
    # by an arm it did not choose; per_load is what its inner policy is
    assert not make_policy("hedge", 4, seed=0).forced_arms_unbiased and make_policy("ucb", 4).forced_arms_unbiased
    assert not make_policy("per_load", 4, seed=0, inner="hedge").forced_arms_unbiased
    assert make_policy("per_load", 4, seed=0).forced_arms_unbiased
