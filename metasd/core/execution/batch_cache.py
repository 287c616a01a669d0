"""The verifier's KV cache for many requests at once (continuous batching, metasd/core/batching/scheduler.py).

Layout: per layer, keys and values of shape [slots, kv_heads, capacity, head_dim]; row b holds request b's committed
positions 0..length[b]-1 (every committed token but its pending one, the convention of ``Verifier``). The running
requests occupy rows 0..B-1 (a request that leaves is replaced by the last row, so the rows stay compact and a
forward reads ``[:B]``).

A verification forward of the B running requests feeds [B, N] tokens (row b: its pending token, its draft nodes,
padding up to N). ``update`` writes row b's N new keys at positions length[b]..length[b]+N-1 of its own row and
returns ``[:B, :, :W]`` with W = max(length) + N; the forward's 4-D mask [B, 1, N, W] (``batch_mask``) lets each query
see its own row's committed prefix and, among the new tokens, its tree ancestors and itself - never another
request's positions, never padding. ``commit`` then keeps, per row, the pending token and the accepted nodes
(gathered next to the prefix when the accepted path is not a prefix of the block: a tree) and sets the row's new
length; what lies beyond a row's length is garbage that the mask hides and the next forward overwrites.

The allocator, and why not transformers' paged cache. transformers' continuous batching (``PagedAttentionCache``)
splits the cache into fixed-size blocks handed to requests through block tables and packs every request's new
tokens into one ragged sequence, read by paged attention kernels: no memory is reserved beyond a block per request
and nothing is padded. It assumes causal attention among a request's new tokens and appends; speculative decoding
needs a tree mask over them and per-row compaction after acceptance. Here each row is one contiguous stretch of a
dense buffer, so a tree is an ordinary 4-D mask, compaction is one gather per layer, and any transformers
attention implementation that takes a 4-D mask (sdpa, eager) runs it. The cost: every row reserves the capacity of
the longest (the buffers grow, for all rows at once, in steps of ``grow`` positions when a forward needs more), and
a forward computes attention over W columns for every row, padding included. For the batch sizes a CPU or a single
GPU serves (a handful to a few dozen requests) and contexts of a few thousand tokens, that waste is small next to
the weights each forward streams; a paged allocator is the step beyond it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin


class BatchLayer(CacheLayerMixin):
    """One layer's keys and values for every slot: [slots, kv_heads, capacity, head_dim] each (``BatchCache``)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "BatchCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        shape = (o.slots, key_states.shape[1], o.capacity, key_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)  # zeros: never NaN under a mask
        self.values = torch.zeros(shape[:-1] + (value_states.shape[-1],), dtype=value_states.dtype,
                                  device=value_states.device)
        self.is_initialized = True

    def grow(self, capacity: int) -> None:
        """Reallocate to ``capacity`` positions per row, keeping what is stored."""
        if not self.is_initialized or self.keys.shape[2] >= capacity:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, kv_heads, N, head_dim] of the forward's new tokens; written at each row's own
        offset; returns keys and values [B, kv_heads, W, head_dim] (W: the forward's width)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.capacity > self.keys.shape[2]:
            self.grow(o.capacity)
        rows, pos, width = o.write_index(key_states.device)  # [B, 1], [B, N], W
        B = key_states.shape[0]
        self.keys[rows, :, pos] = key_states.transpose(1, 2)  # [B, N, kv_heads, head_dim] -> row b, positions pos[b]
        self.values[rows, :, pos] = value_states.transpose(1, 2)
        return self.keys[:B, :, :width], self.values[:B, :, :width]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width(query_length), 0

    def get_seq_length(self) -> int:
        return max(self.owner.lengths[: self.owner.active], default=0)

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """A transformers ``Cache`` holding ``slots`` requests' KV caches side by side (module docstring).

    ``lengths[b]``: cached positions of row b. A forward over rows [0, B) is prepared by ``prepare(B, n_new)``; rows
    join (``join``: a batch-1 cache of a prefilled request copied into a row), leave (``remove``: the last row moves
    into the hole) and keep their accepted positions (``commit``).
    """

    def __init__(self, num_layers: int, slots: int, grow: int = 256):
        super().__init__(layers=[])
        self.layers = [BatchLayer(self) for _ in range(num_layers)]
        self.slots = slots
        self.grow_by = grow
        self.capacity = grow
        self.lengths = [0] * slots
        self.active = 0  # rows in use: 0..active-1
        self._forward: tuple[int, int] | None = None  # (B, N) of the prepared forward
        self._index: tuple[torch.Tensor, torch.Tensor, int] | None = None

    # -------------------------------------------------------------- a forward
    def width(self, n_new: int) -> int:
        """W: the key columns a forward of ``n_new`` tokens per row reads (the longest row's prefix + n_new)."""
        B = self._forward[0] if self._forward is not None else self.active
        return max(self.lengths[:B], default=0) + n_new

    def prepare(self, batch: int, n_new: int) -> int:
        """Get ready for a forward of rows [0, batch) with ``n_new`` tokens each; returns its width W. Grows the buffers
        when a row's new tokens would pass their capacity."""
        if batch > self.active:
            raise ValueError(f"a forward of {batch} rows; {self.active} are in use")
        self._forward, self._index = (batch, n_new), None
        need = max(self.lengths[:batch], default=0) + n_new
        if need > self.capacity:
            self.capacity = -(-need // self.grow_by) * self.grow_by
            for layer in self.layers:
                layer.grow(self.capacity)
        return self.width(n_new)

    def write_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows [B, 1], positions [B, N], W) where the prepared forward's new keys go."""
        if self._forward is None:
            raise RuntimeError("BatchCache: a forward without prepare()")
        if self._index is None or self._index[0].device != device:
            B, N = self._forward
            start = torch.tensor(self.lengths[:B], dtype=torch.long)[:, None]  # [B, 1]
            pos = start + torch.arange(N)  # [B, N]
            self._index = (torch.arange(B)[:, None].to(device), pos.to(device), self.width(N))
        return self._index

    def commit(self, kept: Sequence[torch.Tensor | None]) -> None:
        """After the prepared forward: row b keeps the offsets ``kept[b]`` ([m] int64, increasing: 0 for its pending
        token, i+1 for accepted node i) of its new tokens, in that order; None keeps none (a row that leaves). One
        gather per layer for the rows whose kept offsets are not a prefix (trees)."""
        B, N = self._forward
        moves_src: list[int] = []
        moves_dst: list[int] = []
        moves_row: list[int] = []
        for b in range(B):
            keep = kept[b]
            if keep is None:
                continue
            keep = [int(k) for k in keep]
            start = self.lengths[b]
            for j, k in enumerate(keep):
                if k != j:
                    moves_row.append(b)
                    moves_src.append(start + k)
                    moves_dst.append(start + j)
            self.lengths[b] = start + len(keep)
        if moves_row:
            device = self.layers[0].keys.device
            rows = torch.tensor(moves_row, device=device)
            src = torch.tensor(moves_src, device=device)
            dst = torch.tensor(moves_dst, device=device)
            for layer in self.layers:
                if layer.is_initialized:
                    for buf in (layer.keys, layer.values):
                        buf[rows, :, dst] = buf[rows, :, src]  # gathered before written: sources are read first
        self._forward, self._index = None, None

    # -------------------------------------------------------------- rows joining and leaving
    def join(self, prefix: Cache | None, length: int) -> int:
        """Copy a request's prefilled batch-1 cache (``length`` positions; None when the prompt had one token) into the
        next free row; returns the row."""
        if self.active >= self.slots:
            raise RuntimeError(f"BatchCache: all {self.slots} rows are in use")
        row = self.active
        self.active += 1
        self.lengths[row] = 0
        if prefix is not None and length:
            if length > self.capacity:
                self.capacity = -(-length // self.grow_by) * self.grow_by
            for layer, src in zip(self.layers, prefix.layers):
                if not layer.is_initialized:
                    layer.lazy_initialization(src.keys, src.values)
                layer.grow(self.capacity)
                layer.keys[row, :, :length] = src.keys[0, :, :length]
                layer.values[row, :, :length] = src.values[0, :, :length]
        self.lengths[row] = length
        return row

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last row in use moves into it (its positions copied). Returns the row that moved there
        (the old index of the last row), or None when ``row`` was the last."""
        last = self.active - 1
        if not 0 <= row <= last:
            raise ValueError(f"BatchCache: row {row} is not in use (rows 0..{last})")
        moved = None
        if row != last:
            n = self.lengths[last]
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[row, :, :n] = layer.keys[last, :, :n]
                    layer.values[row, :, :n] = layer.values[last, :, :n]
            self.lengths[row] = n
            moved = last
        self.lengths[last] = 0
        self.active = last
        return moved

    # -------------------------------------------------------------- what transformers asks of a Cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths[: self.active], default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.width(query_length), 0

    @property
    def is_compileable(self) -> bool:
        return False

    def row_keys(self, layer: int, row: int) -> torch.Tensor:
        """Row ``row``'s cached keys of ``layer``: [kv_heads, length, head_dim] (tests, debugging)."""
        return self.layers[layer].keys[row, :, : self.lengths[row]]

    def row_values(self, layer: int, row: int) -> torch.Tensor:
        return self.layers[layer].values[row, :, : self.lengths[row]]

    def __repr__(self) -> str:
        return f"BatchCache(slots={self.slots}, active={self.active}, lengths={self.lengths[: self.active]})"

    def describe(self) -> dict[str, Any]:
        return {"slots": self.slots, "capacity": self.capacity, "active": self.active}
