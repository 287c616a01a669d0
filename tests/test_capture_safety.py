"""What a CUDA graph captures must touch no host: CUDA refuses a host read of device data, a synchronisation or a
copy from pageable host memory while it captures, and bakes a copy from pinned memory into the graph. No GPU runs
here, so every graph runner's captured function runs on the fake device of ``second_device.py`` inside ``capturing``,
which raises on exactly those ops, naming the op and the line: the batch-1 verifier's forward (graph_runner.py), the
drafting loop and its catch-up (draft_loop.py), the scheduler's batched verify forward (batch_runner.py), a model
drafter's levels over its rows (draft_rows.py) and the whole-tree loop over them (rows_loop.py). A capture here is
two warm-up runs and the captured run, as ``capture_graph`` does on CUDA; a replay runs the function again and must
dispatch exactly the ops, sizes and scalars the capture did, over the same memory wherever it reads a tensor it did
not make (``_Signature``: a real graph replays what it captured, so a Python value that changed since - a length, a
bound, a buffer reallocated at another shape - or an input put in a new tensor instead of the static one is stale).
Every output is still what the request gets alone. Tiny fp32 models (tests/tiny.py)."""
from __future__ import annotations

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from metasd.core.batching.scheduler import Scheduler
from metasd.core.engine import Engine
from metasd.core.execution import batch_cache, draft_rows, graph_runner, static_cache
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter, StaticTreeDrafter
from second_device import CaptureError, capturing, enable
from tiny import plain_greedy, tiny_qwen, tiny_tokenizer

pytestmark = pytest.mark.second_device

DEV: torch.device = None  # set by _enable


@pytest.fixture(autouse=True, scope="module")
def _enable():
    global DEV
    DEV = enable()


