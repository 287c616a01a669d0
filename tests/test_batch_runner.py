"""The scheduler's batched verify forward at fixed (rows, tokens, width) shapes (metasd/core/execution/batch_runner.py):
the shapes CUDA graphs replay on a GPU, run eagerly on the same buffers here. Every request gets what it gets alone,
whatever pads its forward - padding rows beside a joining request's staged prefill, widths past a bucket - and the
padding's keys go to the cache's scratch row, counted in the KV budget. Greedy identity of every drafter type through
these shapes: tests/test_scheduler_drafters.py ("fixed shapes"). Tiny fp32 models (tests/tiny.py)."""
import threading

import pytest
import torch

from metasd.core.batching.adaptive import AdaptiveSpeculation
from metasd.core.batching.scheduler import Scheduler, SchedulerStep
from metasd.core.engine import Engine
from metasd.core.execution.batch_cache import BatchCache
from metasd.core.execution.batch_runner import BatchGraphRunner, row_bucket
from metasd.core.execution.graph_runner import token_bucket
from metasd.core.execution.kv_memory import KVGeometry
from metasd.core.execution.verifier import Verifier
from metasd.core.pricing.padding import bucket_grid, padded_tokens
from metasd.drafters import PretrainedTreeDrafter, StaticTreeDrafter, SuffixDrafter
from tiny import tiny_qwen, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0, context=1024)


def _engine(model, tok, fixed: bool):
    tree = PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0, context=1024), nodes=6, depth=3, width=2,
                                 name="tree")
    return Engine(Verifier(model, tok, fixed_shapes=fixed), [tree], check_tokenizers=False)


