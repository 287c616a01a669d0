"""The preallocated KV cache every single-sequence forward runs with (metasd/core/execution/static_cache.py): written
by index, cropped by setting a length, a tree's accepted path kept by one index copy - exactly the positions a full
recomputation of the committed text sees (fp32, tiny models)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from metasd.core.engine import Engine
from metasd.core.execution.kv_cache import cache_kwargs, crop_to, keep_positions
from metasd.core.execution.static_cache import StaticKVCache, new_cache
from metasd.core.execution.tree import Draft
from metasd.core.execution.verifier import Verifier
from metasd.drafters import PretrainedDrafter, PretrainedTreeDrafter

from tiny import plain_greedy, tiny_qwen

PROMPT = [5, 17, 3, 59, 42, 8, 23, 61]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen(seed=3, layers=2)


def _next(model, cache, ids: list[int]) -> torch.Tensor:
    """Logits after feeding ``ids`` through ``cache``: [len(ids), vocab]."""
    return model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache), use_cache=True).logits[0]


def _fresh(model, ids: list[int]) -> torch.Tensor:
    """The last position's logits by full recomputation, no cache: [vocab]."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@torch.inference_mode()
def test_forwards_by_index_match_full_recomputation(model):
    """Token by token and in chunks, through a reservation smaller than the text (so the buffers grow once, keeping
    what they hold), every next-token distribution equals the full recomputation's."""
    cache = new_cache(model, reserve=8)
    cache.bucket = 8  # small buckets: the text below outgrows the reservation
    cache.reserved = 8
    ids = list(PROMPT)
    _next(model, cache, ids)
    assert cache.get_seq_length() == len(ids) and cache.capacity == 8
    for chunk in ([11], [12, 13, 14], [15]):
        out = _next(model, cache, chunk)
        ids += chunk
        assert torch.allclose(out[-1], _fresh(model, ids), atol=1e-5)
    assert cache.get_seq_length() == len(ids) == 13 and cache.capacity >= 13  # grew past the reservation
    assert all(layer.keys.shape[-2] == 13 for layer in cache.layers)  # readers see the committed positions only


@torch.inference_mode()
def test_a_reserved_cache_allocates_nothing_while_it_decodes(model):
    """Inside its reservation, forwards and crops write the same buffers (no reallocation per step)."""
    cache = new_cache(model, reserve=64)
    _next(model, cache, PROMPT)
    buffers = [(layer.k_buf.data_ptr(), layer.v_buf.data_ptr()) for layer in cache.layers]
    for t in range(20):
        _next(model, cache, [t + 1, t + 2, t + 3])
        crop_to(cache, cache.get_seq_length() - 2)
    assert [(layer.k_buf.data_ptr(), layer.v_buf.data_ptr()) for layer in cache.layers] == buffers
    assert cache.capacity == 256  # the reservation rounded up to the bucket


@torch.inference_mode()
def test_crop_is_a_length_and_the_next_forward_overwrites(model):
    cache = new_cache(model)
    _next(model, cache, PROMPT + [50, 51, 52])
    crop_to(cache, len(PROMPT))
    assert cache.get_seq_length() == len(PROMPT)
    out = _next(model, cache, [40])
    assert torch.allclose(out[-1], _fresh(model, PROMPT + [40]), atol=1e-5)
    with pytest.raises(ValueError, match="cannot crop"):
        crop_to(cache, cache.get_seq_length() + 1)


@torch.inference_mode()
def test_a_trees_accepted_path_is_kept_by_an_index_copy(model):
    """Verify a tree over the cache with its ancestor mask, keep a path that is not a prefix of the block (nodes 1 and
    3 of the root's second branch): the cache then holds exactly the committed text's keys and values."""
    verifier = Verifier(model)
    verifier.prefill(torch.tensor(PROMPT[:-1]), reserve=32)
    draft = Draft(tokens=[3, 4, 5, 6, 7], parents=[-1, -1, 1, 1, 3])
    verifier.verify(PROMPT[-1], draft)
    rows = verifier.commit([1, 3, 4])  # tokens 4, 6, 7: a path through the tree
    assert rows.tolist() == [0, 2, 4, 5]
    assert isinstance(verifier.cache, StaticKVCache) and verifier.cached == len(PROMPT) + 3
    out = _next(model, verifier.cache, [9])
    assert torch.allclose(out[-1], _fresh(model, PROMPT + [4, 6, 7, 9]), atol=1e-5)


@torch.inference_mode()
def test_keep_positions_copies_inside_the_buffer(model):
    """``keep_positions`` on the static cache moves the kept entries in place (no new buffer) and sets the length."""
    cache = new_cache(model, reserve=32)
    _next(model, cache, PROMPT)
    before = cache.layers[0].k_buf[0, :, 3:8].clone()  # positions 3..7
    ptr = cache.layers[0].k_buf.data_ptr()
    keep_positions(cache, 3, torch.tensor([0, 2, 4]))
    assert cache.get_seq_length() == 6 and cache.layers[0].k_buf.data_ptr() == ptr
    assert torch.equal(cache.layers[0].keys[0, :, 3:6], before[:, [0, 2, 4]])


def test_a_forward_outside_inference_mode_writes_the_cache(model):
    """Buffers allocated inside inference mode are ordinary tensors: a user's forward under ``no_grad`` (or a test's
    check of a drafter's cache) can still write them."""
    cache = new_cache(model)
    with torch.inference_mode():
        _next(model, cache, PROMPT)
    with torch.no_grad():
        out = _next(model, cache, [7])
    assert torch.allclose(out[-1], _fresh(model, PROMPT + [7]), atol=1e-5)


def test_unsupported_layer_types_are_refused_by_name(model):
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(NotImplementedError, match=r"my-model.*linear_attention"):
        StaticKVCache(cfg, name="my-model")


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_the_engine_runs_on_the_static_cache(kind):
    """The path ``metasd generate`` runs: the verifier and the model drafter hold static caches, the verifier's
    reserved for the request at its prefill (never reallocated while it decodes), and greedy output equals plain
    decoding's."""
    model, drafter_model = tiny_qwen(seed=3, context=1024), tiny_qwen(seed=4, layers=1, context=1024)
    drafter = (PretrainedDrafter(drafter_model, k=3) if kind == "chain"
               else PretrainedTreeDrafter(drafter_model, nodes=8, depth=3, width=2))
    engine = Engine(Verifier(model), drafter, check_tokenizers=False)
    run = engine._run(PROMPT, 300)
    pointers = set()
    for _ in run.steps():
        assert isinstance(engine.verifier.cache, StaticKVCache)
        assert isinstance(drafter.cache, StaticKVCache)
        pointers.add(engine.verifier.cache.layers[0].k_buf.data_ptr())
    assert len(pointers) == 1 and engine.verifier.cache.capacity == 512  # prompt + 300 tokens: two buckets of 256
    assert run.result().token_ids == plain_greedy(model, PROMPT, 300)