class _Signature(TorchDispatchMode):
    """The ops a run dispatches, each with what a CUDA graph bakes in at capture: its non-tensor arguments (sizes,
    slice bounds, scalars), the values of 0-dim CPU tensors read as scalars, every tensor argument's shape, strides
    and dtype, and - for a tensor the run did not make (weights, KV buffers, the runner's static inputs) - which
    memory it is. Two runs of a captured function with different signatures are a graph replaying stale values or
    memory: the second run computed something, or read an input, the graph would not."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()  # the storages this run's ops allocated: its temporaries

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), tuple(self._baked(a) for a in (*args, *kwargs.items()))))
        out = func(*args, **kwargs)
        given = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # new memory is the run's own; an in-place op's output is its argument, whatever it was
        self.made.update(m for t in tree_leaves(out) if isinstance(t, torch.Tensor) and (m := _storage(t)) not in given)
        return out

    def _baked(self, value):
        if isinstance(value, torch.Tensor):
            scalar = value.item() if value.dim() == 0 and value.device.type == "cpu" else None
            memory = "made" if _storage(value) in self.made else _storage(value)
            return "tensor", tuple(value.shape), value.stride(), value.dtype, scalar, memory
        if isinstance(value, (list, tuple)):
            return tuple(self._baked(v) for v in value)
        return repr(value)


def _storage(t: torch.Tensor) -> int:
    """Which memory ``t`` views: its storage's address (a device tensor's CPU data, on the fake device)."""
    return (t.elem if hasattr(t, "elem") else t).untyped_storage().data_ptr()


class _Replay:
    """A captured function's stand-in for a graph: ``replay`` runs it again over the same static buffers and checks
    that it dispatched what the capture did (``_Signature``)."""

    def __init__(self, run, captured: list[tuple]):
        self.run, self.captured, self.replays = run, captured, 0

    def replay(self):
        with _Signature() as now:
            self.run()
        diff = next((i for i, (a, b) in enumerate(zip(self.captured, now.ops)) if a != b), None)
        assert diff is None and len(now.ops) == len(self.captured), (
            f"a replay would differ from its capture at op {diff} of {len(self.captured)}: "
            f"{self.captured[diff] if diff is not None else len(self.captured)} captured, "
            f"{now.ops[diff] if diff is not None else len(now.ops)} now")
        self.replays += 1


@pytest.fixture
def strict_captures(monkeypatch):
    """Captures run their function twice (the warm-ups), then once inside ``capturing``, its ``_Signature`` kept
    for the replays to match; returns the list of the graphs captured."""
    captured = []

    def capture(run, device, pool):
        for _ in range(2):
            run()
        with capturing(), _Signature() as signature:
            run()
        graph = _Replay(run, signature.ops)
        captured.append(graph)
        return graph, 0.0, 0

    monkeypatch.setattr(graph_runner, "capture_graph", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    # every device tensor's data_ptr() is 0 here: the runners' recapture check (``buffer_keys``) reads where the
    # buffers' data really lies instead, as it reads their addresses on CUDA (a reallocation at one shape moves them)
    def keys(tensors):
        return tuple((_storage(t), tuple(t.shape)) for t in tensors)

    for module in (batch_cache, draft_rows, static_cache):
        monkeypatch.setattr(module, "buffer_keys", keys)
    return captured


def test_capturing_refuses_what_cuda_refuses_and_allows_the_rest():
    x = torch.arange(6, device=DEV, dtype=torch.float32)
    index = torch.tensor([1, 3], device=DEV)  # before the capture: a static input buffer
    refused = {"a host read": lambda: x.sum().item(), "a copy to the host": lambda: x.cpu(),
               "a blocking copy to the device": lambda: torch.tensor([1, 2], device=DEV),
               "a non-blocking copy to the device": lambda: torch.ones(2).to(DEV, non_blocking=True),
               "CPU indices": lambda: x[torch.tensor([0, 2])], "a data-dependent shape": lambda: x.nonzero(),
               "a synchronisation": lambda: torch.metasd_dev.synchronize()}
    with capturing():
        for what, op in refused.items():
            with pytest.raises(CaptureError, match="while a CUDA graph is captured, at .*test_capture_safety.py"):
                op()
        y = torch.zeros(6, device=DEV)
        y.copy_(x * torch.tensor(2.0) + 1)  # a device factory, a copy within the device, a 0-dim CPU scalar
        y[index] = 0.0
    assert y.tolist() == [1.0, 0.0, 5.0, 0.0, 9.0, 11.0]  # outside a capture, reads are the host's business


@torch.inference_mode()
def test_the_batch1_verifier_and_the_drafting_loop_capture_nothing_of_the_host(strict_captures):
    verifier_model = tiny_qwen(seed=3, context=1024)
    verifier = Verifier(verifier_model.to(DEV), tiny_tokenizer(), fixed_shapes=True)
    verifier.capture = True  # what graphs="on" sets on CUDA
    drafter = PretrainedDrafter(tiny_qwen(seed=3, layers=1, context=1024).to(DEV), k=4, fixed_shapes=True)
    drafter.loops.capture = True
    engine = Engine(verifier, [drafter])
    prompt = [5, 17, 3, 59, 42, 8, 23, 61]
    assert engine.generate(prompt, 40).token_ids == plain_greedy(verifier_model.cpu(), prompt, 40)
    assert verifier.runner.stats.captured > 0 and verifier.runner.stats.eager == 0
    described = drafter.loops.describe()
    assert described["loops"][0]["captured"] > 0 and described["catch_up"]["captured"] > 0, described
    assert len(strict_captures) == verifier.runner.stats.captured + sum(
        st["captured"] for st in (*described["loops"], described["catch_up"]))  # each inside ``capturing``


@pytest.mark.parametrize("kind", ["chain", "tree", "static_tree"])
def test_the_schedulers_verify_forward_and_drafting_over_rows_capture_nothing_of_the_host(strict_captures, kind):
    from drafting_helpers import MAX_NEW, PROMPTS

    def drafter_model():
        return tiny_qwen(seed=0, logit_scale=2.0).to(DEV)

    drafter = {"chain": lambda: PretrainedDrafter(drafter_model(), k=4, name="chain", fixed_shapes=True),
               "tree": lambda: PretrainedTreeDrafter(drafter_model(), nodes=8, depth=3, width=2, name="tree",
                                                     fixed_shapes=True),
               "static_tree": lambda: StaticTreeDrafter(drafter_model(), widths=[2, 2, 1], name="static",
                                                        fixed_shapes=True)}[kind]()
    drafter.rows.runner.capture = True  # what graphs="auto" sets on CUDA (the rows' loops take it from the runner)
    verifier = Verifier(tiny_qwen(seed=0, logit_scale=4.0).to(DEV), tiny_tokenizer(), fixed_shapes=True)
    engine = Engine(verifier, drafter, check_tokenizers=False)
    alone = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    verifier.capture = True
    with Scheduler(engine, max_batch=4) as s:
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        assert [h.result(timeout=120).token_ids for h in handles] == alone
        runner = s.verifier.runner
    assert runner.stats.captured > 0 and runner.stats.eager == 0, runner.describe()
    rows = drafter.rows
    drafted = [rows.runner.stats, *(loop.stats for loop in rows.loops.values())]
    assert len(strict_captures) == runner.stats.captured + sum(st.captured for st in drafted)  # each in ``capturing``
    assert sum(st.captured for st in drafted) > 0 and sum(st.replays for st in drafted) > 0, rows.describe()
    if kind != "tree":  # a greedy chain and a static tree draft whole loops over the rows; a dynamic tree by levels
        assert rows.loops and all(loop.stats.captured > 0 for loop in rows.loops.values()), rows.describe()


@pytest.mark.parametrize("kind", ["levels", "loop"])
def test_trace_replay_over_rows_captures_nothing_of_the_host(strict_captures, kind):
    """What a GPU session runs without real weights (drafters/trace.py, trace_loop.py): a trace recorded here on the
    CPU, replayed on the device with other models - a dynamic tree's levels over rows, a static tree's whole loop -
    with the verifier's and the drafter's forwards captured."""
    from drafting_helpers import MAX_NEW, PROMPTS, schedule_together
    from metasd.drafters.trace import PromptTrace, Trace, TraceDrafter
    from metasd.drafters.trace_loop import LoopTraceDrafter
    from metasd.drafters.trace_record import record_arm
    from test_trace_loop import WIDTHS, _arm as loop_arm, replay_on_other
    from test_trace_replay import _arm as levels_arm, _noisy

    verifier, drafter = tiny_qwen(seed=0, logit_scale=4.0), _noisy(tiny_qwen(seed=0, logit_scale=4.0), 0.05, seed=1)
    arm = (lambda: levels_arm("tree", drafter)) if kind == "levels" else (lambda: loop_arm("static", drafter))
    trace = Trace([PromptTrace(f"p{i}", len(p), n, {"arm": record_arm(arm(), p, plain_greedy(verifier, p, n + 8), n)})
                   for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))])
    other_verifier, other_drafter = tiny_qwen(seed=5, logit_scale=4.0), tiny_qwen(seed=6)
    prompts, continuations = replay_on_other(trace, other_verifier, PROMPTS, MAX_NEW)
    models = other_verifier.to(DEV), other_drafter.to(DEV)
    replay = TraceDrafter(trace, "arm", [models[1]], vocab=64, fixed_shapes=True) if kind == "levels" else \
        LoopTraceDrafter(trace, "arm", models[1], WIDTHS, vocab=64, fixed_shapes=True)
    (rows,) = replay.rows
    rows.runner.capture = True  # what graphs="auto" sets on CUDA
    verifier_on_device = Verifier(models[0], fixed_shapes=True)
    verifier_on_device.capture = True
    results, _ = schedule_together(Engine(verifier_on_device, replay, check_tokenizers=False), prompts, MAX_NEW,
                                   lambda: 0)
    assert [r.token_ids for r in results] == continuations
    drafted = [rows.runner.stats, *(loop.stats for loop in rows.loops.values())]
    assert sum(st.captured for st in drafted) > 0 and sum(st.eager for st in drafted) == 0, rows.describe()
    assert kind == "levels" or rows.loops, rows.describe()
    assert strict_captures and not rows.held
