"""KV memory under a budget (docs/architecture.md#the-kv-memory-model): a request reserves its rows when it is admitted
- all or nothing -, waits while the budget is full, is refused at once when it could never fit, and returns what it
held when it leaves; nothing is allocated inside a forward, so a failed allocation fails only the request that asked,
and the others go on with exactly their own text. Also the rest of what keeps one request from reaching the others:
fair prefill, three failed steps in a row marking the scheduler unhealthy, models the batch would get wrong refused.
Tiny fp32 models (tests/tiny.py)."""
import threading

import pytest
import torch

from metasd.core.batching.scheduler import RequestFinished, Scheduler, SchedulerStep
from metasd.core.engine import Engine
from metasd.core.execution.batch_cache import BatchCache
from metasd.core.execution.kv_cache import cache_kwargs
from metasd.core.execution.kv_memory import KVAllocationError, KVBudgetError, KVGeometry
from metasd.core.execution.static_cache import StaticLayer, new_cache
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedDrafter
from tiny import tiny_qwen, tiny_tokenizer

PROMPTS = [[0, 7, 12, 9, 33, 12, 9, 41, 5], [0, 50, 9], [0, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40]]
MAX_NEW = [20, 14, 25]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _engine(tok, drafters=True):
    drafter = [PretrainedDrafter(tiny_qwen(seed=0, logit_scale=2.0, context=1024), k=4, name="chain")] if drafters \
        else []
    return Engine(Verifier(tiny_qwen(seed=0, logit_scale=4.0, context=1024), tok), drafter, check_tokenizers=False)


def _alone(engine):
    return [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]


def test_the_geometry_prices_a_position_in_every_layer():
    g = KVGeometry.of(tiny_qwen())  # 2 layers, 2 kv heads of 8 dims, fp32
    assert (g.layers, g.kv_heads, g.head_dim, g.dtype) == (2, 2, 8, torch.float32)
    assert g.bytes_per_token == 2 * 2 * 2 * 8 * 4


def test_a_request_that_could_never_fit_is_refused_at_submit_naming_the_field(tok):
    engine = _engine(tok)
    expected = engine.generate(PROMPTS[0], 20).token_ids
    with Scheduler(engine, kv_budget=512, max_draft_nodes=16) as s:  # one reservation of 256 with its drafter
        with pytest.raises(KVBudgetError, match=r"^max_new_tokens: .*KV budget") as e:
            s.submit(PROMPTS[0], 240)  # 9 + 240 + 16 + 1 positions: a reservation of 512
        assert isinstance(e.value, ValueError)
        assert s.submit(PROMPTS[0], 20).result(timeout=60).token_ids == expected


def test_requests_wait_for_the_budget_and_each_gets_its_own_text(tok):
    engine = _engine(tok)
    expected = _alone(engine)
    batches, held = [], []
    with Scheduler(engine, max_batch=3, kv_budget=512, max_draft_nodes=16) as s:
        cache = s.verifier.cache
        s.add_listener(lambda r: (batches.append(r.batch_size), held.append(cache.held_bytes))
                       if isinstance(r, SchedulerStep) else None)
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        got = [h.result(timeout=60).token_ids for h in handles]
    assert got == expected
    assert max(batches) == 1  # the budget holds one request at a time: the others waited in the queue
    assert max(held) <= cache.budget_bytes
    assert cache.held_bytes == 0 and not cache.reserved and cache.rows == 0  # all of it returned


def test_a_failed_allocation_fails_only_the_request_that_asked(tok, monkeypatch):
    engine = _engine(tok)
    expected = _alone(engine)
    gate = threading.Event()
    with Scheduler(engine, max_batch=3, max_draft_nodes=16) as s:
        cache = s.verifier.cache
        calls = {"n": 0}
        real = BatchCache._allocate

        def failing(self, shape):  # the third request's admission: its second layer cannot be allocated
            calls["n"] += 1
            if gate.is_set() and calls["n"] % 4 == 3:
                raise torch.OutOfMemoryError("injected: out of memory")
            return real(self, shape)
        monkeypatch.setattr(BatchCache, "_allocate", failing)
        first = s.submit(PROMPTS[0], MAX_NEW[0])
        second = s.submit(PROMPTS[1], MAX_NEW[1])
        assert first.result(timeout=60).token_ids == expected[0]
        before = (cache.rows, cache.capacity, dict(cache.reserved))
        gate.set()
        long = s.submit(PROMPTS[2] * 20, 30)  # needs more positions per row: the buffers must grow, and cannot
        with pytest.raises(KVAllocationError):
            long.result(timeout=60)
        assert (cache.rows, cache.capacity) == before[:2] or not cache.reserved
        assert second.result(timeout=60).token_ids == expected[1]
        gate.clear()
        after = s.submit(PROMPTS[2], MAX_NEW[2])
        assert after.result(timeout=60).token_ids == expected[2]
        assert s.health() == (True, "ok") and s.failed_steps == 0
    assert cache.held_bytes == 0


