"""A drafter's whole drafting loop at a fixed shape - a chain of k tokens or a fixed-shape top-k tree - in one CUDA
graph where CUDA is (docs/architecture.md, "The execution layer").

Why: drafting a tree of L levels (a chain of k tokens: k - 1 levels fed) is L - 1 drafter forwards after the catch-up;
on a GPU each is a launch-bound forward costing about what the verifier's forward costs (BENCHMARKS.md). Captured
together they launch as one graph, so a step costs the catch-up, one replay and the verifier's forward.

The shape is fixed by ``widths`` (every node at level d has ``widths[d]`` children; a chain is ``[1] * k``): node i's
parent, depth and ancestors are known before drafting (``tree_shape``), and only the tokens are device values. The
loop, given the logits after the last committed token (the catch-up's: a ``GraphRunner`` forward, ``DraftLoops``):

    level 0 = topk(root logits, w_0)                                     # [w_0]
    for each level d fed (all but the last): q = its nodes, [start, end) their indices
        write   = past + (start .. end - 1)                              # [q] cache positions written
        pos     = past + depth(node) - 1                                 # [q] position ids
        mask    = (column < past) | ancestors-or-self among nodes 0..end-1, at columns past + j   # [q, W]
        logits  = drafter(level d tokens, pos, mask) over the cache's first W columns             # [q, vocab]
        level d+1 = topk(logits, w_{d+1}) per row                        # [q * w_{d+1}]
    out = all levels' tokens                                             # [n]

Everything that varies from step to step - the committed length ``past`` and the root logits - sits in static device
buffers, so the same kernels replay at every step. The attended width W is the committed length + the nodes fed,
rounded up to ``RESERVATION_BUCKET``: one graph per width bucket met, captured the first time (two warm-up runs on a
side stream first), dropped when the cache's buffers move (a longer request: recaptured as met). Columns past the
fed nodes are masked, so the result is the eager loop's (``static_tree.StaticTreeDrafter``, a greedy chain); the fed
levels' keys stay in the cache beyond its committed length until the next catch-up crops them, as the eager loop
leaves them (the cache's length is set to past + nodes fed).

``capture=False`` runs the same buffers, masks and writes eagerly: the CPU path, which the tests compare with the
eager drafting loop token for token. Top-k is not a sample, so the loop is the same under greedy decoding and under
sampling (a static tree is verified by sample-and-match); a chain drawn by sampling is not this loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .draft_batch import forward_logits
from .graph_runner import GraphRunner, RunnerStats
from .kv_cache import cache_length
from .kv_memory import RESERVATION_BUCKET, KVGeometry, bucketed
from .staging import to_device
from .static_cache import StaticKVCache, new_cache
from .tree import tree_layout


def tree_shape(widths: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The parents of a tree where every node at level d has ``widths[d]`` children (levels in order, each node's
    children together), and each level's node range [start, end)."""
    parents: list[int] = []
    levels: list[tuple[int, int]] = []
    above = [-1]
    for w in widths:
        start = len(parents)
        parents += [p for p in above for _ in range(w)]
        levels.append((start, len(parents)))
        above = list(range(start, len(parents)))
    return parents, levels


