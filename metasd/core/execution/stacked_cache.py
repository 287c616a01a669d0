"""The caches of several requests' drafter rows, each a ``StaticKVCache`` of its own, seen as one batched transformers
``Cache`` for one forward of a drafting level (``draft_batch._run_batch``): each row's keys written into its own cache,
attention over the rows' first W columns concatenated. The price of rows that live in separate caches (a copy per
forward, no fixed addresses to capture); rows of one ``DraftRows`` (draft_rows.py) avoid it."""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .static_cache import StaticKVCache


class _StackedLayer(CacheLayerMixin):
    """Layer ``index`` of every row's own cache, seen as one [B, kv_heads, W, head_dim] layer for one forward."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "StackedCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, kv_heads, Q, head_dim]; row b's written at its own cache's L_b..L_b+Q-1
        (padding included: past its new length, overwritten later); returns every row's first W positions."""
        o = self.owner
        Q = key_states.shape[-2]
        keys, values = [], []
        for b, (cache, start) in enumerate(zip(o.caches, o.starts)):
            layer = cache.layers[self.index]
            layer.k_buf[:, :, start: start + Q] = key_states[b: b + 1]
            layer.v_buf[:, :, start: start + Q] = value_states[b: b + 1]
            keys.append(layer.k_buf[:, :, : o.width])
            values.append(layer.v_buf[:, :, : o.width])
        return torch.cat(keys), torch.cat(values)  # [B, kv_heads, W, head_dim]: a copy of the rows' caches

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return max(self.owner.starts)

    def get_max_length(self) -> int:
        return -1


class StackedCache(Cache):
    """The caches of B requests (one drafter model) as one batched transformers ``Cache`` for one forward of Q tokens
    per row: each row's keys land in its own cache; attention reads W = max(L_b + Q) columns of all of them. Rows'
    buffers are concatenated per layer (a copy of their first W positions): the price of rows that live in separate
    caches. Lengths are set by ``run_group`` after the forward (each row keeps its q_b real tokens)."""

    def __init__(self, caches: Sequence[StaticKVCache], starts: Sequence[int], width: int):
        super().__init__(layers=[])
        self.caches, self.starts, self.width = list(caches), list(starts), width
        self.layers = [_StackedLayer(self, i) for i in range(len(self.caches[0].layers))]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.starts)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width, 0

    @property
    def is_compileable(self) -> bool:
        return False
