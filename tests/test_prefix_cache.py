"""The scheduler's prefix cache (metasd/core/execution/prefix_cache.py): a request that continues an earlier one (the
next turn of a chat) starts after the stored prefix and gives what ``Engine.generate`` gives, token for token; the
entries stay inside the KV budget, giving way to admissions; what cannot use it is refused or skipped by name. Tiny
fp32 models (tests/tiny.py)."""
import pytest
import torch

from metasd.core.batching.scheduler import Scheduler, SchedulerStep
from metasd.core.engine import Engine
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedTreeDrafter, SuffixDrafter
from tiny import tiny_qwen, tiny_tokenizer

HISTORY = [0, 7, 12, 9, 33, 12, 9, 41, 5, 21, 22, 23, 24, 25, 21, 22, 23, 11, 40, 41]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=0, logit_scale=4.0)


def _engine(model, tok, drafter="tree"):
    drafters = {"tree": lambda: PretrainedTreeDrafter(tiny_qwen(seed=0, logit_scale=2.0), nodes=8, depth=3, width=2,
                                                      name="tree"),
                "suffix": lambda: SuffixDrafter(name="suffix"), "none": lambda: None}
    return Engine(Verifier(model, tok), drafters[drafter](), check_tokenizers=False)


def _turns(scheduler, turns: int, new: int = 12) -> list:
    """A chat of ``turns`` turns, one after another: each prompt is the last prompt, its answer and 3 more tokens."""
    prompt, results = list(HISTORY), []
    for t in range(turns):
        result = scheduler.submit(prompt, new, logprobs=0).result(timeout=120)
        results.append(result)
        prompt = prompt + result.token_ids + [50 + t, 51, 52]
    return results


@pytest.mark.parametrize("drafter", ["tree", "suffix", "none"])
def test_later_turns_reuse_the_history_and_decode_as_generate(model, tok, drafter):
    engine = _engine(model, tok, drafter)
    steps = []
    with Scheduler(engine, prefix_caching=True) as s:
        s.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)
        results = _turns(s, 4)
        store = s.prefix_cache.stats
    prompts = [r.prompt_ids for r in results]
    expected = [engine.generate(p, 12, logprobs=0) for p in prompts]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    for r, e in zip(results, expected):  # the reused keys and values are the prefill's: the same distributions
        assert [s.logprob for s in r.logprobs] == pytest.approx([s.logprob for s in e.logprobs], abs=1e-5)
    cached = [r.stats.cached_prompt_tokens for r in results]
    # turn t reuses everything the last turn committed: its prompt and its answer but the last token (still pending)
    assert cached == [0] + [len(p) + len(r.token_ids) - 1 for p, r in zip(prompts, results[:-1])], cached
    prefilled = sum(st.prefill_tokens for st in steps)
    assert prefilled == sum(len(p) - c for p, c in zip(prompts, cached))  # only what the cache did not hold
    assert store.hits == sum(cached) and store.queries == sum(len(p) for p in prompts)  # whole prompts, as vLLM


def test_entries_stay_inside_the_budget_and_give_way_to_admissions(model, tok):
    engine = _engine(model, tok)
    held = []
    with Scheduler(engine, prefix_caching=True, kv_budget=1024, max_batch=2) as s:
        budget = s.verifier.cache.budget_bytes
        s.add_listener(lambda r: held.append(s.verifier.cache.held_bytes))
        for i in range(6):  # six distinct finished requests of ~150 positions: more than the budget can keep
            s.submit([0] + [10 + (i + j) % 40 for j in range(140)], 8).result(timeout=120)
        entries, evicted = len(s.prefix_cache.entries), s.prefix_cache.stats.evicted
        # two long requests at once need the whole budget: the stored entries give way
        both = [s.submit([0] + [12 + j % 30 for j in range(200)], 20) for _ in range(2)]
        assert all(h.result(timeout=120).stats.new_tokens == 20 for h in both)
        after = len(s.prefix_cache.entries)
    assert max(held) <= budget, (max(held), budget)
    assert evicted > 0 and 0 < entries < 6
    assert after <= 2


def test_an_entry_stored_beside_a_longer_request_never_shows_the_memory_past_its_budget(model, tok):
    # the short request leaves first: its entry is copied while its row is still allocated (every row as wide as the
    # long request's reservation, the budget full), which passes the budget until the row is freed; the scheduler
    # fits the memory (here: older entries give way) before it reports the request's end or the step
    engine = _engine(model, tok, "none")
    held = []
    with Scheduler(engine, prefix_caching=True, kv_budget=1024, max_batch=2) as s:
        cache = s.verifier.cache
        s.add_listener(lambda r: held.append(cache.held_bytes))
        for i in range(3):
            both = [s.submit([0] + [13 + (i + j) % 37 for j in range(100 + 7 * k)], 4 + 40 * k) for k in range(2)]
            assert [h.result(timeout=120).stats.new_tokens for h in both] == [4, 44]
        stats = s.prefix_cache.stats
    assert max(held) <= cache.budget_bytes, (max(held), cache.budget_bytes)
    assert stats.stored == 6 and stats.evicted > 0  # every entry was stored: the fit evicted older ones for it