def test_row_buckets_are_powers_of_two_within_the_rows_allocated():
    assert [row_bucket(b, 8) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert row_bucket(3, 3) == 3 and row_bucket(5, 6) == 6  # never past the rows the cache holds
    assert row_bucket(70, 80) == 70  # past the largest bucket: as it is


def test_padding_rows_beside_a_staged_prefill_leave_it_as_it_was(model, tok):
    # three requests run while a fourth prefills its long prompt in chunks into row 3 - the row a forward of three
    # rows pads to four with. Written there, the padding would overwrite the prompt's first keys
    prompts = [[0, 7, 12, 9, 33], [0, 50, 9], [0, 21, 22, 23, 24, 25], [0] + [(7 * i) % 60 + 1 for i in range(90)]]
    max_new = [60, 60, 60, 12]
    expected = [_engine(model, tok, False).generate(p, n).token_ids for p, n in zip(prompts, max_new)]
    rows, three = [], threading.Event()

    def listen(r):
        if isinstance(r, SchedulerStep):
            rows.append(r.batch_size)
            three.set() if r.batch_size == 3 else None
    with Scheduler(_engine(model, tok, True), max_batch=4, prefill_chunk=8) as s:
        s.add_listener(listen)
        with s._lock:  # queued together: however loaded the machine, the three run together first
            handles = [s.submit(p, n) for p, n in zip(prompts[:3], max_new)]
        assert three.wait(60)  # the three run first
        handles.append(s.submit(prompts[3], max_new[3]))
        got = [h.result(timeout=120).token_ids for h in handles]
        shapes = s.verifier.runner.shapes
    assert got == expected
    assert 3 in rows and any(r == 4 for r, _, _ in shapes), (rows, sorted(shapes))


def test_a_forward_past_a_width_bucket_attends_its_whole_prefix(model, tok):
    # a 300-token prompt: its forwards attend over 512 columns, the short request's beside it over the same shape
    prompts = [[0] + [(5 * i) % 60 + 1 for i in range(300)], [0, 21, 22, 23]]
    max_new = [20, 20]
    expected = [_engine(model, tok, False).generate(p, n).token_ids for p, n in zip(prompts, max_new)]
    with Scheduler(_engine(model, tok, True), max_batch=2) as s:
        got = [h.result(timeout=120).token_ids for h in [s.submit(p, n) for p, n in zip(prompts, max_new)]]
        shapes = sorted(s.verifier.runner.shapes)
    assert got == expected
    assert {w for _, _, w in shapes} >= {512} and all(w % 256 == 0 for _, _, w in shapes), shapes
    assert all(t in (1, 2, 4, 8, 16) for _, t, _ in shapes), shapes  # token counts padded to their buckets


def _fixed_cache(model, budget_positions: int):
    """A batched cache of 4 rows under a budget of ``budget_positions`` verifier positions, taken by a fixed-shape
    runner (its scratch row, its kept buffers)."""
    g = KVGeometry.of(model)
    cache = BatchCache(g, 4, budget_bytes=budget_positions * g.bytes_per_token)
    BatchGraphRunner(model, cache, capture=False)
    return g, cache


@torch.inference_mode()
def test_the_scratch_row_is_held_and_counted_in_the_budget(model):
    _, cache = _fixed_cache(model, 1024)
    cache.reserve("a", 256)
    cache.reserve("b", 256)
    cache.reserve("c", 256)
    assert not cache.fits(256)  # four rows of 256 would fill the budget; the scratch row takes the fourth
    held = sum(buf.numel() * buf.element_size() for layer in cache.layers for buf in (layer.keys, layer.values))
    assert cache.layers[0].keys.shape[0] == cache.rows + 1 and held == cache.held_bytes <= cache.budget_bytes
    with pytest.raises(ValueError, match="scratch row"):
        BatchGraphRunner(model, cache, capture=False)  # too late: the rows are allocated


# ------------------------------------------------------------------------------- a step priced at the shape it runs
def _padding(rows, per_row):  # what BatchVerifier.padded gives with 8 rows allocated
    return row_bucket(rows, 8), token_bucket(per_row)


def test_a_forward_is_priced_at_the_bucket_it_pads_to():
    assert padded_tokens(_padding, 3, 3 * 5) == 4 * 8 and padded_tokens(None, 3, 15) == 15
    assert bucket_grid(_padding, 48) == (1, 3, 7, 15, 31, 48)  # 1 + w fills a token bucket
    adaptive = AdaptiveSpeculation.checked(AdaptiveSpeculation(lambda n: 1.0 + 0.1 * n, max_width=48), _padding)
    price = adaptive.forward_cost(3)
    assert price(3 * 5) == price(3 * 8) < price(3 * 9)  # widths 4..7 fill the same (4 rows, 8 tokens) shape
    assert adaptive.curve(SuffixDrafter()).grid.tolist() == [1, 3, 7, 15, 31, 48]  # the curves learn those widths
    given = AdaptiveSpeculation.checked(AdaptiveSpeculation(lambda n: 1.0, grid=(2, 4)), _padding)
    assert given.grid == (2, 4)  # a grid the caller chose stays


def test_the_scheduler_prices_and_records_the_padded_forward(model, tok):
    steps = []
    adaptive = AdaptiveSpeculation(lambda n: 1.0 + 0.02 * n, max_width=12)
    with Scheduler(_engine(model, tok, True), max_batch=4, adaptive=adaptive) as s:
        s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)
        with s._lock:  # all three queued before the first step: the step of 3 rows is sure to come
            handles = [s.submit(p, 16) for p in ([0, 7, 12, 9], [0, 50, 9], [0, 21, 22, 23, 24])]
        for h in handles:
            h.result(timeout=120)
        runner = s.verifier.runner
    assert adaptive.padding is not None and adaptive.grid == (1, 3, 7, 12)
    rows, tokens = zip(*(shape[:2] for shape in runner.shapes))
    assert {r.forward_tokens for r in steps} <= {r * t for r, t in zip(rows, tokens)}
    assert any(r.batch_size == 3 and r.forward_tokens % 4 == 0 for r in steps)  # 3 rows run (and cost) as 4


