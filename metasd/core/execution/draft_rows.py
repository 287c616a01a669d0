"""One drafter model's KV caches for every running request in ONE set of buffers, so that a drafting level of many
requests is one fixed-shape forward a CUDA graph can replay ("A batch at GPU speed", docs/architecture.md, "Captured
batched drafting").

Why: batched drafting (draft_batch.py) runs a level's feeds of one model as one forward, but each request's
``StaticKVCache`` lives at its own addresses, so that forward concatenates the rows' caches and cannot be captured -
on a GPU every drafting level then costs an eager, launch-bound forward. Here the rows live side by side:

- per layer, keys and values of [rows + 1 scratch, kv_heads, capacity, head_dim]; a scheduler's fork of the drafter
  takes a row when its request starts (``take``) and gives it back when it ends (``give_back``); rows never move
  while held (a forward reads the rows it runs by index), so a fork's cache is a view of its row (``RowKVCache``):
  its crop, tree compaction and catch-up are ``StaticKVCache``'s own code;
- a level's feeds (``draft_batch.Feed`` s whose caches are rows here) run as one ``BatchGraphRunner`` forward: row b
  writes its q_b tokens' keys at (its row, L_b + j), attention reads ``keys[rows, :, :W]`` gathered by a static index,
  and the forward is padded to a (rows, tokens, width) bucket with the padding written to the scratch row - one CUDA
  graph per bucket where ``capture``, the same buffers run eagerly elsewhere (the CPU check);
- in a scheduler the buffers take the shape of the verifier's rows (``follow``, called by ``BatchCache`` at each
  reallocation of its rows, whose KV budget counts these as densely as its own): the held rows move down to 0..n-1
  as the verifier's shrink; past that shape (a drafter whose text runs longer than the verifier's reservation) they
  grow by what is needed, counted by that budget (``bytes_past``) until they ``refit``; elsewhere they grow on their
  own. Growth is all-or-nothing, never inside a captured forward: rows by doubling when a fork finds none free,
  positions to twice the need. A reallocation drops the graphs (recaptured as met).

A feed alone (a request drafting alone, a prompt's catch-up) runs at a fixed shape too (one row). What still runs
another way, through the rows' views: a steered feed (its hooks add a per-forward bias: the concatenating path), a
feed that must run in a context of its own, a group or a catch-up wider than the runner's largest shape (its own
shape, eagerly), and every feed of a model with sliding-window layers (alone: transformers' own sliding mask).
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .batch_runner import BatchGraphRunner
from .draft_batch import Feed, feed_inputs
from .kv_memory import RESERVATION_BUCKET, KVAllocationError, KVGeometry, buffer_keys, bucketed
from .rows_loop import RowsLoop, RowsLoopFeed
from .static_cache import StaticKVCache, StaticLayer


class RowsLayer(CacheLayerMixin):
    """One layer's keys and values for every row and the scratch row: [rows + 1, kv_heads, capacity, head_dim] each.
    Only a fixed-shape forward (``owner.fixed``) runs through it; a row alone runs through its ``RowKVCache``."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "DraftRows"):
        super().__init__()
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [R, kv_heads, T, head_dim], written at (rows[r, t], write[r, t]); returns the
        rows read, [R, kv_heads, W, head_dim] (gathered: the rows a level runs are any of the held ones)."""
        if self.owner.fixed is None:
            raise RuntimeError("DraftRows: a forward over the rows outside a fixed-shape runner")
        rows, write, width, read = self.owner.fixed
        self.keys[rows, :, write] = key_states.transpose(1, 2)  # [R, T, kv_heads, head_dim]
        self.values[rows, :, write] = value_states.transpose(1, 2)
        return self.keys[:, :, :width].index_select(0, read), self.values[:, :, :width].index_select(0, read)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.fixed[2], 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class RowKVLayer(StaticLayer):
    """A ``StaticLayer`` whose buffers are row ``row`` of its ``DraftRows`` layer: [1, kv_heads, capacity, head_dim]
    views read through the owner (it may reallocate between forwards); allocating grows the owner."""

    def __init__(self, cache: "RowKVCache", index: int, sliding_window: int | None):
        self.index = index
        super().__init__(cache, sliding_window)
        self.device = cache.rows_owner.geometry.device

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        """Whether the owner holds buffers (a row's layers read them from its first forward, whoever allocated)."""
        return self.owner.rows_owner.layers[self.index].keys is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass  # the owner's buffers say

    @property
    def k_buf(self) -> torch.Tensor | None:  # type: ignore[override]
        keys = self.owner.rows_owner.layers[self.index].keys
        return None if keys is None else keys[self.owner.row: self.owner.row + 1]

    @k_buf.setter
    def k_buf(self, value) -> None:
        if value is not None:  # StaticLayer's constructor sets None
            raise AttributeError("RowKVLayer.k_buf is a view of a DraftRows row; write into it")

    @property
    def v_buf(self) -> torch.Tensor | None:  # type: ignore[override]
        values = self.owner.rows_owner.layers[self.index].values
        return None if values is None else values[self.owner.row: self.owner.row + 1]

    @v_buf.setter
    def v_buf(self, value) -> None:
        if value is not None:
            raise AttributeError("RowKVLayer.v_buf is a view of a DraftRows row; write into it")

    def allocate(self, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int) -> None:
        self.owner.rows_owner.grow(capacity=capacity)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a DraftRows row holds one sequence")


class RowKVCache(StaticKVCache):
    """One request's drafter cache as a row of ``rows_owner`` (a ``DraftRows``): a ``StaticKVCache`` in every way a
    drafter uses one (forwards alone, crop, ``keep_positions``, ``reserve``), its buffers the row's views."""

    def __init__(self, rows_owner: "DraftRows", row: int, config, name: str | None = None):
        super().__init__(config, bucket=rows_owner.bucket, name=name)
        self.rows_owner, self.row = rows_owner, row
        self.layers = [RowKVLayer(self, i, layer.sliding_window) for i, layer in enumerate(self.layers)]

    def __repr__(self) -> str:
        return f"RowKVCache(row={self.row}, length={self.get_seq_length()}, capacity={self.capacity})"


class DraftRows(Cache):
    """The KV caches of one drafter model's running requests, a row each, in one set of buffers (module docstring):
    ``take`` / ``give_back`` a row; ``run_feeds`` one drafting level of many rows as one fixed-shape forward (a CUDA
    graph per bucket when ``capture``). ``head``: the drafter's draft head over the base model's hidden states, or
    None. A transformers ``Cache`` only while that forward runs."""

    def __init__(self, model: nn.Module, head: nn.Module | None = None, *, capture: bool, name: str | None = None,
                 bucket: int = RESERVATION_BUCKET):
        super().__init__(layers=[])
        self.model, self.head, self.name, self.bucket = model, head, name, bucket
        self.geometry = KVGeometry.of(model)
        self.sliding = any(layer.is_sliding for layer in StaticKVCache(model.config, name=name).layers)
        self.layers = [RowsLayer(self) for _ in range(self.geometry.layers)]
        self.rows = 0  # rows allocated (the scratch row is one more)
        self.capacity = 0  # positions per row
        self.scratch_rows = 0  # set to 1 by the runner
        self.keep_allocation = True
        self.fixed: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None  # set while a forward runs
        self.free: list[int] = []
        #: row -> its cache, weakly: a fork dropped without its ``end`` (a request that failed as it began) frees its
        #: row when its cache is collected, never holding it for the drafter's life
        self.held: dict[int, weakref.ref] = {}
        self.runner = BatchGraphRunner(model, self, capture=capture, head=head,
                                       label=f"the drafting level of {name or 'a drafter'}")
        self.loops: dict[tuple[int, ...], RowsLoop] = {}  # fixed tree shapes drafted whole for many rows at once
        self.reallocations = 0
        self.followed: tuple[int, int] | None = None  # the shape of the verifier's rows it follows (``follow``)

    # -------------------------------------------------------------- rows
    def take(self) -> RowKVCache:
        """A free row (the buffers grown by doubling when none is), its length 0."""
        if not self.free:
            self._reclaim()
        if not self.free:
            self.grow(rows=max(1, 2 * self.rows))
        row = self.free.pop(0)
        cache = RowKVCache(self, row, self.model.config, self.name)
        self.held[row] = weakref.ref(cache)
        return cache

    def _reclaim(self) -> None:
        """Free the rows whose caches were collected without being given back."""
        for row in [row for row, ref in self.held.items() if ref() is None]:
            del self.held[row]
            self.free.append(row)
        self.free.sort()

    def give_back(self, cache: RowKVCache) -> None:
        """``cache``'s row is free again (a request ended); nothing when it is not held."""
        ref = self.held.get(cache.row)
        if ref is not None and ref() is cache:
            del self.held[cache.row]
            self.free.append(cache.row)
            self.free.sort()

    def grow(self, rows: int = 0, capacity: int = 0) -> None:
        """Buffers of at least ``rows`` rows x ``capacity`` positions: positions to twice the need (rounded up to the
        bucket) - only to the need past a followed shape (a scheduler's budget counts them, ``bytes_past``, until
        ``refit``) -, rows as asked; the held rows' contents kept. All or nothing: every new buffer is allocated
        before an old one is replaced."""
        new_rows = max(rows, self.rows)
        new_capacity = self.capacity if capacity <= self.capacity else bucketed(
            capacity if self.followed is not None else max(capacity, 2 * self.capacity), self.bucket)
        new_capacity = max(new_capacity, self.bucket)
        if (new_rows, new_capacity) == (self.rows, self.capacity):
            return
        new = self._new_buffers(new_rows, new_capacity)
        for layer, (k, v) in zip(self.layers, new):
            if layer.keys is not None:
                k[: self.rows, :, : self.capacity] = layer.keys[: self.rows]
                v[: self.rows, :, : self.capacity] = layer.values[: self.rows]
            layer.keys, layer.values = k, v
        self.free += list(range(self.rows, new_rows))
        self.rows, self.capacity = new_rows, new_capacity
        self.reallocations += 1

    def follow(self, rows: int, capacity: int) -> None:
        """Take the shape of a scheduler's verifier rows (``BatchCache.followers``: its KV budget counts these buffers
        as densely as its own): ``rows`` rows x ``capacity`` positions, never fewer than the rows held or the positions
        they use. The held rows move to 0..n-1 (their caches follow), so the buffers can shrink as the verifier's do;
        none: nothing allocated. All or nothing (``KVAllocationError``)."""
        self.followed = (rows, capacity)
        held = self._held()
        rows, capacity = self._fitted(rows, capacity, held)
        if not rows:
            for layer in self.layers:
                layer.keys = layer.values = None
            self.rows = self.capacity = 0
            self.held, self.free = {}, []
            return
        new = self._new_buffers(rows, capacity)
        keep = min(self.capacity, capacity)
        for layer, (k, v) in zip(self.layers, new):
            for i, cache in enumerate(held):
                k[i, :, :keep] = layer.keys[cache.row, :, :keep]
                v[i, :, :keep] = layer.values[cache.row, :, :keep]
            layer.keys, layer.values = k, v
        for i, cache in enumerate(held):
            cache.row = i
        self.held = {i: weakref.ref(cache) for i, cache in enumerate(held)}
        self.free = list(range(len(held), rows))
        self.rows, self.capacity = rows, capacity
        self.reallocations += 1

    def _held(self) -> list[RowKVCache]:
        return [cache for _, ref in sorted(self.held.items()) if (cache := ref()) is not None]

    def _fitted(self, rows: int, capacity: int, held: list[RowKVCache]) -> tuple[int, int]:
        """``follow``'s shape for ``rows`` x ``capacity``: never fewer rows than held nor positions than they use."""
        rows = max(rows, len(held))
        used = max((cache.get_seq_length() for cache in held), default=0)
        return (rows, max(capacity, bucketed(used, self.bucket), self.bucket)) if rows else (0, 0)

    def bytes_past(self) -> int:
        """Bytes held past the followed shape: a row whose text ran longer than the verifier's reservation (a drafter
        with another tokenizer) grew the buffers; a scheduler's KV budget counts these (``BatchCache.outside_bytes``)
        until ``refit`` returns to the shape."""
        if self.followed is None:
            return 0
        rows, capacity = self.followed
        within = (rows + self.scratch_rows) * capacity * self.geometry.bytes_per_token if rows else 0
        return max(self.held_bytes - within, 0)

    def refit(self) -> None:
        """Between steps: back to the followed shape once no held row needs more (a long row ended or was cropped) -
        only then, so that a row still past it does not reallocate every step; a failed allocation keeps the buffers."""
        if not self.bytes_past():
            return
        rows, capacity = self.followed
        if self._fitted(rows, capacity, self._held()) == ((rows, max(capacity, self.bucket)) if rows else (0, 0)):
            try:
                self.follow(rows, capacity)
            except KVAllocationError:
                pass

    def _new_buffers(self, rows: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed keys and values for ``rows`` rows (and the scratch rows) x ``capacity`` positions, every layer's -
        all allocated before any replaces the old (``KVAllocationError`` when one cannot be: nothing changed)."""
        g = self.geometry
        shape = (rows + self.scratch_rows, g.kv_heads, capacity, g.head_dim)
        try:
            with torch.inference_mode(False):  # ordinary tensors: a forward outside inference mode may write them too
                return [(torch.zeros(shape, dtype=g.dtype, device=g.device),
                         torch.zeros(shape, dtype=g.dtype, device=g.device)) for _ in self.layers]
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise KVAllocationError(f"{self.name or 'a drafter'}: could not allocate its rows' KV buffers for {rows} "
                                    f"rows x {capacity} positions") from e

    def buffers(self) -> tuple:
        """The buffers' addresses and shapes (``buffer_keys``): a captured graph is recaptured when they change."""
        return buffer_keys(t for layer in self.layers for t in (layer.keys, layer.values))

    @property
    def held_bytes(self) -> int:
        return (self.rows + self.scratch_rows) * self.capacity * self.geometry.bytes_per_token if self.rows else 0

    # -------------------------------------------------------------- a drafting level
    def runs(self, feeds: Sequence[Feed]) -> bool:
        """Whether ``feeds`` (one batch key: one model, one head) run here as one fixed-shape forward: their caches
        all rows held here, none steered nor run in a context of its own, the group within the runner's shapes, the
        model without sliding-window layers (the runner's mask is the whole prefix: their rows run alone)."""
        return (not self.sliding and all(getattr(f.cache, "rows_owner", None) is self and f.steer is None
                                         and f.around is None for f in feeds)
                and self.runner.fits(len(feeds), max(f.length for f in feeds)))

    def run_feeds(self, feeds: Sequence[Feed]) -> list[torch.Tensor]:
        """The feeds (``runs``) as one forward; their logits, each as ``Feed.run`` returns it, and each row's length
        its own + its q_b tokens."""
        starts = [f.cache.get_seq_length() for f in feeds]
        Q = max(f.length for f in feeds)
        self.grow(capacity=max(s + Q for s in starts))  # outside any capture: may reallocate (the graphs drop)
        ids, positions, mask, on_device = feed_inputs(feeds, starts)  # [B, Q], [B, Q], [B, 1, Q, W], {b: ids}
        logits, _ = self.runner.forward(ids, positions, mask, {b: (0, t) for b, t in on_device.items()},
                                        rows=[f.cache.row for f in feeds], starts=starts)  # [B, Q, vocab]
        out = []
        for b, (f, s) in enumerate(zip(feeds, starts)):
            n = f.length
            f.cache.set_length(s + n)
            out.append(logits[b, n - 1: n] if f.last_only else logits[b, :n])
        return out

    def loop_feed(self, widths: Sequence[int], cache: RowKVCache, root: torch.Tensor) -> RowsLoopFeed | None:
        """The feed that drafts a tree of ``widths`` (a chain: ``[1] * k``) after ``root`` ([vocab]) over ``cache``'s
        row - the round's such feeds of one shape run as ONE loop for their rows (rows_loop.py); None for a model with
        sliding-window layers (its levels run alone)."""
        if self.sliding:
            return None
        key = tuple(int(w) for w in widths)
        loop = self.loops.get(key)
        if loop is None:
            loop = self.loops[key] = RowsLoop(self, key, capture=self.runner.capture)
        return RowsLoopFeed(loop, cache, root)

    # -------------------------------------------------------------- what transformers asks of a Cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.fixed[2], 0

    @property
    def is_compileable(self) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"rows": self.rows, "held": len(self.held), "capacity": self.capacity,
                "mib": round(self.held_bytes / 2 ** 20, 1), "reallocations": self.reallocations,
                **self.runner.describe(), "loops": [loop.describe() for loop in self.loops.values()]}

    def __repr__(self) -> str:
        return f"DraftRows(rows={self.rows}, held={len(self.held)}, capacity={self.capacity})"


def give_back_row(cache: Any) -> None:
    """A drafter's request ended: its cache's row is free again where it is one (``RowKVCache``)."""
    if isinstance(cache, RowKVCache):
        cache.rows_owner.give_back(cache)


def draft_rows_of(drafters: Sequence[Any]) -> list[DraftRows]:
    """The ``DraftRows`` of ``drafters`` (a model drafter's ``rows``; a trace replay's, one per model), each once."""
    found: list[DraftRows] = []
    for drafter in drafters:
        rows = getattr(drafter, "rows", None)
        for r in rows if isinstance(rows, list) else [rows]:
            if isinstance(r, DraftRows) and all(r is not f for f in found):
                found.append(r)
    return found
