"""The prefix cache on the llama.cpp backend (``metasd.core.execution.llama_cpp_prefix``): a finished request's cells
kept as a sequence of the context and shared with a request that continues it (no prefill of that prefix, the same
tokens as ``Engine.generate``, the model drafter's positions resumed too); entries that give way to admissions and
hand their sequences back; the sequences they take from the drafts' leaves; a reset context forgetting them. Tiny f32
GGUFs (tests/llama_cpp_models.py)."""
from __future__ import annotations

import pytest

from llama_cpp_models import gguf_of, require_llama_cpp

require_llama_cpp()

from metasd.core import Engine  # noqa: E402
from metasd.core.batching.scheduler import Scheduler  # noqa: E402
from metasd.core.execution.llama_cpp_prefix import LlamaCppPrefixCache  # noqa: E402
from metasd.core.execution.llama_cpp_verifier import LlamaCppVerifier  # noqa: E402
from metasd.drafters import PretrainedTreeDrafter  # noqa: E402
from tiny import tiny_qwen  # noqa: E402

FIRST = [4, 9, 4, 9, 17, 21, 22, 23, 24, 25, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]  # 22 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = tiny_qwen(seed=3, vocab=64, layers=2, context=4096)
    return model, gguf_of(model, tmp_path_factory, "tiny_prefix")


def _engine(tiny, context=2048, drafter=True):
    model, gguf = tiny
    tree = PretrainedTreeDrafter(tiny_qwen(seed=3, vocab=64, layers=1), depth=3, width=2, nodes=6, name="tree") \
        if drafter else None
    return Engine(LlamaCppVerifier(gguf, model, name="tiny", context=context), tree, check_tokenizers=False)


def test_a_continued_request_shares_the_stored_cells_and_gives_the_same_tokens(tiny):
    engine = _engine(tiny)
    first_answer = engine.generate(FIRST, 20).token_ids
    second = FIRST + first_answer + [5, 6, 7, 8]  # the next turn: the history, then a new question
    expected = engine.generate(second, 20).token_ids
    with Scheduler(engine, max_batch=2, prefix_caching=True) as s:
        cache = s.prefix_cache
        assert isinstance(cache, LlamaCppPrefixCache)
        got_first = s.submit(FIRST, 20).result(timeout=60)
        assert len(cache.entries) == 1 and cache.entries[0].length >= len(FIRST)
        decode, prefilled = s.verifier.verifier._decode, []

        def counting(tokens, positions, sequences, logits):  # prompt tokens are decoded with no logits
            prefilled.append(sum(1 for flag in ([logits] * len(tokens) if isinstance(logits, bool) else logits)
                                 if not flag))
            return decode(tokens, positions, sequences, logits)

        s.verifier.verifier._decode = counting
        got = s.submit(second, 20).result(timeout=60)
    assert sum(prefilled) == len(second) - 1 - got.stats.cached_prompt_tokens  # only what the entry did not hold
    assert got_first.token_ids == first_answer
    assert got.token_ids == expected
    # the history was not prefilled again (its last answer token was pending when the first request ended) ...
    assert got.stats.cached_prompt_tokens >= len(FIRST) + len(first_answer) - 1
    assert cache.stats.hits == got.stats.cached_prompt_tokens
    # ... and the drafter resumed from its own positions of it
    assert cache.stats.drafter_hits >= len(FIRST)


def test_entries_give_way_to_admissions_and_hand_their_sequences_back(tiny):
    engine = _engine(tiny, context=1024, drafter=False)
    with Scheduler(engine, max_batch=2, prefix_caching=True) as s:
        bv, cache = s.verifier, s.prefix_cache
        # the entries take sequences the trees' leaves then cannot have
        assert cache.max_entries == 16 and s.max_draft_nodes == (bv.verifier.max_sequences - 2 - 16) // 2
        for i in range(20):  # distinct prompts: 20 entries made, at most 16 kept
            s.submit([i % 64, (i * 7 + 1) % 64] + FIRST, 4).result(timeout=60)
        assert len(cache.entries) == 16 and cache.stats.evicted == 4
        assert bv.cache.pinned_cells == sum(e.length for e in cache.entries) > 256
        assert bv.cache.fits(256) and not bv.cache.fits(1024 - 255)  # a reservation counts the cells they hold
        # a request that needs the cells the entries hold: they give way before it waits
        big = s.submit(list(range(1, 64)) * 8, 400).result(timeout=120)
        assert big.stats.new_tokens == 400 and len(cache.entries) < 16
        kept = {e.seq for e in cache.entries}
    free = set(bv._free)
    assert not free & kept and len(free) + len(kept) == bv.verifier.max_sequences  # no sequence lost or shared
    bv.reset()  # a step broke: the context is cleared, and the entries with it
    assert cache.entries == [] and bv.cache.pinned_cells == 0
    assert sorted(bv._free) == list(range(bv.verifier.max_sequences))