def level_constants(parents: Sequence[int], levels: Sequence[tuple[int, int]], device: torch.device
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per level fed (every level but the last) of a fixed tree shape (``tree_shape``), on ``device``: its nodes [q],
    their depth - 1 [q], nodes 0..end-1 [end], and each node's ancestors-or-self among those [q, end] - what a fixed
    drafting loop builds its writes, positions and masks from."""
    layout = tree_layout(tuple(parents))  # index 0: the root, node i at i + 1
    return [(torch.arange(s, e, device=device), to_device([layout.depths[i + 1] - 1 for i in range(s, e)], device),
             torch.arange(e, device=device), to_device(layout.mask[s + 1: e + 1, 1: e + 1].clone(), device))
            for s, e in levels[:-1]]


class DraftLoop:
    """The drafting loop of one fixed tree shape over ``cache`` (module docstring): ``run(root_logits)`` drafts the
    tree's tokens on the device, replaying a CUDA graph per width bucket when ``capture``.

    model, head: the drafter (``head``: a draft head over the base model's last hidden states, or None);
    widths: children of every node per level, root first."""

    def __init__(self, model: nn.Module, head: nn.Module | None, cache: StaticKVCache, widths: Sequence[int], *,
                 capture: bool, width_bucket: int = RESERVATION_BUCKET):
        self.model, self.head, self.cache, self.capture = model, head, cache, capture
        self.widths = tuple(int(w) for w in widths)
        self.parents, self.levels = tree_shape(self.widths)
        self.width_bucket = width_bucket
        self.device = model.device
        self.fed = self.levels[-1][0]  # nodes fed to the drafter: every level but the last
        dev = self.device
        self._level_consts = level_constants(self.parents, self.levels, dev)
        self._past = torch.zeros(1, dtype=torch.long, device=dev)  # the committed length, a device scalar
        self._out = torch.zeros(len(self.parents), dtype=torch.long, device=dev)  # [n] the drafted tokens
        self._root: torch.Tensor | None = None  # [vocab] the logits after the last committed token
        self._graphs: dict[int, object] = {}  # width bucket -> torch.cuda.CUDAGraph
        self._columns: dict[int, torch.Tensor] = {}  # width bucket -> arange(W) on the device
        self._buffers: tuple | None = None
        self.stats = RunnerStats()

    @torch.inference_mode()
    def run(self, root_logits: torch.Tensor) -> torch.Tensor:
        """root_logits: [vocab] on the device, after the last committed token (the cache holds the committed
        tokens). Returns the tree's tokens [n] on the device (a copy), levels in order; the cache's length is left
        at the committed length + the nodes fed."""
        past = cache_length(self.cache)
        if self.fed == 0:  # one level: no forward
            return root_logits.reshape(1, -1).topk(self.widths[0], dim=-1).indices.reshape(-1)
        width = bucketed(past + self.fed, self.width_bucket)
        if not self.cache.allocated:
            self.cache.allocate(KVGeometry.of(self.model))
        self.cache.reserve(width)  # outside any capture: may reallocate (the graphs then drop below)
        root = root_logits.reshape(-1)
        if self._root is None or self._root.shape != root.shape or self._root.dtype != root.dtype:
            self._root = torch.empty_like(root)
            self._graphs.clear()
        if self.capture and self._buffers != self.cache.buffers():
            self._graphs.clear()  # the graphs wrote the old buffers
            self._buffers = self.cache.buffers()
        self._root.copy_(root)
        self._past.fill_(past)
        if width not in self._columns:
            self._columns[width] = torch.arange(width, device=self.device)
        if not self.capture:
            self.stats.eager += 1
            self._loop(width)
        elif width not in self._graphs:
            self._graphs[width] = self.stats.capture(lambda: self._loop(width), self.device,
                                                     f"the drafting loop {list(self.widths)} over {width} columns")
        else:
            self._graphs[width].replay()
            self.stats.replays += 1
        self.cache.set_length(past + self.fed)
        return self._out.clone()

    def _loop(self, width: int) -> None:
        """The loop itself on the static buffers (module docstring): what a graph captures."""
        past, columns = self._past, self._columns[width]
        level = self._root.reshape(1, -1).topk(self.widths[0], dim=-1).indices.reshape(-1)  # [w_0]
        drafted = [level]
        for (nodes, depth, fed, seen), w_next in zip(self._level_consts, self.widths[1:]):
            q, end = seen.shape
            mask = (columns < past).expand(q, width).clone()  # [q, W]: the committed prefix
            mask.scatter_(1, (past + fed).expand(q, end), seen)  # the tree part, at columns past + node
            self.cache.fixed = (past + nodes, width)  # this level's keys and values written at past + node index
            try:
                logits = self._forward(level, past + depth, mask)  # [q, vocab]
            finally:
                self.cache.fixed = None
            level = logits.topk(w_next, dim=-1).indices.reshape(-1)  # [q * w_next]
            drafted.append(level)
        self._out.copy_(torch.cat(drafted))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One drafter forward of a level: ids, positions [q]; mask [q, W]. Logits [q, vocab]."""
        return forward_logits(self.model, self.head, self.cache, False, input_ids=ids[None],
                              position_ids=positions[None], attention_mask=mask[None, None])

    def describe(self) -> dict:
        return {"widths": list(self.widths), "capture": self.capture, "graphs": sorted(self._graphs),
                **self.stats.describe()}


@dataclass
class LoopFeed:
    """A whole fixed-shape drafting loop as the one feed a drafting loop yields (``draft_batch``): it runs alone, and
    returns the tree's tokens [n] on the device."""

    loop: DraftLoop
    root: torch.Tensor  # [vocab] the logits after the last committed token

    def batch_key(self) -> None:
        return None

    def run(self) -> torch.Tensor:
        return self.loop.run(self.root)


@dataclass
class CatchUpFeed:
    """A drafter's catch-up - the committed tokens its cache lacks, fed after it - as one fixed-shape forward
    (``GraphRunner``: a CUDA graph per token and width bucket where captured), the feed a drafting loop yields (it
    runs alone). Returns the logits after the last token [1, vocab]."""

    runner: GraphRunner
    ids: list[int]

    def batch_key(self) -> None:
        return None

    def run(self) -> torch.Tensor:
        m = len(self.ids)
        logits, _ = self.runner.forward(torch.tensor(self.ids, dtype=torch.long), torch.arange(m),
                                        torch.ones(m, m, dtype=torch.bool).tril())  # [m, vocab]
        return logits[-1:]


class DraftLoops:
    """A model drafter's fixed-shape forwards over ONE KV cache kept from request to request (a captured graph reads
    the cache's buffers by address): its catch-up (``catch_up``: a ``GraphRunner``) and its drafting loops (``feed``:
    one ``DraftLoop`` per tree shape met). ``capture``: CUDA graphs (else the same buffers run eagerly: the CPU
    check). A step then launches the catch-up's graph, the loop's graph and the verifier's."""

    def __init__(self, model: nn.Module, head: nn.Module | None, *, capture: bool, name: str | None = None):
        self.model, self.head, self.capture, self.name = model, head, capture, name
        self.cache: StaticKVCache | None = None
        self.loops: dict[tuple[int, ...], DraftLoop] = {}
        self.runner: GraphRunner | None = None

    def fresh_cache(self) -> StaticKVCache:
        """The kept cache, emptied for a new request (created the first time)."""
        if self.cache is None:
            self.cache = new_cache(self.model, name=self.name)
        self.cache.set_length(0)
        return self.cache

    def catch_up(self, ids: Sequence[int]) -> CatchUpFeed | None:
        """The feed of ``ids`` (host ints) after the kept cache at a fixed shape; None where they are more than the
        largest token bucket (a new request's prompt: fed eagerly, by index, into the same buffers)."""
        if self.cache is None:
            raise RuntimeError(f"{self.name}: a catch-up before the request's cache (fresh_cache)")
        if self.runner is None:
            self.runner = GraphRunner(self.model, self.cache, capture=self.capture, head=self.head)
        return CatchUpFeed(self.runner, list(ids)) if 0 < len(ids) <= self.runner.largest else None

    def feed(self, widths: Sequence[int], root_logits: torch.Tensor) -> LoopFeed:
        """The feed that drafts a tree of ``widths`` after ``root_logits`` ([vocab]) over the kept cache."""
        key = tuple(int(w) for w in widths)
        loop = self.loops.get(key)
        if loop is None:
            if self.cache is None:
                raise RuntimeError(f"{self.name}: a drafting loop before the request's cache (fresh_cache)")
            loop = self.loops[key] = DraftLoop(self.model, self.head, self.cache, key, capture=self.capture)
        return LoopFeed(loop, root_logits)

    def describe(self) -> dict:
        return {"capture": self.capture, "loops": [loop.describe() for loop in self.loops.values()],
                "catch_up": None if self.runner is None else self.runner.describe()}
