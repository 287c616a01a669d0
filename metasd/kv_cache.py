"""Keeping exactly the committed path in a transformers KV cache after a verification step."""
from __future__ import annotations

import torch
from transformers import Cache


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
        src = (start + keep).to(_first_device(cache))
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
