"""Keeping exactly the committed path in a transformers KV cache after a verification step, and handing a cache to
a model's forward."""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

import torch
from transformers import Cache

from .staging import to_device


@lru_cache(maxsize=None)
def _cache_argument(forward_owner: type) -> str:
    """The keyword a model class's ``forward`` takes its KV cache by: ``cache`` from transformers 5.23 on (which
    deprecates ``past_key_values``, to be removed in 5.40), ``past_key_values`` before."""
    params = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: torch.nn.Module, cache: Cache | None) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)``, with the keyword its transformers version takes, so that no
    deprecation warning reaches the user's terminal and a later transformers still works."""
    return {_cache_argument(type(model)): cache}


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def crop_to(cache: Cache, length: int) -> None:
    """Drop every cached position at index >= ``length``."""
    remove = cache_length(cache) - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if remove:
        cache.crop(-remove)  # transformers >= 5: a negative count of tokens to remove


def keep_positions(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep cache[:start] followed by cache[start + keep] (in that order); drop the rest.

    start: number of positions before the verified block that stay as they are
    keep:  [m] int64 offsets inside the verified block, increasing (the accepted path)
    """
    m = len(keep)
    contiguous = bool((keep == torch.arange(m, device=keep.device)).all())
    if not contiguous:  # tree: move the accepted nodes' entries next to the prefix, then crop
        src = to_device(start + keep, _first_device(cache))
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys[..., start:start + m, :] = layer.keys.index_select(-2, src)
            layer.values[..., start:start + m, :] = layer.values.index_select(-2, src)
    crop_to(cache, start + m)


def _first_device(cache: Cache) -> torch.device:
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            return layer.keys.device
    return torch.device("cpu")
