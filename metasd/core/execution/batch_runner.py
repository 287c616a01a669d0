"""The scheduler's batched verify forward at fixed (rows, tokens, width) shapes, captured as CUDA graphs where CUDA is
(docs/architecture.md, "The execution layer"; the one-request form is ``graph_runner.py``).

Why: a GPU forward of a few tokens per row is bound by the host launching its kernels, flat from 1 to 32 rows
(BENCHMARKS.md, "On a GPU"), so the batch's verify forward should be one replayed graph. A graph replays fixed
shapes at fixed addresses; the batch's [B, N] forward over W key columns (``batch_verifier.batch_inputs``) is padded to

- a **rows bucket** R: B rounded up to a power of two (1, 2, 4, ..., 64), never past the rows the cache allocated;
- a **token bucket** T: N rounded up as in ``graph_runner.TOKEN_BUCKETS`` (1, 2, 4, ..., 128), R x T at most
  ``MAX_FIXED_TOKENS`` (1,024: a shape's logits stay allocated; a wider forward runs eagerly at its own shape);
- a **width bucket** W: the longest row's prefix + N rounded up to 256 (``RESERVATION_BUCKET``), never past the rows'
  capacity - a short batch never attends over a long request's reservation.

Padding never touches a request's cache: the tokens of the padding rows (B..R-1) and the padding tokens of real rows
(N..T-1) write their keys into the cache's scratch row (``BatchCache.scratch_rows``, allocated beside the rows and
counted in the KV budget) - a padding row may be a joining request's staged prefill, and a real row's positions past
its length + N may lie past its capacity. Each padding query sees column 0 of its row only, so its attention stays
finite; no real query sees a padding key.

Static buffers per (R, T, W): ids, position ids, the 4-D mask [R, 1, T, W] and the write rows / positions [R, T];
static outputs per (R, T), shared by every width: logits [R, T, vocab] and the hidden states asked for - the graph
copies into them, so what a capture allocates inside is freed for the next capture from the same pool. A step copies
its host-built inputs in (one copy each; a chain drafted on the device is copied there device to device), replays -
capturing the shape the first time it is met - and returns copies of rows [:B, :N]. Graphs read the cache's buffers by
address: a reallocation (a request joining past the allocated rows or capacity) drops them, recaptured as met - so the
cache keeps its buffers between steps while they fit the budget and grows their positions by doubling
(``BatchCache.keep_allocation``): a few reallocations over a server's life, not one each time the longest request
leaves.

``capture=False`` runs exactly the same buffers, padding and writes eagerly: the CPU path, which the tests check
against ``Engine.generate`` (greedy identity with rows joining, leaving and staged beside the batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .batch_cache import BatchCache
from .draft_batch import batched_logits
from .graph_runner import TOKEN_BUCKETS, RunnerStats, token_bucket
from .kv_cache import cache_kwargs
from .kv_memory import RESERVATION_BUCKET, bucketed

#: row counts a batched forward is padded to (never past the rows allocated)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: the most tokens (rows x tokens a row, padded) a fixed-shape forward runs: its logits [R, T, vocab] stay allocated
#: for the next forward of its shape (1,024 x the 1.5B's vocabulary in bf16: 311 MB), so wider ones run eagerly
MAX_FIXED_TOKENS = 1024


def output_width(model: torch.nn.Module, head: torch.nn.Module | None = None) -> int:
    """The logits' width of a forward of ``model`` (through ``head``, a draft head over its hidden states, where
    given): its output embeddings' rows, as a quantized head holds them too."""
    if head is not None and getattr(head, "vocab_size", None):
        return int(head.vocab_size)
    out = model.get_output_embeddings()
    rows = getattr(out, "out_features", None)
    return int(rows) if rows else int(out.weight.shape[0])


def row_bucket(batch: int, allocated: int, buckets: Sequence[int] = ROW_BUCKETS) -> int:
    """The rows a forward of ``batch`` rows runs: the smallest bucket holding them, capped at the rows ``allocated``
    (and ``batch`` itself beyond the largest bucket)."""
    return min(next((b for b in buckets if b >= batch), batch), max(allocated, batch))


@dataclass
class _Inputs:
    """The static input buffers of one (R, T, W) shape and, once captured, its graph."""

    ids: torch.Tensor  # [R, T] int64
    positions: torch.Tensor  # [R, T] int64
    mask: torch.Tensor  # [R, 1, T, W] bool
    rows: torch.Tensor  # [R, T] int64: the cache row each token's key goes to
    write: torch.Tensor  # [R, T] int64: its position there
    read: torch.Tensor  # [R] int64: the cache row each forward row attends over (DraftRows; a BatchCache: [:R])
    graph: object | None = None  # torch.cuda.CUDAGraph