def test_any_error_in_admission_or_tidying_fails_only_its_request_and_the_scheduler_goes_on(tok, monkeypatch):
    # not only allocation failures: whatever raises while a request is admitted fails that request; a failed shrink
    # or prefix-cache fit after a pass is logged and costs nothing but stored prefixes (both once stopped the thread:
    # every later request got an error and /health said so for good)
    engine = _engine(tok)
    expected = _alone(engine)
    with Scheduler(engine, max_batch=3, max_draft_nodes=16, prefix_caching=True) as s:
        cache = s.verifier.cache
        reserve, shrink, fit = BatchCache.reserve, BatchCache.shrink, s.prefix_cache.fit
        faults = {"shrink": 1, "fit": 1}

        def reserving(self, owner, tokens):
            if owner.request.prompt_ids == PROMPTS[1]:
                raise RuntimeError("injected: admission broke")
            return reserve(self, owner, tokens)

        def once(name, real):
            def fn(*a, **k):
                if faults[name]:
                    faults[name] -= 1
                    raise RuntimeError(f"injected: {name} broke")
                return real(*a, **k)
            return fn
        monkeypatch.setattr(BatchCache, "reserve", reserving)
        monkeypatch.setattr(BatchCache, "shrink", once("shrink", shrink))
        s.prefix_cache.fit = once("fit", fit)
        handles = [s.submit(p, n) for p, n in zip(PROMPTS, MAX_NEW)]
        with pytest.raises(RuntimeError, match="admission broke"):
            handles[1].result(timeout=60)
        assert handles[0].result(timeout=60).token_ids == expected[0]
        assert handles[2].result(timeout=60).token_ids == expected[2]
        assert faults == {"shrink": 0, "fit": 0}, "the injected faults did not fire"
        monkeypatch.setattr(BatchCache, "reserve", reserve)
        assert s.submit(PROMPTS[1], MAX_NEW[1]).result(timeout=60).token_ids == expected[1]
        assert s.failure is None and s.health() == (True, "ok")
    assert cache.held_bytes == cache.pinned_bytes and not cache.reserved  # only the stored prefixes are held


def test_nothing_is_allocated_inside_a_forward_and_the_buffers_shrink_when_the_longest_leaves(tok, monkeypatch):
    engine = _engine(tok)
    in_forward, inside, sizes = [False], [], []
    model = engine.verifier.model
    model.register_forward_pre_hook(lambda m, a: in_forward.__setitem__(0, True))
    model.register_forward_hook(lambda m, a, o: in_forward.__setitem__(0, False))
    real = BatchCache._allocate

    def counting(self, shape):
        inside.append(in_forward[0])
        return real(self, shape)
    monkeypatch.setattr(BatchCache, "_allocate", counting)
    with Scheduler(engine, max_batch=3, max_draft_nodes=16) as s:
        cache = s.verifier.cache
        s.add_listener(lambda r: sizes.append((cache.rows, cache.capacity)) if isinstance(r, RequestFinished) else None)
        with s._lock:  # both queued before the first step: they run side by side
            long = s.submit(PROMPTS[2] * 30, 8)  # 330 prompt tokens: a reservation of 512
            short = s.submit(PROMPTS[1], 40)  # 256
        assert long.result(timeout=60) and short.result(timeout=60)
    assert inside and not any(inside)
    assert sizes[0] == (2, 512) or sizes[0][1] == 256  # the long one left first: rows shrink to the short one's 256
    assert (cache.rows, cache.capacity) == (0, 0)


def _feed(model, cache, ids):
    model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True)


