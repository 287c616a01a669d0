"""Trace-replayed acceptance at the captured drafting cost: a recorded static-tree arm (``static_tree``, alone or in a
cascade) replayed as the static tree drafter runs under ``graphs`` - its catch-up at a fixed shape and its whole
drafting loop in one run (``core/execution/draft_loop.py``: one CUDA graph each where captured) - instead of one
eager forward per recorded level (``TraceDrafter``, drafters/trace.py).

The acceptance is the trace's, as ``TraceDrafter`` relabels it; only the forwards differ. The loop drafts its own
tokens on the random-weight drafter and they are dropped: what the replay needs of it is its cost and the cache it
leaves - the nodes of the fed levels at the committed length + their index, which is where the recording fed them
(levels in order), so the accepted fed nodes are kept from there after the step as ``TraceDrafter`` keeps them. A step
where the arm ran no forward (the cascade's lookup was deep enough) runs none. A scheduler's forks replay as the
real drafter's forks draft: their catch-ups one forward over their rows, then the whole loop for every request drafting
it at once (``core/execution/rows_loop.py``); without fixed shapes, level by level as ``TraceDrafter`` does.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from metasd.core.execution.draft_batch import Drafting, Feed
from metasd.core.execution.draft_loop import DraftLoops, tree_shape
from metasd.core.execution.graph_runner import resolve_graphs
from metasd.core.execution.kv_cache import cache_length, crop_to
from metasd.core.execution.tree import Draft

from .trace import Trace, TraceDrafter, TraceMiss, TraceStep


class LoopTraceDrafter(TraceDrafter):
    """Replays a static-tree arm of ``widths`` (module docstring) through ``model``'s fixed-shape catch-up and drafting
    loop: CUDA graphs where ``graphs`` resolves to them; ``fixed_shapes`` runs the same buffers eagerly (the CPU
    check). Other arguments: ``TraceDrafter``'s."""

    def __init__(self, trace: Trace, arm: str, model: nn.Module, widths: Sequence[int], vocab: int | None = None,
                 name: str | None = None, graphs: str = "auto", fixed_shapes: bool = False):
        super().__init__(trace, arm, [model], vocab=vocab, name=name, graphs=graphs, fixed_shapes=fixed_shapes)
        capture = resolve_graphs(graphs, model.device, self.name)
        if not (capture or fixed_shapes):
            raise ValueError(f"{self.name}: graphs {graphs!r} on {model.device} runs no fixed shape; replay this arm "
                             "with TraceDrafter")
        self.widths = [int(w) for w in widths]
        #: the rows a recorded step may have fed: every level but the last, or (its tree cut to a depth by the tokens
        #: left) its first levels
        self.cut_rows = {0} | {end for _, end in tree_shape(self.widths)[1][:-1]}
        self.loops: DraftLoops | None = DraftLoops(model, None, capture=capture, name=self.name)

    def _fresh_caches(self) -> list:
        if self.loops is not None:
            return [self.loops.fresh_cache()]  # the loop's graphs read this cache by address
        return super()._fresh_caches()  # a fork: a row, as the real drafter's forks

    def _forked(self, cross_request: bool) -> None:
        super()._forked(cross_request)
        self.loops = None  # a fork replays the whole loop over its row, batched, as the real drafter's forks draft

    def _run_feeds(self, step: TraceStep, tokens: list[int], fed_as, draft: Draft, base: int,
                   slots: dict[int, tuple[int, int]]) -> Drafting:
        if self.loops is None and (self.rows is None or self.rows[0].sliding):
            return (yield from super()._run_feeds(step, tokens, fed_as, draft, base, slots))
        if not step.feeds:
            return 0
        rows = [row for f in step.feeds if not f.get("catch_up") for row in f["rows"]]
        if not any(f.get("catch_up") for f in step.feeds) or len(rows) not in self.cut_rows:
            raise TraceMiss(f"{self.name}: arm {self.arm!r} recorded {len(rows)} fed rows (and a catch-up: "
                            f"{any(f.get('catch_up') for f in step.feeds)}), not the static tree of widths "
                            f"{self.widths} (after a catch-up, its first levels: {sorted(self.cut_rows)} rows)")
        cache = self._caches[0]
        keep = min(self._cached[0], len(tokens) - 1, cache_length(cache))
        crop_to(cache, keep)
        ids = tokens[keep:]
        fixed = self.loops.catch_up(ids) if self.loops is not None else None  # a fork's: over its row (a Feed)
        logits = yield fixed or Feed(self.models[0], None, cache, ids, last_only=True)
        self._cached[0] = len(tokens)
        # the whole shape, as the drafter's loop runs it also where the tokens left cut its draft (alone: its own
        # loop; a fork: one loop for every request drafting it, over their rows); its tokens are dropped: the draft
        # is the trace's
        yield self.loops.feed(self.widths, logits[-1]) if self.loops is not None else \
            self.rows[0].loop_feed(self.widths, cache, logits[-1])
        for slot, (node, _) in enumerate(rows):  # the loop fed node i at base + i, as the recording did
            node = fed_as(node)
            if node is not None and node >= 0:
                slots[node] = (0, slot)
        return len(ids) - 1

    def describe(self) -> dict:
        loops = None if self.loops is None else self.loops.describe()
        return {**super().describe(), "widths": self.widths, "draft_loops": loops}