class BatchGraphRunner:
    """Batched forwards of ``model`` over ``cache`` at fixed (rows, tokens, width) shapes, replayed from CUDA graphs
    when ``capture`` (module docstring): the scheduler's verify forward over its ``BatchCache``, or a drafting level of
    many requests over their drafter's ``DraftRows`` (draft_rows.py: ``head``, a draft head over the base model's last
    hidden states, where the drafter has one). ``hidden_layers``: the residual streams returned beside the logits.
    Made before the cache allocates anything (it takes a scratch row of the cache)."""

    def __init__(self, model: torch.nn.Module, cache: "BatchCache | Any", *, capture: bool,
                 hidden_layers: Sequence[int] = (), buckets: Sequence[int] = TOKEN_BUCKETS,
                 row_buckets: Sequence[int] = ROW_BUCKETS, width_bucket: int = RESERVATION_BUCKET,
                 max_tokens: int = MAX_FIXED_TOKENS, head: torch.nn.Module | None = None,
                 label: str = "the batched verify forward"):
        if cache.rows:
            raise ValueError("BatchGraphRunner: the cache's scratch row must be set before it allocates its rows")
        if head is not None and hidden_layers:
            raise ValueError("BatchGraphRunner: a draft head's forward returns no hidden states")
        cache.scratch_rows, cache.keep_allocation = 1, True
        self.model, self.cache, self.capture, self.head = model, cache, capture, head
        self.label = label  # what the capture log calls its forwards
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        self.buckets, self.row_buckets, self.width_bucket = tuple(buckets), tuple(row_buckets), width_bucket
        self.max_tokens = max_tokens
        self.device = model.device
        self.shapes: dict[tuple[int, int, int], _Inputs] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._buffers: tuple | None = None
        self.stats = RunnerStats()

    def _bucket(self, batch: int, tokens: int) -> tuple[int, int] | None:
        """(R, T) of a forward of ``batch`` rows x ``tokens`` tokens a row; None: it runs eagerly at its own shape
        (past the largest token bucket, or more than ``max_tokens`` padded)."""
        if tokens > self.buckets[-1]:
            return None
        R, T = row_bucket(batch, self.cache.rows, self.row_buckets), token_bucket(tokens, self.buckets)
        return (R, T) if R * T <= self.max_tokens else None

    def fits(self, batch: int, tokens: int) -> bool:
        """Whether the forward runs at a fixed shape (else the caller runs it eagerly)."""
        return self._bucket(batch, tokens) is not None

    def padded(self, batch: int, tokens: int) -> tuple[int, int]:
        """(R, T): the rows and tokens a row a forward of ``batch`` rows x ``tokens`` tokens a row runs (its own where
        it runs eagerly)."""
        return self._bucket(batch, tokens) or (batch, tokens)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                on_device: dict[int, tuple[int, torch.Tensor]], rows: Sequence[int] | None = None,
                starts: Sequence[int] | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """A forward of B rows, padded: the prepared forward (``BatchCache.prepare``) of the running rows 0..B-1 after
        their ``lengths``, or (``rows``, ``starts``) rows of the cache after ``starts`` positions each (``DraftRows``).

        ids, positions: [B, N] host int64 (``batch_inputs``); mask: [B, 1, N, Wn] host bool over the cache's columns
        0..Wn-1; on_device: row -> (column, tokens on the device written at ids[row, column:]: a draft not read by the
        host). Returns logits [B, N, vocab] and {layer: [B, N, d]}, copies the next forward cannot overwrite."""
        B, N = ids.shape
        R, T = self._bucket(B, N)
        W = min(bucketed(mask.shape[-1], self.width_bucket), self.cache.capacity)
        if self.capture and self._buffers != self.cache.buffers():
            for shape in self.shapes.values():
                shape.graph = None  # they wrote the old buffers
            self._buffers = self.cache.buffers()
        shape = self.shapes.get((R, T, W))
        if shape is None:
            shape = self.shapes[(R, T, W)] = self._new_shape(R, T, W)
        rows = list(range(B)) if rows is None else list(rows)
        starts = list(self.cache.lengths[:B]) if starts is None else list(starts)
        self._fill(shape, ids, positions, mask, rows, starts)
        for row, (column, tokens) in on_device.items():
            shape.ids[row, column: column + len(tokens)].copy_(tokens)
        if not self.capture:
            self.stats.eager += 1
            self._run(shape)
        elif shape.graph is None:
            self._capture(shape)  # its capture ran the forward on these inputs
        else:
            shape.graph.replay()
            self.stats.replays += 1
        logits, hidden = self.outputs[(R, T)]
        return logits[:B, :N].clone(), {layer: h[:B, :N].clone() for layer, h in hidden.items()}

    # ------------------------------------------------------------------------------------------ internals
    def _new_shape(self, R: int, T: int, W: int) -> _Inputs:
        dev = self.device

        def zeros(*size, dtype=torch.long):
            return torch.zeros(*size, dtype=dtype, device=dev)
        if (R, T) not in self.outputs:  # outside any capture: shared by every width of (R, T)
            vocab = output_width(self.model, self.head)
            d = self.model.config.get_text_config().hidden_size
            dtype = self.model.dtype
            self.outputs[(R, T)] = (zeros(R, T, vocab, dtype=dtype),
                                    {layer: zeros(R, T, d, dtype=dtype) for layer in self.hidden_layers})
        return _Inputs(ids=zeros(R, T), positions=zeros(R, T), mask=zeros(R, 1, T, W, dtype=torch.bool),
                       rows=zeros(R, T), write=zeros(R, T), read=zeros(R))

    def _fill(self, shape: _Inputs, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
              rows: list[int], starts: list[int]) -> None:
        """Write the forward's inputs, padded, into the shape's static buffers (built on the host, one copy each):
        forward row b is cache row ``rows[b]``, its tokens written after ``starts[b]`` positions."""
        B, N = ids.shape
        R, _, T, W = shape.mask.shape
        cache = self.cache
        host_ids = torch.zeros(R, T, dtype=torch.long)  # [R, T]
        host_ids[:B, :N] = ids
        host_pos = torch.zeros(R, T, dtype=torch.long)  # [R, T]: padding at position 0
        host_pos[:B, :N] = positions
        host_mask = torch.zeros(R, 1, T, W, dtype=torch.bool)  # [R, 1, T, W]
        host_mask[:B, :, :N, : mask.shape[-1]] = mask
        host_mask[B:, 0, :, 0] = True  # a padding query sees column 0 of its row: finite, never read
        host_mask[:B, 0, N:, 0] = True
        read = torch.full((R,), cache.rows, dtype=torch.long)  # [R]: the rows read, padding the scratch row's ...
        read[:B] = torch.tensor(rows, dtype=torch.long)
        to_row = read[:, None].repeat(1, T)  # [R, T]: ... and where keys go: padding tokens to the scratch row ...
        to_row[:B, N:] = cache.rows
        write = torch.arange(T).clamp(max=cache.capacity - 1).expand(R, T).clone()  # ... at positions 0..T-1
        write[:B, :N] = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(N)
        for buf, host in ((shape.ids, host_ids), (shape.positions, host_pos), (shape.mask, host_mask),
                          (shape.rows, to_row), (shape.write, write), (shape.read, read)):
            buf.copy_(host, non_blocking=True)

    def _run(self, shape: _Inputs) -> None:
        """The forward on the shape's buffers, its outputs copied into the (R, T) outputs (as a replay leaves them)."""
        R, _, T, W = shape.mask.shape
        self.cache.fixed = (shape.rows, shape.write, int(W), shape.read)
        inputs = dict(input_ids=shape.ids, position_ids=shape.positions, attention_mask=shape.mask)
        try:
            if self.head is None:
                out = self.model(**inputs, **cache_kwargs(self.model, self.cache), use_cache=True,
                                 output_hidden_states=bool(self.hidden_layers))
                scores = out.logits  # [R, T, vocab]
            else:  # a drafter's draft head (no hidden states asked: __init__)
                scores = batched_logits(self.model, self.head, self.cache, **inputs)  # [R, T, vocab]
        finally:
            self.cache.fixed = None
        logits, hidden = self.outputs[(R, T)]
        logits.copy_(scores)
        for layer, h in hidden.items():
            h.copy_(out.hidden_states[layer])

    def _capture(self, shape: _Inputs) -> None:
        R, _, T, W = shape.mask.shape
        what = f"{self.label} of {R} rows x {T} tokens over {W} columns"
        shape.graph = self.stats.capture(lambda: self._run(shape), self.device, what)

    def describe(self) -> dict:
        return {"capture": self.capture, "shapes": sorted(self.shapes), **self.stats.describe()}
