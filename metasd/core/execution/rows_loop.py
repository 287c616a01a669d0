"""A fixed-shape drafting loop - a greedy chain of k tokens or a top-k tree - for many requests at once over their
drafter's rows (``DraftRows``), in ONE CUDA graph per (rows, width) bucket where captured ("A batch at GPU speed";
the one-request form is ``draft_loop.DraftLoop``).

Why: over rows, a scheduler's static tree of L levels costs its catch-up and L - 1 level forwards for the whole batch,
each a replayed graph; SGLang captures the whole multi-step draft as one graph per batch size. Here the levels of R
rows run as one: the tree's shape (``draft_loop.tree_shape``) is the same for every row, only the tokens and each row's
committed length ``past_r`` differ, and both sit in static device buffers:

    level 0 = topk(root logits, w_0)                                          # [R, w_0]
    for each level d fed (all but the last): q = its nodes, [start, end) their indices
        write  = (row r, past_r + start .. end - 1)                           # [R, q]
        pos    = past_r + depth(node) - 1                                     # [R, q]
        mask   = (column < past_r) | ancestors-or-self among nodes 0..end-1 at columns past_r + j   # [R, q, W]
        logits = drafter(level d tokens, pos, mask) over keys[rows, :, :W]    # [R, q, vocab]
        level d+1 = topk(logits, w_{d+1}) per node                            # [R, q * w_{d+1}]
    out = all levels' tokens                                                  # [R, n]

R is the batch rounded up to a power of two (``batch_runner.row_bucket``), W the longest row's past + the nodes fed
rounded up to 256: a padding row has past 0, zero root logits and its row index at the scratch row, so it writes and
reads there only. Each row's length is set to past_r + the nodes fed after the run (the fed levels' keys stay beyond
its committed length until its next catch-up crops them), as ``DraftLoop`` leaves a cache. ``capture=False`` runs the
same buffers eagerly: the CPU path, which the tests compare with the requests drafting alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .batch_runner import ROW_BUCKETS, row_bucket
from .draft_loop import level_constants, tree_shape
from .graph_runner import RunnerStats
from .draft_batch import batched_logits
from .kv_memory import RESERVATION_BUCKET, bucketed


@dataclass
class _Buffers:
    """The static buffers of one (R, W) bucket and, once captured, its graph."""

    root: torch.Tensor  # [R, vocab] the logits after each row's last committed token
    past: torch.Tensor  # [R] int64 each row's committed length
    rows: torch.Tensor  # [R] int64 each row's index in the buffers (padding: the scratch row)
    out: torch.Tensor  # [R, n] int64 the drafted tokens
    graph: object | None = field(default=None)


class RowsLoop:
    """The drafting loop of tree shape ``widths`` (every node at level d has ``widths[d]`` children; a chain:
    ``[1] * k``) over ``rows`` (a ``DraftRows``) for many rows at once (module docstring); ``capture``: one CUDA graph
    per (rows, width) bucket."""

    def __init__(self, rows: Any, widths: Sequence[int], *, capture: bool, width_bucket: int = RESERVATION_BUCKET,
                 row_buckets: Sequence[int] = ROW_BUCKETS):
        self.owner, self.capture = rows, capture
        self.widths = tuple(int(w) for w in widths)
        self.parents, self.levels = tree_shape(self.widths)
        self.fed = self.levels[-1][0]  # nodes fed to the drafter: every level but the last
        self.width_bucket, self.row_buckets = width_bucket, tuple(row_buckets)
        self._levels = level_constants(self.parents, self.levels, rows.geometry.device)
        self.shapes: dict[tuple[int, int], _Buffers] = {}
        self._columns: dict[int, torch.Tensor] = {}
        self._buffers: tuple | None = None
        self.stats = RunnerStats()

    @torch.inference_mode()
    def run(self, caches: Sequence[Any], roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """caches: the rows' ``RowKVCache`` s (each holding its request's committed tokens); roots: [vocab] each, on
        the device, the logits after each row's last committed token. Returns each row's tree tokens [n] on the
        device (copies), levels in order; each row's length is left at its past + the nodes fed."""
        owner = self.owner
        B = len(caches)
        past = [c.get_seq_length() for c in caches]
        if self.fed == 0:  # one level: no forward
            return [r.reshape(1, -1).topk(self.widths[0], dim=-1).indices.reshape(-1) for r in roots]
        width = bucketed(max(past) + self.fed, self.width_bucket)
        owner.grow(capacity=width)  # outside any capture: may reallocate (the graphs then drop below)
        R = row_bucket(B, owner.rows, self.row_buckets)
        if self.capture and self._buffers != owner.buffers():
            for shape in self.shapes.values():
                shape.graph = None  # they wrote the old buffers
            self._buffers = owner.buffers()
        shape = self.shapes.get((R, width))
        if shape is None or shape.root.shape[-1] != roots[0].shape[-1]:
            shape = self.shapes[(R, width)] = self._new_shape(R, width, roots[0])
        if width not in self._columns:
            self._columns[width] = torch.arange(width, device=owner.geometry.device)
        shape.root.zero_()
        shape.root[:B].copy_(torch.stack([r.reshape(-1) for r in roots]))
        index = torch.full((R,), owner.rows, dtype=torch.long)  # [R]: padding at the scratch row, past 0
        index[:B] = torch.tensor([c.row for c in caches], dtype=torch.long)
        lengths = torch.zeros(R, dtype=torch.long)
        lengths[:B] = torch.tensor(past, dtype=torch.long)
        shape.rows.copy_(index, non_blocking=True)
        shape.past.copy_(lengths, non_blocking=True)
        if not self.capture:
            self.stats.eager += 1
            self._loop(shape, width)
        elif shape.graph is None:
            what = f"the drafting loop {list(self.widths)} of {R} rows over {width} columns"
            shape.graph = self.stats.capture(lambda: self._loop(shape, width), owner.geometry.device, what)
        else:
            shape.graph.replay()
            self.stats.replays += 1
        for cache, p in zip(caches, past):
            cache.set_length(p + self.fed)
        return list(shape.out[:B].clone().unbind(0))

    def _new_shape(self, R: int, width: int, root: torch.Tensor) -> _Buffers:
        dev = self.owner.geometry.device
        return _Buffers(root=torch.zeros(R, root.shape[-1], dtype=root.dtype, device=dev),
                        past=torch.zeros(R, dtype=torch.long, device=dev),
                        rows=torch.zeros(R, dtype=torch.long, device=dev),
                        out=torch.zeros(R, len(self.parents), dtype=torch.long, device=dev))

    def _loop(self, shape: _Buffers, width: int) -> None:
        """The loop itself on the static buffers (module docstring): what a graph captures."""
        past, rows, columns = shape.past, shape.rows, self._columns[width]
        R = past.shape[0]
        level = shape.root.topk(self.widths[0], dim=-1).indices  # [R, w_0]
        drafted = [level]
        for (nodes, depth, fed, seen), w_next in zip(self._levels, self.widths[1:]):
            q, end = seen.shape
            mask = (columns[None, None, :] < past[:, None, None]).expand(R, q, width).clone()  # [R, q, W]: the prefix
            mask.scatter_(2, (past[:, None, None] + fed).expand(R, q, end), seen.expand(R, q, end))  # the tree part
            write = past[:, None] + nodes  # [R, q]: this level's keys at past_r + node index
            self.owner.fixed = (rows[:, None].expand(R, q), write, width, rows)
            try:
                logits = self._forward(level, past[:, None] + depth, mask)  # [R, q, vocab]
            finally:
                self.owner.fixed = None
            level = logits.topk(w_next, dim=-1).indices.reshape(R, -1)  # [R, q * w_next]
            drafted.append(level)
        shape.out.copy_(torch.cat(drafted, dim=1))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One drafter forward of a level for every row: ids, positions [R, q]; mask [R, q, W]. Logits [R, q, V]."""
        return batched_logits(self.owner.model, self.owner.head, self.owner, input_ids=ids, position_ids=positions,
                              attention_mask=mask[:, None])

    def describe(self) -> dict:
        return {"widths": list(self.widths), "capture": self.capture, "shapes": sorted(self.shapes),
                **self.stats.describe()}


@dataclass
class RowsLoopFeed:
    """One request's whole fixed-shape drafting loop over its row, the feed its drafting loop yields: the round's
    feeds of one ``RowsLoop`` run as one (``run_together``). Returns the tree's tokens [n] on the device."""

    loop: RowsLoop
    cache: Any  # the request's RowKVCache
    root: torch.Tensor  # [vocab] the logits after its last committed token

    @property
    def length(self) -> int:
        return 1

    def batch_key(self) -> tuple[str, int]:
        return "rows_loop", id(self.loop)

    def run(self) -> torch.Tensor:
        return self.loop.run([self.cache], [self.root])[0]

    @staticmethod
    def run_together(feeds: Sequence["RowsLoopFeed"]) -> list[torch.Tensor]:
        return feeds[0].loop.run([f.cache for f in feeds], [f.root for f in feeds])
