"""Fixed-shape forwards over a ``StaticKVCache``, captured as CUDA graphs where CUDA is (docs/architecture.md, "The
execution layer").

Why: on a GPU a 1.5B or 7B forward of a few tokens is bound by the host launching its few hundred kernels (~20 ms on
an H200, flat from 1 to 32 rows, BENCHMARKS.md); replaying a captured graph launches them as one. A graph replays
fixed shapes at fixed addresses, so a forward here has

- a **token bucket** b (1, 2, 4, ..., 128): the block's m tokens padded to b, every padding query seeing its prefix
  and itself (finite attention, nothing reads it);
- a **width bucket** W: the key columns attended, the committed length + b rounded up to 256 (``RESERVATION_BUCKET``),
  never the cache's whole capacity;
- **static input buffers** per (b, W): ids [1, b], position ids [1, b] (committed length + depth in the tree), the
  4-D boolean mask [1, 1, b, W] (the prefix, then tree ancestors and self), the cache positions written [b]
  (committed length + 0..b-1);
- **static outputs**: logits [1, b, vocab] and the hidden states asked for, copied out (rows [:m]) before the next
  replay overwrites them.

Each step fills the buffers (host-built, one copy each), replays the graph of its (b, W) - capturing it the first
time that pair is met, after two warm-up forwards on a side stream - and sets the cache's length to the committed
length + m. The padding's keys land beyond that length: garbage the mask hides and the next forward overwrites.
Graphs read the cache's buffers by address: when the cache reallocates (a longer request), the graphs are dropped and
recaptured as met. Capture seconds and the graphs' count are kept (``stats``).

``capture=False`` runs exactly the same buffers, buckets, masks and writes eagerly: the CPU path of this runner, which
the tests check against plain decoding (greedy identity, trees included). Tokens beyond the largest bucket (a prefill
chunk) do not come here: the caller runs them eagerly through the cache's ordinary path.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .draft_batch import forward_logits
from .kv_cache import cache_kwargs
from .kv_memory import RESERVATION_BUCKET, KVGeometry, bucketed
from .static_cache import StaticKVCache

log = logging.getLogger(__name__)

#: token counts a forward is padded to
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: graph settings a pool or a caller may ask for: auto = captured where CUDA is, eager elsewhere; fixed = the fixed
#: shapes and buffers a capture replays, run eagerly on any device (what a GPU runs, checked on a CPU)
GRAPH_MODES = ("auto", "on", "off", "fixed")


def resolve_graphs(graphs: str, device: torch.device, name: str) -> bool:
    """Whether forwards are captured: ``graphs`` is one of GRAPH_MODES ("fixed": never); "on" without CUDA is refused,
    naming the model and the device."""
    if graphs not in GRAPH_MODES:
        raise ValueError(f"{name}: graphs must be one of {list(GRAPH_MODES)}, got {graphs!r}")
    cuda = torch.device(device).type == "cuda"
    if graphs == "on" and not cuda:
        raise ValueError(f"{name}: graphs='on' needs a CUDA device; the model is on {device} (use 'auto' or 'off')")
    return cuda and graphs in ("auto", "on")


def token_bucket(n: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` tokens; None beyond the largest."""
    return next((b for b in buckets if b >= n), None)


def capture_graph(run: Callable[[], None], device: torch.device, pool) -> tuple[object, float, int]:
    """``run`` (work on static buffers only) captured as a CUDA graph in the memory ``pool``: two warm-up runs on a
    side stream, the capture, then one replay - a capture records the kernels without running them, so the outputs
    are this run's. Returns the graph, the seconds it took and the bytes the CUDA allocator reserved meanwhile (the
    graph's pool grown, warm-ups included)."""
    t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    graph.replay()
    torch.cuda.synchronize(device)
    return graph, time.perf_counter() - t0, torch.cuda.memory_reserved(device) - reserved