def test_the_servers_metrics_report_the_verify_shapes(model, tok):
    from metasd.serve.metrics import ServeMetrics

    metrics = ServeMetrics("m")
    with Scheduler(_engine(model, tok, True), max_batch=2) as s:
        metrics.attach(s)
        s.submit([0, 7, 12], 8).result(timeout=60)
        shapes = len(s.verifier.runner.shapes)
        text = metrics.render().decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("metasd:verify")}
    assert values == {"metasd:verify_fixed_shapes": shapes, "metasd:verify_graphs_captured": 0.0,
                      "metasd:verify_graph_capture_seconds": 0.0, "metasd:verify_graph_capture_bytes": 0.0}
    assert shapes > 0  # run eagerly on the CPU: shapes met, nothing captured


def test_a_forward_wider_than_the_fixed_shapes_hold_runs_at_its_own_shape(model, tok):
    # the third runs alone once the other two are done: its forwards of one row fit the fixed shapes
    prompts, max_new = [[0, 7, 12, 9], [0, 50, 9], [0, 21, 22, 23, 24]], [16, 16, 40]
    expected = [_engine(model, tok, False).generate(p, n).token_ids for p, n in zip(prompts, max_new)]
    steps = []
    with Scheduler(_engine(model, tok, True), max_batch=4) as s:
        runner = s.verifier.runner
        runner.max_tokens = 8  # a tree of 6 nodes beside two others pads to 4 x 8 = 32: run eagerly, unpadded
        s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)
        with s._lock:  # all three queued before the first step: steps of three rows are sure to come
            handles = [s.submit(p, n) for p, n in zip(prompts, max_new)]
        got = [h.result(timeout=120).token_ids for h in handles]
    assert got == expected
    assert all(r * t <= 8 for r, t, _ in runner.shapes) and runner.stats.eager < s.verifier.forwards
    assert any(r.forward_tokens > 8 for r in steps)  # the wide ones recorded at their own shape


def test_graphs_fixed_in_a_pool_runs_the_fixed_shapes_on_any_device(tmp_path, model, tok):
    from metasd.config.schema import VerifierConfig

    assert Verifier(model, tok, graphs="fixed").fixed_shapes and not Verifier(model, tok, graphs="fixed").capture
    assert not Verifier(model, tok, graphs="auto").fixed_shapes  # on a CPU: exact shapes
    assert VerifierConfig(model="m", graphs="fixed").graphs == "fixed"
    with pytest.raises(ValueError, match="graphs: 'fixed' is a torch setting"):
        VerifierConfig(model="m.gguf", backend="llama.cpp", graphs="fixed")
    engine = Engine(Verifier(model, tok, graphs="fixed"), None, check_tokenizers=False)
    with Scheduler(engine, max_batch=2) as s:
        assert s.submit([0, 7, 12], 6).result(timeout=60).token_ids and s.verifier.runner.stats.eager > 0
    assert StaticTreeDrafter(tiny_qwen(seed=0), widths=[2, 1], graphs="fixed").loops is not None  # its loop too


@torch.inference_mode()
def test_with_fixed_shapes_the_buffers_stay_within_the_budget_and_grow_by_doubling(model):
    # a captured graph reads the KV buffers by address, so every reallocation recaptures the shapes: the runner's cache
    # keeps its buffers between steps while they fit and doubles their positions when a longer request comes
    g, cache = _fixed_cache(model, 4096)
    cache.reserve("a", 200)
    cache.reserve("b", 300)  # 512 > 256: doubled to 512 (the reservation itself)
    assert cache.capacity == 512
    cache.reserve("c", 600)  # 768 > 512: doubled to 1024
    assert (cache.rows, cache.capacity) == (3, 1024) and cache.held_bytes <= cache.budget_bytes
    cache.release("c")
    cache.release("b")
    assert not cache.shrink() and (cache.rows, cache.capacity) == (3, 1024)  # kept: no recapture for a shrink
    cache.pinned_bytes = cache.budget_bytes - 1000 * g.bytes_per_token  # stored prefixes need the room back
    assert cache.shrink() and cache.held_bytes <= cache.budget_bytes
    plain = BatchCache(g, 4, budget_bytes=4096 * g.bytes_per_token)  # without a runner: exact growth, shrinks at once
    plain.reserve("a", 200)
    plain.reserve("c", 600)
    plain.release("c")
    assert plain.capacity == 768 and plain.shrink() and plain.capacity == 256
