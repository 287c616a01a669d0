"""Batched drafting (docs/architecture.md#batched-drafting): the scheduler advances the drafting loops of all its running
requests together, so every level of their chains and trees is ONE drafter forward for the whole batch - and each
request still decodes exactly what ``Engine.generate`` gives it alone (greedy identity; the sampling check through the
batched path at depth 2). Tiny fp32 models (tests/tiny.py)."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution.draft_batch import LONG_FEED, Feed, Steer, feed_groups, run_feed, run_group
from metasd.core.execution.static_cache import new_cache
from metasd.core.execution.verifier import Verifier
from metasd.drafters import (FusedDrafter, PretrainedDrafter, PretrainedTreeDrafter, SteeredDrafter, SteeredTreeDrafter,
                             SuffixDrafter)
from metasd.drafters.budgeted import budget_arms
from metasd.drafters.steering_net import Injector, SteeringModule
from metasd.policies import make_policy
from drafting_helpers import MAX_NEW, PROMPTS, sampled_side_by_side, schedule_together
from tiny import tiny_qwen, tiny_tokenizer



@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _steering(model, seed=0):
    """A steering module for ``model`` under the tiny 2-layer verifier with random (non-zero) biases: steered drafts
    differ from plain ones."""
    module = SteeringModule.for_models(model, 32, guide_layers=[0, 1, 2], seed=seed)
    with torch.no_grad():
        module.proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return module


def _pool(kind: str, model):
    """(drafters, rounds): the most drafter forwards one step of a request makes - its catch-up, then a level each."""
    if kind == "steered":
        return [SteeredDrafter(model, steering=_steering(model), k=4, name="steered")], 4
    if kind == "steered_tree":
        return [SteeredTreeDrafter(model, steering=_steering(model), mode="dynamic", nodes=8, depth=3, width=2,
                                   name="steered_tree")], 3
    if kind == "chain":
        return [PretrainedDrafter(model, k=4, name="chain")], 4
    if kind == "tree":
        return [PretrainedTreeDrafter(model, mode="dynamic", nodes=8, depth=3, width=2, name="tree")], 3
    if kind == "rsd_c":
        return [PretrainedTreeDrafter(model, mode="rsd_c", nodes=8, depth=3, branching=[2], name="tree")], 3
    cascade = FusedDrafter([SuffixDrafter(max_depth=8, max_nodes=8, name="suffix"),
                            PretrainedTreeDrafter(model, mode="dynamic", nodes=8, depth=3, width=2, name="tree")],
                           enough=4, name="cascade")
    return [*budget_arms(cascade, (4, 8))], 3


@pytest.mark.parametrize("kind", ["chain", "tree", "rsd_c", "cascade", "steered", "steered_tree"])
def test_concurrent_requests_draft_one_forward_per_level_and_decode_as_alone(tok, kind):
    drafter_model = tiny_qwen(seed=0, logit_scale=1.5)
    drafters, rounds = _pool(kind, drafter_model)
    policy = make_policy("ucb", len(drafters), seed=0) if len(drafters) > 1 else None
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tok), drafters, policy, check_tokenizers=False)
    expected = [engine.generate(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
    rows = []  # every drafter forward's rows
    drafter_model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                            with_kwargs=True)
    results, steps = schedule_together(engine, PROMPTS, MAX_NEW, lambda: len(rows))
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    if kind.startswith("steered"):  # each row took its own guide's bias: the drafts are the ones made alone
        assert [r.stats.tokens_per_step for r in results] == [e.stats.tokens_per_step for e in expected]
    full = [f for b, f in steps if b == 4]
    assert full, "no step ran all four requests"
    # one drafter forward per level for the whole batch: a step of four requests costs what one request's step does
    assert max(full) <= rounds and max(rows) == 4, (kind, steps)
    assert sum(r.stats.drafted for r in results) > 0


@torch.inference_mode()
def test_a_batched_forward_gives_each_row_its_own_forwards_logits_and_cache():
    # rows of different cached lengths and feeds of different lengths and masks (a chain's catch-up, a tree level)
    model = tiny_qwen(seed=3)
    prefixes = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 5]]
    feeds_of = [lambda c: Feed(model, None, c, [11, 12, 13], last_only=True),
                lambda c: Feed(model, None, c, torch.tensor([20])),
                lambda c: Feed(model, None, c, [30, 31, 32, 33],
                               mask=torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0],
                                                  [1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]], dtype=torch.bool),
                               positions=torch.tensor([3, 3, 4, 4]))]
    alone, together = [], []
    for prefix in prefixes:
        a, b = new_cache(model), new_cache(model)
        model(input_ids=torch.tensor([prefix]), past_key_values=a, use_cache=True)
        model(input_ids=torch.tensor([prefix]), past_key_values=b, use_cache=True)
        alone.append(a)
        together.append(b)
    want = [run_feed(make(c)) for make, c in zip(feeds_of, alone)]
    feeds = [make(c) for make, c in zip(feeds_of, together)]
    assert feed_groups(feeds) == [[0, 1, 2]]
    got = run_group(feeds)
    for w, g, a, b in zip(want, got, alone, together):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        assert b.get_seq_length() == a.get_seq_length()
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_steered_feeds_in_one_forward_each_take_their_own_bias():
    # three requests of one steered drafter (one injector on the model), each with its step's own bias, one with its
    # first two positions unsteered (a prompt's end), feeds of different lengths: the forward together gives each
    # row the logits and cache of its forward alone; a plain feed of the same model is grouped apart
    model = tiny_qwen(seed=3)
    module = _steering(model, seed=1)
    injector = Injector(model, module.spec)
    deltas = [module(torch.randn(96, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    assert not torch.equal(deltas[0], deltas[1])
    steers = [Steer(injector, deltas[0]), Steer(injector, deltas[1], torch.tensor([[False], [False], [True]])),
              Steer(injector, deltas[2])]
    feeds_of = [lambda c, s: Feed(model, None, c, [11, 12, 13], last_only=True, steer=s),
                lambda c, s: Feed(model, None, c, [20, 21, 22], steer=s),
                lambda c, s: Feed(model, None, c, [30], steer=s)]
    prefixes = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 5]]
    alone, together = [], []
    for prefix in prefixes:
        pair = [new_cache(model), new_cache(model)]
        for c in pair:
            model(input_ids=torch.tensor([prefix]), past_key_values=c, use_cache=True)
        alone.append(pair[0])
        together.append(pair[1])
    want = [run_feed(make(c, s)) for make, c, s in zip(feeds_of, alone, steers)]
    feeds = [make(c, s) for make, c, s in zip(feeds_of, together, steers)]
    plain = Feed(model, None, new_cache(model), [5])
    assert feed_groups([*feeds, plain]) == [[0, 1, 2], [3]]
    got = run_group(feeds)
    for w, g, a, b in zip(want, got, alone, together):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
    assert injector.delta is None  # the hooks are off again after the forward
    assert (want[0] - run_feed(feeds_of[0](new_cache(model), None))).abs().max() > 1e-3  # the biases matter
    injector.remove()


def test_feeds_that_must_run_alone_are_not_grouped():
    model, other = tiny_qwen(seed=0), tiny_qwen(seed=1)
    c = [new_cache(model) for _ in range(5)]
    feeds = [Feed(model, None, c[0], [1]), Feed(model, None, c[1], [2]), Feed(other, None, c[2], [3]),
             Feed(model, None, c[3], list(range(LONG_FEED + 1))),  # a new request's prompt: alone
             Feed(model, None, c[4], [5], around=lambda: torch.no_grad())]  # a steered forward: alone
    assert sorted(feed_groups(feeds)) == [[0, 1], [2], [3], [4]]


def test_a_loop_whose_forward_fails_is_closed_at_once_leaving_no_inference_mode_behind():
    """``drive``: a drafting loop enters inference mode (as every model drafter's does) and its forward fails - the
    error reaches the caller, the loop is closed there, and the caller's thread is out of inference mode again
    (before: in it until the loop was collected, so a caller's training after a failed generate raised)."""
    from metasd.core.execution.draft_batch import drive
    from metasd.core.execution.host_read import HostRead

    class Failing(HostRead):
        def run(self):
            raise RuntimeError("the forward failed")

    def loop():
        with torch.inference_mode():
            assert (yield HostRead(torch.tensor([3]))) == [3]
            yield Failing(torch.zeros(1))

    held = loop()  # the caller still holds the loop (as a traceback does)
    with pytest.raises(RuntimeError, match="the forward failed"):
        drive(held)
    assert not torch.is_inference_mode_enabled()
    seen = []
    assert drive((lambda: (yield HostRead(torch.tensor([1, 2]))))(), seen.append) == [1, 2]
    assert [type(f).__name__ for f in seen] == ["HostRead"]  # ``watch`` sees each feed


def test_sampling_through_batched_tree_drafting_follows_the_verifier_at_depth_two(tok):
    # an RSD-C tree (rejection sampling with the drafter's q): requests sampled side by side, their drafter forwards
    # shared; the three-token continuations follow the verifier's distribution
    sharp = 20.0
    verifier = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp)
    drafter_model = tiny_qwen(seed=5, vocab=8, layers=1, logit_scale=sharp / 2)
    engine = Engine(Verifier(verifier), PretrainedTreeDrafter(drafter_model, mode="rsd_c", nodes=6, depth=2,
                                                              branching=[2]), seeded_sampling="stream")
    widths = []

    def width(module, args, kwargs):
        widths.append(kwargs["input_ids"].shape[0])
    drafter_model.register_forward_pre_hook(width, with_kwargs=True)

    check = sampled_side_by_side(engine)
    assert check.pvalue > 1e-4, check
    drafted, accepted = check.position_drafted[1], check.position_accepted[1]  # steps whose draft reached depth 2
    assert drafted > 200 and 0 < accepted < drafted, check
    assert max(widths) > 1  # the drafts were made in shared forwards


def test_a_propose_replaced_over_the_drafting_loop_is_what_the_scheduler_runs(tok):
    # a subclass (or an instance) that overrides propose keeps working: its propose runs, at once (not batched)
    calls = []

    class Counting(PretrainedDrafter):
        def propose(self, ctx):
            calls.append(ctx.step)
            return super().propose(ctx)

    plain = PretrainedDrafter(tiny_qwen(seed=0, logit_scale=1.5), k=3)
    wrapped = PretrainedDrafter(tiny_qwen(seed=0, logit_scale=1.5), k=3)
    wrapped.propose = lambda ctx, real=wrapped.propose: calls.append(-1) or real(ctx)
    for drafter in (Counting(tiny_qwen(seed=0, logit_scale=1.5), k=3), wrapped, plain):
        calls.clear()
        engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tok), drafter, check_tokenizers=False)
        expected = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]
        calls.clear()
        with Scheduler(engine, max_batch=2) as s:
            got = [h.result(timeout=60).token_ids for h in [s.submit(p, n) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])]]
        assert got == expected
        assert (len(calls) > 0) == (drafter is not plain)  # the loop itself calls no propose


def test_batch_drafting_off_runs_every_forward_alone_with_the_same_output(tok):
    drafter_model = tiny_qwen(seed=0, logit_scale=1.5)
    engine = Engine(Verifier(tiny_qwen(seed=0, logit_scale=2.0), tok), PretrainedDrafter(drafter_model, k=4),
                    check_tokenizers=False)
    rows = []

    def width(module, args, kwargs):
        rows.append(kwargs["input_ids"].shape[0])
    drafter_model.register_forward_pre_hook(width, with_kwargs=True)
    got = {}
    for batched in (True, False):
        rows.clear()
        with Scheduler(engine, max_batch=4, batch_drafting=batched) as s:
            with s._lock:
                handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
            got[batched] = [h.result(timeout=60).token_ids for h in handles]
        assert (max(rows) > 1) == batched
    assert got[True] == got[False]