@torch.inference_mode()
def test_a_reservation_beside_unshrunk_buffers_stays_within_the_budget():
    # the soak test once saw 539,136 of 524,288 bytes held: a long request had left (its positions not shrunk yet -
    # shrinking waits for the end of the scheduler's pass), another took its row, and one more was added at the old
    # width - ``fits`` counts the reservations alone. The reallocation now frees what no reservation needs
    g = KVGeometry.of(tiny_qwen(seed=0, context=1024))
    per_token = g.bytes_per_token
    cache = BatchCache(g, 4, budget_bytes=1536 * per_token)
    cache.reserve("long", 768)
    cache.reserve("short", 128)
    cache.release("long")  # it left; no shrink between: 2 rows x 768 positions stay allocated
    cache.reserve("a", 128)  # into the row it left
    assert (cache.rows, cache.capacity) == (2, 768) and cache.fits(128)
    cache.reserve("b", 128)  # one row more
    assert cache.held_bytes <= cache.budget_bytes, (cache.rows, cache.capacity, cache.held_bytes // per_token)
    assert cache.rows == 3 and cache.capacity == 256  # the long request's positions freed in the same reallocation


def test_a_prefill_writes_into_its_reserved_row_through_reallocations_and_joins_out_of_order():
    # a joining prefill once filled a batch-1 cache of its own (memory outside the KV budget, then copied into a row):
    # now it writes into a row its reservation allocated, which must keep its content when the buffers are
    # reallocated under it and when another request's staged row is swapped with it at a join
    model = tiny_qwen(seed=0, context=1024)
    a_ids, b_ids = list(range(3, 23)), list(range(40, 47))
    reference = {}
    for name, ids in (("a", a_ids), ("b", b_ids)):
        ref = new_cache(model)
        _feed(model, ref, ids)
        reference[name] = [(layer.keys.clone(), layer.values.clone()) for layer in ref.layers]
    cache = BatchCache(KVGeometry.of(model), 4)
    cache.reserve("a", 64)
    cache.reserve("b", 64)
    ra, rb = cache.stage(), cache.stage()
    assert (ra.row, rb.row) == (0, 1)
    _feed(model, ra, a_ids[:8])
    _feed(model, rb, b_ids)
    cache.reserve("c", 600)  # wider rows: every buffer is reallocated while both prefills are under way
    assert cache.capacity >= 600
    assert cache.join_staged(rb) == 0  # b finished first: it takes row 0, a's staged row moves to row 1
    assert ra.row == 1 and cache.staged == {1: ra}
    _feed(model, ra, a_ids[8:])  # a's prefill goes on in its new row
    assert cache.join_staged(ra) == 1 and not cache.staged and cache.active == 2
    for row, name in ((0, "b"), (1, "a")):
        assert cache.lengths[row] == len(reference[name][0][0][0, 0])
        for layer, (keys, values) in enumerate(reference[name]):
            torch.testing.assert_close(cache.row_keys(layer, row), keys[0])
            torch.testing.assert_close(cache.row_values(layer, row), values[0])
    staged = cache.stage()
    cache.unstage(staged)  # its request left during its prefill: the row is free again
    assert not cache.staged and cache.stage().row == staged.row


def test_prefills_allocate_nothing_outside_the_batched_cache(tok, monkeypatch):
    engine = _engine(tok, drafters=False)  # no drafter caches: every single-sequence cache would be a prefill's
    expected = _alone(engine) + [engine.generate(PROMPTS[2] * 12, 10).token_ids]

    def refused(*args, **kwargs):
        raise AssertionError("a prefill allocated a cache of its own")
    monkeypatch.setattr(StaticLayer, "allocate", refused)
    with Scheduler(engine, max_batch=4, prefill_chunk=5, max_draft_nodes=16) as s:  # prefills in turns, joins in any order
        handles = [s.submit(p, n) for p, n in zip(PROMPTS + [PROMPTS[2] * 12], MAX_NEW + [10])]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        cache = s.verifier.cache
    assert not cache.staged and cache.held_bytes == 0


def test_three_failed_steps_in_a_row_make_the_scheduler_unhealthy_until_one_succeeds(tok):
    engine = _engine(tok, drafters=False)
    expected = engine.generate(PROMPTS[0], 6).token_ids
    failing = {"left": 3}
    model = engine.verifier.model

    def fail(m, args, kwargs):
        if kwargs.get("position_ids") is not None and failing["left"]:  # batched verify forwards, not prefills
            failing["left"] -= 1
            raise RuntimeError("injected forward failure")
    handle = model.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with Scheduler(engine, max_batch=2) as s:
            for _ in range(3):
                with pytest.raises(RuntimeError, match="injected"):
                    s.submit(PROMPTS[0], 6).result(timeout=60)
            healthy, why = s.health()
            assert not healthy and why.startswith("the last 3 steps failed") and "injected" not in why
            assert s.submit(PROMPTS[0], 6).result(timeout=60).token_ids == expected
            assert s.health() == (True, "ok")
    finally:
        handle.remove()


def test_a_long_prompt_does_not_hold_back_those_that_join_after_it(tok):
    engine = _engine(tok, drafters=False)
    finished = []
    with Scheduler(engine, max_batch=2, prefill_chunk=8) as s:
        s.add_listener(lambda r: finished.append(r.id) if isinstance(r, RequestFinished) else None)
        with s._lock:  # both queued before the first step (else the long one may be done before the short comes)
            long = s.submit(PROMPTS[2] * 12, 2, request_id="long")  # 132 prompt tokens: 17 chunks of 8
            short = s.submit(PROMPTS[1], 2, request_id="short")  # 3 tokens: one chunk
        long.result(timeout=60), short.result(timeout=60)
    assert finished == ["short", "long"]  # first come, first prefilled, it would finish ~16 steps later


@pytest.mark.parametrize("change, named", [
    (lambda m: setattr(m.config, "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type='dynamic'"),
    (lambda m: m.set_attn_implementation("eager"),
     "attn_implementation='eager'"),
])
def test_models_the_batch_would_get_wrong_are_refused_at_start(tok, change, named):
    engine = _engine(tok, drafters=False)
    change(engine.verifier.model)
    with pytest.raises(NotImplementedError, match=named):
        Scheduler(engine)