@dataclass
class _Shape:
    """The static buffers of one (tokens, width) shape and, once captured, its graph."""

    ids: torch.Tensor  # [1, b] int64
    positions: torch.Tensor  # [1, b] int64
    mask: torch.Tensor  # [1, 1, b, W] bool
    write: torch.Tensor  # [b] int64: cache positions written
    graph: object | None = None  # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None  # [1, b, vocab], the captured output
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, b, d]


@dataclass
class RunnerStats:
    """What capturing cost: graphs captured (over the runner's life, recaptures included), seconds, replays; and the
    memory pool the runner's graphs share."""

    captured: int = 0
    capture_s: float = 0.0
    capture_bytes: int = 0  # what the CUDA allocator reserved while capturing
    replays: int = 0
    eager: int = 0
    pool: object = field(default=None, repr=False)  # the CUDA graph memory pool the runner's captures share

    def capture(self, run: Callable[[], None], device: torch.device, what: str = "a forward") -> object:
        """``run`` captured (``capture_graph``) in the runner's pool, its seconds and memory counted and logged
        (``what`` it captures): the graph."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, seconds, held = capture_graph(run, device, self.pool)
        log.info("captured %s as a CUDA graph in %.2f s, %.1f MiB", what, seconds, held / 2 ** 20)
        self.captured, self.capture_s, self.capture_bytes = (self.captured + 1, self.capture_s + seconds,
                                                             self.capture_bytes + held)
        return graph

    def describe(self) -> dict:
        return {"captured": self.captured, "capture_s": round(self.capture_s, 3),
                "capture_mib": round(self.capture_bytes / 2 ** 20, 1), "replays": self.replays, "eager": self.eager}


class GraphRunner:
    """Forwards of ``model`` over ``cache`` at fixed (token, width) shapes, replayed from CUDA graphs when ``capture``
    (module docstring). ``hidden_layers``: the residual streams returned beside the logits."""

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, *, capture: bool,
                 hidden_layers: Sequence[int] = (), buckets: Sequence[int] = TOKEN_BUCKETS,
                 width_bucket: int = RESERVATION_BUCKET, head: torch.nn.Module | None = None):
        if head is not None and hidden_layers:
            raise ValueError("GraphRunner: a draft head's forward returns no hidden states")
        self.model, self.cache, self.capture, self.head = model, cache, capture, head
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        self.buckets, self.width_bucket = tuple(buckets), width_bucket
        self.device = model.device
        self.shapes: dict[tuple[int, int], _Shape] = {}
        self._buffers: tuple | None = None  # the cache buffers the graphs were captured over
        self.stats = RunnerStats()

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def fits(self, n: int) -> bool:
        return n <= self.largest

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, depth: torch.Tensor, block_mask: torch.Tensor
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """m new tokens after the cache's committed positions, in one fixed-shape forward.

        ids: [m] int64 on the host or the device; depth: [m] host int64, each token's depth below the committed prefix
        (0 for the first of a chain or the root of a tree); block_mask: [m, m] bool, token i sees token j among the new
        ones (itself and its ancestors). Returns logits [m, vocab] and {layer: [m, d]}, copies the next forward cannot
        overwrite."""
        m = len(ids)
        b = token_bucket(m, self.buckets)
        if b is None:
            raise ValueError(f"GraphRunner: {m} tokens in one forward; the largest bucket is {self.largest}")
        past = self.cache.get_seq_length()
        width = bucketed(past + b, self.width_bucket)
        if not self.cache.allocated:  # nothing prefilled (a one-token prompt)
            self.cache.allocate(KVGeometry.of(self.model))
        self.cache.reserve(width)  # outside any capture: may reallocate (the graphs then drop below)
        if self.capture and self._buffers != self.cache.buffers():
            self.shapes.clear()  # the graphs wrote the old buffers
            self._buffers = self.cache.buffers()
        shape = self.shapes.get((b, width))
        if shape is None:
            shape = self.shapes[(b, width)] = self._new_shape(b, width)
        self._fill(shape, past, ids, depth, block_mask)
        if not self.capture:
            self.stats.eager += 1
            self._run(shape, static=True)
        elif shape.graph is None:
            self._capture(shape)  # its capture ran the forward on these inputs
        else:
            shape.graph.replay()
            self.stats.replays += 1
        self.cache.set_length(past + m)
        logits = shape.logits[0, :m].clone()  # [m, vocab]
        return logits, {layer: h[0, :m].clone() for layer, h in shape.hidden.items()}

    # ------------------------------------------------------------------------------------------ internals
    def _new_shape(self, b: int, width: int) -> _Shape:
        dev = self.device
        return _Shape(ids=torch.zeros(1, b, dtype=torch.long, device=dev),
                      positions=torch.zeros(1, b, dtype=torch.long, device=dev),
                      mask=torch.zeros(1, 1, b, width, dtype=torch.bool, device=dev),
                      write=torch.zeros(b, dtype=torch.long, device=dev))

    def _fill(self, shape: _Shape, past: int, ids: torch.Tensor, depth: torch.Tensor, block: torch.Tensor) -> None:
        """Write this forward's inputs into the shape's static buffers (built on the host, one copy each)."""
        b, width = shape.mask.shape[-2:]
        m = len(ids)
        pad = torch.arange(m, b)
        host_ids = torch.zeros(1, b, dtype=torch.long)
        ids_on_host = ids.device.type == "cpu"
        if ids_on_host:
            host_ids[0, :m] = ids
        host_pos = torch.empty(1, b, dtype=torch.long)  # [1, b]: the tree's depths, padding continuing after them
        host_pos[0, :m] = past + depth
        host_pos[0, m:] = past + pad
        mask = torch.zeros(1, 1, b, width, dtype=torch.bool)  # [1, 1, b, W]
        mask[0, 0, :, :past] = True
        mask[0, 0, :m, past: past + m] = block
        mask[0, 0, pad, past + pad] = True
        for buf, host in ((shape.ids, host_ids), (shape.positions, host_pos), (shape.mask, mask),
                          (shape.write, past + torch.arange(b))):
            buf.copy_(host, non_blocking=True)
        if not ids_on_host:  # ids already on the device (a chain drafted there): copied there, not read
            shape.ids[0, :m].copy_(ids)

    def _run(self, shape: _Shape, static: bool = False) -> None:
        """The forward itself, on the shape's buffers; its outputs become the shape's outputs (``static``: copied into
        the shape's output buffers, which every forward of the shape overwrites - as a graph's replay does)."""
        b, width = shape.mask.shape[-2:]
        inputs = dict(input_ids=shape.ids, position_ids=shape.positions, attention_mask=shape.mask)
        self.cache.fixed = (shape.write, int(width))
        try:
            if self.head is None:
                out = self.model(**inputs, **cache_kwargs(self.model, self.cache), use_cache=True,
                                 output_hidden_states=bool(self.hidden_layers))
                logits, hidden = out.logits, {layer: out.hidden_states[layer] for layer in self.hidden_layers}
            else:  # a drafter's draft head over its base model's last hidden states
                logits, hidden = forward_logits(self.model, self.head, self.cache, False, **inputs)[None], {}
        finally:
            self.cache.fixed = None
        if not static or shape.logits is None:
            shape.logits, shape.hidden = logits, hidden
        else:
            shape.logits.copy_(logits)
            for layer, h in hidden.items():
                shape.hidden[layer].copy_(h)

    def _capture(self, shape: _Shape) -> None:
        """Capture the shape's forward (which also leaves this forward's outputs)."""
        b, width = shape.mask.shape[-2:]
        what = f"{'a draft head' if self.head is not None else 'a'} forward of {b} tokens over {width} columns"
        shape.graph = self.stats.capture(lambda: self._run(shape), self.device, what)

    def describe(self) -> dict:
        return {"capture": self.capture, "shapes": sorted(self.shapes), **self.stats.describe()}
