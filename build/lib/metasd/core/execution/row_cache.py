"""A joining request's prefill written straight into the batched cache (``BatchCache.stage``): a transformers
``Cache`` of one sequence whose buffers are views of one row of the batched buffers, so a prefill allocates nothing
outside the KV budget and the request joins the running rows without copying its prompt's keys and values
(docs/architecture.md#the-kv-memory-model)."""
from __future__ import annotations

from typing import Any

import torch
from transformers import Cache

from .static_cache import LengthLayer


class RowLayer(LengthLayer):
    """One layer of a staged row (``RowCache``): a batch-1 forward writes at the row's length and reads ``[row:row+1,
    :, :length]``, a view of the batched buffer."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: Any, index: int, row: int):  # owner: the BatchCache
        super().__init__()
        self.owner, self.index, self.row = owner, index, row
        self.length = 0
        self.dtype, self.device = owner.geometry.dtype, owner.geometry.device
        self.is_initialized = True

    # the row's buffers as views [1, kv_heads, capacity, head_dim] (the owner may reallocate between forwards)
    @property
    def k_buf(self) -> torch.Tensor:
        return self.owner.layers[self.index].keys[self.row: self.row + 1]

    @property
    def v_buf(self) -> torch.Tensor:
        return self.owner.layers[self.index].values[self.row: self.row + 1]

    @property
    def keys(self) -> torch.Tensor:
        return self.k_buf[:, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:  # transformers' layer constructor sets None
            raise AttributeError("RowLayer.keys is a view of the batched cache's row; write into it")

    @property
    def values(self) -> torch.Tensor:
        return self.v_buf[:, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("RowLayer.values is a view of the batched cache's row; write into it")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the row was allocated at the request's admission

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [1, kv_heads, n, head_dim], written at positions length..length+n-1 of the row."""
        end = self.length + key_states.shape[-2]
        k, v = self.k_buf, self.v_buf
        if end > k.shape[-2]:
            raise RuntimeError(f"BatchCache: a prefill of {end} positions; the rows hold {k.shape[-2]}")
        k[:, :, self.length: end] = key_states
        v[:, :, self.length: end] = value_states
        self.length = end
        return k[:, :, :end], v[:, :, :end]


class RowCache(Cache):
    """A joining request's prefill writing straight into a row of the batched cache that its reservation allocated
    (``BatchCache.stage``): a transformers ``Cache`` of one sequence whose buffers are that row, so a prefill
    allocates nothing and its request joins without a copy (``BatchCache.join_staged``)."""

    def __init__(self, owner: Any, row: int):
        super().__init__(layers=[])
        self.owner, self.row = owner, row
        self.layers = [RowLayer(owner, i, row) for i in range(owner.geometry.layers)]

    def set_length(self, length: int) -> None:
        if length > self.owner.capacity:
            raise ValueError(f"RowCache: a length of {length} positions; the rows hold {self.owner.capacity}")
        for layer in self.layers:
            layer.length = length

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    @property
    def is_compileable(self) -> bool:
        return False