def test_prompt_logprobs_skip_the_cache_and_stay_right(model, tok):
    engine = _engine(model, tok)
    with Scheduler(engine, prefix_caching=True) as s:
        first = s.submit(HISTORY, 10).result(timeout=120)
        follow = HISTORY + first.token_ids + [50]
        scored = s.submit(follow, 5, prompt_logprobs=1).result(timeout=120)
        plain = s.submit(follow, 5).result(timeout=120)
    reference = engine.generate(follow, 5, prompt_logprobs=1)
    assert scored.stats.cached_prompt_tokens == 0 and plain.stats.cached_prompt_tokens > 0
    assert [p and p.token for p in scored.prompt_logprobs] == [p and p.token for p in reference.prompt_logprobs]
    assert [p.logprob for p in scored.prompt_logprobs[1:]] == \
        pytest.approx([p.logprob for p in reference.prompt_logprobs[1:]], abs=1e-5)
    assert scored.token_ids == plain.token_ids == reference.token_ids


def test_drafters_that_read_hidden_states_refuse_prefix_caching(model, tok):
    from test_hidden_state import _drafter

    engine = Engine(Verifier(model, tok), _drafter(model), check_tokenizers=False)
    assert engine.hidden_layers
    with pytest.raises(ValueError, match="^prefix_caching: .*hidden states"):
        Scheduler(engine, prefix_caching=True)
    Scheduler(engine).close()  # without it: fine


def test_store_lookup_and_fit_on_the_batched_cache(model):
    from metasd.core.execution.batch_cache import BatchCache
    from metasd.core.execution.kv_memory import KVGeometry
    from metasd.core.execution.prefix_cache import PrefixCache

    geometry = KVGeometry.of(model)
    cache = BatchCache(geometry, slots=2, budget_bytes=300 * geometry.bytes_per_token)
    store = PrefixCache(cache, min_tokens=4)
    cache.reserve("a", 200)  # one row of 256 positions
    row = cache.join_staged(cache.stage())
    cache.lengths[row] = 200
    for layer in cache.layers:
        layer.keys[row, :, :200] = torch.randn_like(layer.keys[row, :, :200])
    ids = list(range(200))
    assert not store.store(ids[:100], row)  # beside the reservation (256 of 300 positions) 100 do not fit
    cache.release("a")
    assert store.store(ids[:100], row) and store.store(ids[:150], row)  # the longer one replaces the shorter
    assert len(store.entries) == 1 and not store.store(ids[:120], row)  # held already by the entry that extends it
    entry, n = store.lookup(ids[:60] + [999] * 10)
    assert n == 60 and torch.equal(entry.keys[0][:, :60], cache.layers[0].keys[row, :, :60])
    assert store.lookup([999] * 10) == (None, 0) and store.lookup(ids[:3]) == (None, 0)  # none; below min_tokens
    assert cache.held_bytes > cache.budget_bytes  # the row (256 positions) is still allocated beside the entry
    cache.remove(row)
    store.fit()  # the rows shrink (nothing is reserved): the entry stays
    assert cache.held_bytes <= cache.budget_bytes and len(store.entries) == 1


def test_evicting_among_several_entries_picks_the_least_recently_used(model):
    from metasd.core.execution.batch_cache import BatchCache
    from metasd.core.execution.kv_memory import KVGeometry
    from metasd.core.execution.prefix_cache import PrefixCache

    geometry = KVGeometry.of(model)
    cache = BatchCache(geometry, slots=2, budget_bytes=4096 * geometry.bytes_per_token)
    store = PrefixCache(cache, min_tokens=4, max_entries=2)
    cache.reserve("a", 100)
    row = cache.join_staged(cache.stage())
    cache.lengths[row] = 100
    cache.release("a")
    for start in (0, 1000, 2000):  # three distinct prefixes; max_entries=2 evicts the oldest, not the first listed
        if start == 2000:
            store.lookup(list(range(0, 20)))  # the first entry used again: the second is now the oldest
        assert store.store(list(range(start, start + 20 + start // 100)), row)
    assert sorted(e.length for e in store.entries) == [20, 40] and store.stats.evicted == 1
    assert store.evict_for(4096) and len(store.entries) <= 2
    store.max_entries = 0  # no entry at all (the llama.cpp backend when it has no sequence to spare)
    store.clear()
    assert not store.store(list(range(20)), row) and store.entries == []


def test_a_failing_prefix_cache_costs_its_hits_not_the_scheduler(model, tok, monkeypatch, caplog):
    from metasd.core.execution.prefix_cache import PrefixCache

    def broken(self):
        raise RuntimeError("broken on purpose")

    engine = _engine(model, tok)
    with Scheduler(engine, prefix_caching=True, kv_budget=1024, max_batch=2) as s:
        results = [s.submit([0] + [10 + (i + j) % 40 for j in range(140)], 8).result(timeout=120) for i in range(3)]
        assert s.prefix_cache.entries  # stored while the cache worked
        monkeypatch.setattr(PrefixCache, "_evict_one", broken)  # admission must evict: it fails
        monkeypatch.setattr(PrefixCache, "store", lambda *a, **k: broken(None))
        both = [s.submit([0] + [12 + j % 30 for j in range(200)], 6) for _ in range(2)]
        assert all(h.result(timeout=120).stats.new_tokens == 6 for h in both)
        assert s.failure is None and not s.prefix_cache.entries  # dropped, logged
    assert all(r.stats.new_tokens == 8 for r in results)
    assert "eviction failed" in caplog.text and "storing its prefix failed" in caplog.text
