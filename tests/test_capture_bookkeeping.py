"""The capture side of the graph runners, on the CPU: CUDA graphs replaced by a stand-in that replays the captured
function over the runner's static buffers - and refuses to replay over KV buffers reallocated since its capture, where
a real graph would silently write the old ones. So what only a GPU would otherwise exercise - which shape is captured
when, what is replayed, what is recaptured after the cache grows - runs here through the batch-1 verifier's runner
(graph_runner.py), the drafting loop and its catch-up (draft_loop.py) and the scheduler's batched runner
(batch_runner.py), every output still plain greedy's. Tiny fp32 models (tests/tiny.py)."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from metasd.core.batching.scheduler import Scheduler, SchedulerStep
from metasd.core.engine import Engine
from metasd.core.execution import graph_runner
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer


class FakeGraph:
    """A captured graph on the CPU: ``replay`` runs the captured function again over the same static buffers."""

    def __init__(self, run, cache):
        self.run, self.cache, self.captured_over = run, cache, cache().buffers()

    def replay(self):
        assert self.cache().buffers() == self.captured_over, "a graph replayed over KV buffers reallocated since"
        self.run()


@pytest.fixture
def fake_graphs(monkeypatch):
    """Captures become ``FakeGraph``s; ``watch(cache)``: the function giving the cache whose buffers they read."""
    watched = {}

    def capture(run, device, pool):
        run()  # as capture_graph leaves them: the outputs of this forward
        return FakeGraph(run, watched["cache"]), 0.01, 4096

    monkeypatch.setattr(graph_runner, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    return lambda cache: watched.__setitem__("cache", cache)


class JoinGate:
    """A listener that holds the scheduler thread at the first step ``when(record)`` accepts until the test has queued
    the next request (``joined``): that request joins while the others still run, however slow the machine."""

    def __init__(self, when):
        self.when, self.reached, self.joined = when, threading.Event(), threading.Event()

    def __call__(self, record) -> None:
        if isinstance(record, SchedulerStep) and not self.reached.is_set() and self.when(record):
            self.reached.set()
            self.joined.wait(60)

    def join(self, submit):
        """``submit()`` once the gate is reached (the gate opens whatever happens): its handle."""
        try:
            assert self.reached.wait(60)
            return submit()
        finally:
            self.joined.set()


def test_the_batch_verifiers_shapes_are_captured_once_replayed_and_recaptured_after_the_cache_grows(fake_graphs,
                                                                                                    caplog):
    tok, model = tiny_tokenizer(), tiny_qwen(seed=0, logit_scale=4.0, context=1024)
    tree = lambda: PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0, context=1024), nodes=6, depth=3,  # noqa
                                         width=2, name="tree")
    prompts = [[0, 7, 12, 9], [0, 50, 9], [0] + [(5 * i) % 60 + 1 for i in range(300)]]  # the third: 512 positions
    max_new = [60, 60, 8]
    expected = [Engine(Verifier(model, tok), [tree()], check_tokenizers=False).generate(p, n).token_ids
                for p, n in zip(prompts, max_new)]
    verifier = Verifier(model, tok, fixed_shapes=True)
    verifier.capture = True  # what graphs="on" sets on CUDA
    steps = []
    caplog.set_level(logging.INFO, logger="metasd.core.execution.graph_runner")
    with Scheduler(Engine(verifier, [tree()], check_tokenizers=False), max_batch=3) as s:
        runner = s.verifier.runner
        fake_graphs(lambda: s.verifier.cache)
        s.add_listener(lambda r: steps.append(s.verifier.cache.capacity) if isinstance(r, SchedulerStep) else None)
        gate = JoinGate(lambda r: len(steps) > 2)  # the two short ones run at 256 positions ...
        with s._lock:
            first = [s.submit(p, n) for p, n in zip(prompts[:2], max_new)]
            s.add_listener(gate)
        got = [h.result(timeout=60).token_ids for h in first + [gate.join(lambda: s.submit(prompts[2], max_new[2]))]]
    assert got == expected
    # ... the long one joins at 512 and leaves; the buffers stay (keep_allocation: no recapture for a shrink)
    assert steps[0] == 256 and steps[-1] == 512
    assert runner.stats.eager == 0 and runner.stats.replays > 0
    # the short rows' shapes captured again over the grown buffers (FakeGraph refuses a stale one)
    assert runner.stats.captured > len(runner.shapes), runner.describe()
    logged = [r.getMessage() for r in caplog.records if r.name == "metasd.core.execution.graph_runner"]
    # one line per capture, naming its shape (the first shape depends on whether the second request was queued
    # before the first step: both are right)
    assert len(logged) == runner.stats.captured, logged
    assert all(m.startswith("captured the batched verify forward of ") for m in logged), logged
    assert any("3 rows x 8 tokens over 512 columns" in m for m in logged), logged


def test_the_batch1_verifiers_graphs_drop_when_a_longer_request_grows_its_kept_buffers(fake_graphs):
    model = tiny_qwen(seed=3, context=1024)
    verifier = Verifier(model, fixed_shapes=True)
    verifier.capture = True
    engine = Engine(verifier, [PretrainedDrafter(tiny_qwen(seed=3, layers=1, context=1024), k=3)])
    short, long = [5, 17, 3, 59], [5, 17, 3, 59, 42, 8, 23, 61] * 30
    fake_graphs(lambda: verifier.cache)
    for prompt, n in ((short, 40), (long, 30)):
        assert engine.generate(prompt, n).token_ids == plain_greedy(model, prompt, n)
    stats = verifier.runner.stats
    assert stats.eager == 0 and stats.replays > 0 and stats.captured >= 2


def test_the_drafting_loop_and_its_catch_up_capture_replay_and_recapture(fake_graphs):
    verifier_model, drafter_model = tiny_qwen(seed=3, context=1024), tiny_qwen(seed=3, layers=1, context=1024)
    drafter = PretrainedDrafter(drafter_model, k=4, fixed_shapes=True)
    drafter.loops.capture = True  # what graphs="on" sets on CUDA
    engine = Engine(Verifier(verifier_model), [drafter])
    prompt = [5, 17, 3, 59, 42, 8, 23, 61]
    fake_graphs(lambda: drafter.loops.cache)
    for n in (300, 20):  # past a 256-column width bucket, then a second request on the kept cache
        assert engine.generate(prompt, n).token_ids == plain_greedy(verifier_model, prompt, n)
    described = drafter.loops.describe()
    (loop,) = described["loops"]
    assert loop["eager"] == 0 and loop["replays"] > 0 and loop["captured"] >= 2  # one graph per width bucket
    assert described["catch_up"]["eager"] == 0 and described["catch_up"]["replays"] > 0


def test_the_drafting_levels_over_the_rows_capture_replay_and_recapture_after_the_rows_grow(fake_graphs, caplog):
    verifier_model = tiny_qwen(seed=3, context=1024)
    drafter = PretrainedTreeDrafter(tiny_qwen(seed=3, layers=1, context=1024), nodes=6, depth=3, width=2,
                                    name="tree", fixed_shapes=True)
    drafter.rows.runner.capture = True  # what graphs="auto" sets on CUDA
    prompts = [[5, 17, 3, 59], [42, 8, 23], [7] + [(3 * i) % 60 + 1 for i in range(290)]]  # the third: 512 columns
    max_new = [40, 40, 10]
    fake_graphs(lambda: drafter.rows)
    caplog.set_level(logging.INFO, logger="metasd.core.execution.graph_runner")
    gate = JoinGate(lambda r: r.batch_size == 2)  # the two short ones draft over 256 columns, then the long one joins
    # the verifier at fixed shapes too: its rows (and the drafter's, shaped like them) kept between requests
    with Scheduler(Engine(Verifier(verifier_model, fixed_shapes=True), [drafter]), max_batch=3) as s:
        with s._lock:
            first = [s.submit(p, n) for p, n in zip(prompts[:2], max_new)]
            s.add_listener(gate)
        got = [h.result(timeout=60).token_ids for h in first + [gate.join(lambda: s.submit(prompts[2], max_new[2]))]]
    assert got == [plain_greedy(verifier_model, p, n) for p, n in zip(prompts, max_new)]
    stats = drafter.rows.runner.stats
    assert stats.eager == 0 and stats.replays > 0
    # a shape met again after the rows grew (the long request's 512 positions) was captured again over the new buffers
    assert drafter.rows.capacity >= 512 and stats.captured > len(drafter.rows.runner.shapes), drafter.rows.describe()
    logged = [r.getMessage() for r in caplog.records if r.name == "metasd.core.execution.graph_runner"]
    assert len(logged) == stats.captured and "the drafting level of tree of" in logged[0], logged
    assert not drafter.rows.held


def test_the_whole_tree_loop_over_the_rows_captures_replays_and_recaptures_after_the_rows_grow(fake_graphs):
    verifier_model = tiny_qwen(seed=3, context=1024)
    drafter = StaticTreeDrafter(tiny_qwen(seed=3, layers=1, context=1024), widths=[2, 2, 1], name="static",
                                fixed_shapes=True)
    drafter.rows.runner.capture = True  # what graphs="auto" sets on CUDA (the rows' loops take it from the runner)
    prompts = [[5, 17, 3, 59], [42, 8, 23], [7] + [(3 * i) % 60 + 1 for i in range(290)]]  # the third: 512 columns
    max_new = [40, 40, 10]
    fake_graphs(lambda: drafter.rows)
    gate = JoinGate(lambda r: r.batch_size == 2)  # the two short ones draft over 256 columns, then the long one joins
    # the verifier at fixed shapes too: its rows (and the drafter's, shaped like them) kept between requests
    with Scheduler(Engine(Verifier(verifier_model, fixed_shapes=True), [drafter]), max_batch=3) as s:
        with s._lock:
            first = [s.submit(p, n) for p, n in zip(prompts[:2], max_new)]
            s.add_listener(gate)
        got = [h.result(timeout=60).token_ids for h in first + [gate.join(lambda: s.submit(prompts[2], max_new[2]))]]
    assert got == [plain_greedy(verifier_model, p, n) for p, n in zip(prompts, max_new)]
    (loop,) = drafter.rows.loops.values()
    assert loop.stats.eager == 0 and loop.stats.replays > 0
    # a (rows, width) bucket met again after the rows grew was captured again over the new buffers
    assert drafter.rows.capacity >= 512 and loop.stats.captured > len(loop.shapes), loop.describe()
