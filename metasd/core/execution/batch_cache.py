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

Memory (docs/architecture.md#the-kv-memory-model). Nothing is allocated inside a forward. A request reserves its
positions when it is admitted (``reserve``: prompt + max_new_tokens + the widest draft, rounded up to a bucket); the
buffers then hold a row per reservation at least (their rows grow by doubling, within the budget, so that admissions
seldom copy the cache) and as many positions per row as the largest reservation, and are reallocated all-or-nothing
(``KVAllocationError``, nothing changed) when a reservation needs more. The budget counts those bytes, the drafters'
caches (their rows shaped like these, ``followers``, or a share per reserved position) and the prefix cache's entries;
a request that leaves returns its reservation (``release``); the buffers shrink when the largest reservation has left
or three quarters of the rows are free (``shrink``).

The layout, and why not transformers' paged cache. transformers' continuous batching (``PagedAttentionCache``)
splits the cache into fixed-size blocks handed to requests through block tables and packs every request's new
tokens into one ragged sequence, read by paged attention kernels: no memory is reserved beyond a block per request
and nothing is padded. It assumes causal attention among a request's new tokens and appends; speculative decoding
needs a tree mask over them and per-row compaction after acceptance. Here each row is one contiguous stretch of a
dense buffer, so a tree is an ordinary 4-D mask, compaction is one gather per layer, and any transformers
attention implementation that takes a 4-D mask (sdpa, eager) runs it. The cost: every row holds the capacity of the
largest reservation, and a forward computes attention over W columns for every row, padding included (W from the
rows' lengths, never from their reservations). For the batch sizes a CPU or a single GPU serves (a handful to a few
dozen requests) and contexts of a few thousand tokens, that waste is small next to the weights each forward streams;
a paged allocator is the step beyond it.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from .kv_memory import RESERVATION_BUCKET, KVAllocationError, KVBudgetError, KVGeometry, buffer_keys, bucketed
from .row_cache import RowCache
from .staging import to_device


class BatchLayer(CacheLayerMixin):
    """One layer's keys and values for every row: [rows, kv_heads, capacity, head_dim] each (``BatchCache`` allocates
    them)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "BatchCache"):
        super().__init__()
        self.owner = owner
        g = owner.geometry
        self.dtype, self.device = g.dtype, g.device
        self.keys = torch.zeros(0, g.kv_heads, 0, g.head_dim, dtype=g.dtype, device=g.device)
        self.values = torch.zeros_like(self.keys)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated by the owner at admission, never inside a forward

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [B, kv_heads, N, head_dim] of the forward's new tokens; written at each row's own
        offset; returns keys and values [B, kv_heads, W, head_dim] (W: the forward's width)."""
        fixed = self.owner.fixed
        if fixed is not None:  # a fixed-shape forward (batch_runner.py): rows [R, T], positions [R, T] from its buffers
            rows, pos, width, _ = fixed  # rows [:R] read: the running rows and, past B, rows attended as padding
        else:
            rows, pos, width = self.owner.write_index(key_states.device)  # [B, 1], [B, N], W
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
    """A transformers ``Cache`` holding up to ``slots`` requests' KV caches side by side (module docstring).

    ``lengths[b]``: cached positions of row b. Admission: ``fits`` / ``reserve`` (all-or-nothing) / ``release``,
    ``shrink`` between steps; ``budget_bytes`` None: no budget. A forward over rows [0, B) is prepared by
    ``prepare(B, n_new)``; a joining request prefills into a free row of its own (``stage``: a ``RowCache``, outside
    the running rows), then joins (``join_staged``: its row becomes row B), leave (``remove``: the last row moves into
    the hole) and keep their accepted positions (``commit``).
    """

    def __init__(self, geometry: KVGeometry, slots: int, *, budget_bytes: int | None = None,
                 extra_bytes_per_token: int = 0, bucket: int = RESERVATION_BUCKET,
                 dense_extra_bytes_per_token: int = 0):
        super().__init__(layers=[])
        self.geometry = geometry
        self.layers = [BatchLayer(self) for _ in range(geometry.layers)]
        self.slots, self.bucket = slots, bucket
        self.budget_bytes = budget_bytes
        self.extra_bytes_per_token = int(extra_bytes_per_token)
        #: caches given the rows' shape (``follow(rows, capacity)``: drafters' ``DraftRows``), counted as densely
        #: (``dense_extra_bytes_per_token``), what they grow past it (``bytes_past``) until they ``refit`` too
        self.followers: list[Any] = []
        self.dense_extra_bytes_per_token = int(dense_extra_bytes_per_token)
        self.rows = 0  # rows allocated
        self.capacity = 0  # positions per row allocated
        self.lengths = [0] * slots
        self.active = 0  # rows in use: 0..active-1
        self.reserved: dict[Hashable, int] = {}  # admitted request -> positions reserved
        self.staged: dict[int, RowCache] = {}  # rows >= active that joining requests prefill into
        self.pinned_bytes = 0  # held inside the budget outside the rows: the prefix cache's entries (prefix_cache.py)
        #: rows allocated past ``rows`` that fixed-shape forwards write their padding into (``batch_runner.py``: 1)
        self.scratch_rows = 0
        #: keep the buffers between steps while they fit the budget and grow their positions by doubling (set by the
        #: fixed-shape runner: its graphs read the buffers by address, so each reallocation recaptures every shape)
        self.keep_allocation = False
        #: set by a fixed-shape forward while it runs: (write rows [R, T], write positions [R, T] on the device, W,
        #: the rows read [R] - here always 0..R-1)
        self.fixed: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None
        self._forward: tuple[int, int] | None = None  # (B, N) of the prepared forward
        self._index: tuple[torch.Tensor, torch.Tensor, int] | None = None

    # -------------------------------------------------------------- memory
    def bytes_for(self, reservations: Sequence[int]) -> int:
        """Bytes the cache holds for these reservations: one row each, as wide as the largest, plus the drafters'
        share per reserved position."""
        if not reservations:
            return 0
        return self._dense_bytes(len(reservations), max(reservations)) + self.extra_bytes_per_token * sum(reservations)

    @property
    def held_bytes(self) -> int:
        """Bytes held now: the allocated buffers, the drafters' share of the reservations and ``outside_bytes``."""
        return self.row_bytes + self.outside_bytes

    @property
    def outside_bytes(self) -> int:
        """Held in the budget beside the rows' shape: the prefix cache's entries, what followers grew past it."""
        return self.pinned_bytes + sum(follower.bytes_past() for follower in self.followers)

    @property
    def row_bytes(self) -> int:
        """The allocated buffers and the drafters' share of the reservations."""
        return self._dense_bytes(self.rows, self.capacity) + self.extra_bytes_per_token * sum(self.reserved.values())

    def _physical(self, rows: int) -> int:
        """The rows buffers of ``rows`` rows hold: those and, once there is any, the scratch rows."""
        return rows + self.scratch_rows if rows else 0

    def _dense_bytes(self, rows: int, capacity: int) -> int:
        """Bytes of buffers of ``rows`` rows (and the scratch rows) x ``capacity`` positions: these and the followers'
        (each with a scratch row of its own)."""
        followers = (rows + 1 if rows else 0) * self.dense_extra_bytes_per_token
        return capacity * (self._physical(rows) * self.geometry.bytes_per_token + followers)

    def check_admissible(self, tokens: int) -> int:
        """The reservation for ``tokens`` positions; ``KVBudgetError`` where the budget could never hold it alone."""
        need = bucketed(tokens, self.bucket)
        if self.budget_bytes is not None and self.bytes_for([need]) > self.budget_bytes:
            per = self.geometry.bytes_per_token + self.dense_extra_bytes_per_token + self.extra_bytes_per_token
            most = self.budget_bytes // per // self.bucket * self.bucket
            raise KVBudgetError(f"needs a KV reservation of {need} positions ({tokens} rounded up to {self.bucket}s, "
                                f"{self.bytes_for([need]) / 2**20:.1f} MiB); the KV budget "
                                f"({self.budget_bytes / 2**20:.1f} MiB) holds at most {most} for one request")
        return need

    def fits(self, tokens: int) -> bool:
        """Whether a reservation of ``tokens`` positions fits the budget beside those held now."""
        need = bucketed(tokens, self.bucket)
        if len(self.reserved) >= self.slots:
            return False
        return (self.budget_bytes is None
                or self.bytes_for([*self.reserved.values(), need]) + self.outside_bytes <= self.budget_bytes)

    def reserve(self, key: Hashable, tokens: int) -> int:
        """Reserve a row of ``tokens`` positions (rounded up) for ``key``, allocating now - all or nothing
        (``KVAllocationError`` leaves the cache as it was). Returns the positions reserved."""
        need = self.check_admissible(tokens)
        if key in self.reserved:
            raise ValueError(f"BatchCache: {key!r} already holds a reservation")
        if not self.fits(tokens):
            raise RuntimeError(f"BatchCache: a reservation of {need} positions does not fit now (ask fits() first)")
        rows, capacity = max(self.rows, len(self.reserved) + 1), max(self.capacity, need)
        if self.keep_allocation and need > self.capacity > 0 and not self._over_budget(rows, 2 * self.capacity, need):
            capacity = max(need, 2 * self.capacity)  # few reallocations: each one recaptures the graphs
        if rows > self.rows:  # room for more than one more: doubling keeps the copies of the cache few
            rows = max(rows, min(2 * self.rows, self.slots, self._rows_within_budget(capacity, need)))
        if self._over_budget(rows, capacity, need):
            # positions and rows no reservation needs (a longer request's, not shrunk yet) would take the new row past
            # the budget: freed in the same reallocation (``fits`` counted the reservations alone)
            keep_rows, used = self._rows_in_use()
            capacity = max(max(self.reserved.values(), default=0), need, used)
            if self._over_budget(rows, capacity, need):
                rows = max(len(self.reserved) + 1, keep_rows)
        if (rows, capacity) != (self.rows, self.capacity):
            self._resize(rows, capacity)
        self.reserved[key] = need
        return need

    def _over_budget(self, rows: int, capacity: int, need: int) -> bool:
        """Whether buffers of ``rows`` x ``capacity`` positions, the reservations with ``need`` and the pinned bytes
        would hold more than the budget."""
        held = (self._dense_bytes(rows, capacity) + self.outside_bytes
                + self.extra_bytes_per_token * (sum(self.reserved.values()) + need))
        return self.budget_bytes is not None and held > self.budget_bytes

    def _rows_within_budget(self, capacity: int, need: int) -> int:
        """The most rows of ``capacity`` positions the budget holds beside the reservations (``need`` included)."""
        if self.budget_bytes is None:
            return self.slots
        spare = (self.budget_bytes - self.outside_bytes
                 - self.extra_bytes_per_token * (sum(self.reserved.values()) + need))
        per_row = capacity * (self.geometry.bytes_per_token + self.dense_extra_bytes_per_token)
        scratch = capacity * (self.scratch_rows * self.geometry.bytes_per_token + self.dense_extra_bytes_per_token)
        return max((spare - scratch) // max(per_row, 1), 0)

    def release(self, key: Hashable) -> None:
        """Return ``key``'s reservation (nothing when it holds none)."""
        self.reserved.pop(key, None)

    def shrink(self) -> bool:
        """Between steps: free what no reservation needs - down to the largest reservation's positions when that is
        less than allocated, and to twice the reservations' rows when three quarters of the rows are free (everything
        when nothing is reserved). A failed reallocation keeps the buffers as they are. Returns whether it shrank. With
        ``keep_allocation``, nothing while the buffers fit the budget. Followers grown past the rows' shape refit."""
        for follower in self.followers:
            follower.refit()
        if self.keep_allocation and (self.budget_bytes is None or self.held_bytes <= self.budget_bytes):
            return False
        rows, capacity = len(self.reserved), max(self.reserved.values(), default=0)
        if not rows:
            rows = capacity = 0
        elif capacity >= self.capacity and rows > self.rows // 4:
            return False
        elif rows <= self.rows // 4:
            rows = 2 * rows  # keep room to grow: shrinking to the last row would copy again at the next admission
        rows, capacity = min(max(rows, self._rows_in_use()[0]), self.rows), min(capacity, self.capacity)
        if (rows, capacity) == (self.rows, self.capacity):
            return False
        try:
            self._resize(rows, capacity)
        except KVAllocationError:
            return False
        return True

    def _rows_in_use(self) -> tuple[int, int]:
        """(rows, positions) a reallocation must keep: the running rows and the staged ones (their prefills)."""
        rows = max([self.active] + [r + 1 for r in self.staged])
        used = max([0] + self.lengths[: self.active] + [c.length for c in self.staged.values()])
        return rows, used

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One buffer (zeros: never NaN under a mask). Tests inject failures here."""
        g = self.geometry
        return torch.zeros(shape, dtype=g.dtype, device=g.device)

    def _resize(self, rows: int, capacity: int) -> None:
        """Reallocate every layer to [rows, kv_heads, capacity, head_dim], keeping the rows in use: every new buffer
        is allocated before any old one is replaced, so a failure changes nothing."""
        keep, used = self._rows_in_use()
        if rows < keep or capacity < used:
            raise ValueError(f"BatchCache: cannot resize to {rows} rows x {capacity} positions: rows in use hold more")
        g = self.geometry
        shape = (self._physical(rows), g.kv_heads, capacity, g.head_dim)
        new: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for _ in self.layers:
                new.append((self._allocate(shape), self._allocate(shape)))
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            new.clear()
            raise KVAllocationError(f"could not allocate the KV cache for {rows} rows x {capacity} positions "
                                    f"({shape[0] * capacity * g.bytes_per_token / 2**20:.1f} MiB)") from e
        for layer, (k, v) in zip(self.layers, new):
            if keep and used:
                k[:keep, :, :used] = layer.keys[:keep, :, :used]
                v[:keep, :, :used] = layer.values[:keep, :, :used]
            layer.keys, layer.values = k, v
        self.rows, self.capacity = rows, capacity
        self._index = None
        for follower in self.followers:  # KVAllocationError where one cannot (the rows stay resized: within budget)
            follower.follow(rows, capacity)

    # -------------------------------------------------------------- a forward
    def buffers(self) -> tuple:
        """The buffers' addresses and shapes (``buffer_keys``): a captured graph is recaptured when they change."""
        return buffer_keys(t for layer in self.layers for t in (layer.keys, layer.values))

    def width(self, n_new: int) -> int:
        """W: the key columns a forward of ``n_new`` tokens per row reads (the longest row's prefix + n_new; a
        fixed-shape forward's own width while it runs)."""
        if self.fixed is not None:
            return self.fixed[2]
        B = self._forward[0] if self._forward is not None else self.active
        return max(self.lengths[:B], default=0) + n_new

    def prepare(self, batch: int, n_new: int) -> int:
        """Get ready for a forward of rows [0, batch) with ``n_new`` tokens each; returns its width W. The rows'
        reservations hold every position it writes (padding included): a forward past them is a bug, refused before
        anything is written."""
        if batch > self.active:
            raise ValueError(f"a forward of {batch} rows; {self.active} are in use")
        need = max(self.lengths[:batch], default=0) + n_new
        if need > self.capacity:
            raise RuntimeError(f"BatchCache: a forward of {n_new} tokens per row needs {need} positions; the rows "
                               f"hold {self.capacity} (the draft is wider than the reservations allow)")
        self._forward, self._index = (batch, n_new), None
        return self.width(n_new)

    def write_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(rows [B, 1], positions [B, N], W) where the prepared forward's new keys go."""
        if self._forward is None:
            raise RuntimeError("BatchCache: a forward without prepare()")
        if self._index is None or self._index[0].device != device:
            B, N = self._forward
            start = torch.tensor(self.lengths[:B], dtype=torch.long)[:, None]  # [B, 1]
            pos = start + torch.arange(N)  # [B, N]
            self._index = (to_device(torch.arange(B)[:, None], device), to_device(pos, device), self.width(N))
        return self._index

    def commit(self, kept: Sequence[torch.Tensor | None]) -> None:
        """After the prepared forward: row b keeps the offsets ``kept[b]`` ([m] int64, increasing: 0 for its pending
        token, i+1 for accepted node i) of its new tokens, in that order; None keeps none (a row that leaves). One
        gather per layer for the rows whose kept offsets are not a prefix (trees)."""
        B, N = self._forward
        moves_src, moves_dst, moves_row = [], [], []  # positions copied within rows: from, to, the row
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
            rows, src, dst = (to_device(m, device, torch.long) for m in (moves_row, moves_src, moves_dst))  # staged
            for layer in self.layers:
                for buf in (layer.keys, layer.values):
                    buf[rows, :, dst] = buf[rows, :, src]  # gathered before written: sources are read first
        self._forward, self._index = None, None

    # -------------------------------------------------------------- rows joining and leaving
    def stage(self) -> RowCache:
        """A free row outside the running ones for a joining request to prefill into (its reservation allocated it)."""
        for row in range(self.active, self.rows):
            if row not in self.staged:
                self.staged[row] = RowCache(self, row)
                return self.staged[row]
        raise RuntimeError(f"BatchCache: no reserved row is free to prefill into ({self.rows} allocated, "
                           f"{self.active} running, {len(self.staged)} prefilling)")

    def unstage(self, staged: RowCache) -> None:
        """Its request left during its prefill: the row is free again."""
        if self.staged.get(staged.row) is staged:
            del self.staged[staged.row]

    def join_staged(self, staged: RowCache) -> int:
        """A prefilled request joins: its staged row becomes the next running row (swapped with what lies there, another
        request's staged row or nothing), without copying its cache anywhere else. Returns the row."""
        if self.staged.get(staged.row) is not staged:
            raise RuntimeError(f"BatchCache: row {staged.row} is not staged by this prefill")
        row, target = staged.row, self.active
        del self.staged[row]
        if row != target:
            other = self.staged.pop(target, None)
            n = max(staged.length, other.length if other is not None else 0)
            if n:
                for layer in self.layers:
                    for buf in (layer.keys, layer.values):
                        buf[[row, target], :, :n] = buf[[target, row], :, :n]  # the right side is a copy: a swap
            if other is not None:
                for layer in other.layers:
                    layer.row = row
                other.row = row
                self.staged[row] = other
            for layer in staged.layers:
                layer.row = target
            staged.row = target
        self.lengths[target] = staged.length
        self.active += 1
        return target

    def reset(self) -> None:
        """Drop every row (their requests failed); reservations stay until released."""
        self.lengths = [0] * self.slots
        self.active = 0
        self.staged.clear()
        self._forward, self._index = None, None

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
        return (f"BatchCache(slots={self.slots}, rows={self.rows}, capacity={self.capacity}, active={self.active}, "
                f"lengths={self.lengths[: self.active]})")

    def describe(self) -> dict[str, Any]:
        return {"slots": self.slots, "rows": self.rows, "capacity": self.capacity, "active": self.active,
                "reserved": sum(self.reserved.values()), "held_bytes": self.held_bytes,
                "budget_bytes": self.budget_bytes}
