"""A tree of a fixed shape drafted on the device: no host read while drafting.

Every node at level ``d`` gets the top ``widths[d]`` tokens of the drafter's distribution after it (the root: after
the last committed token), so the tree's shape - its parents, masks and positions - is known before drafting, and
only its tokens are device values. Each level is one drafter forward over the level before it; the tokens go to the
next forward and to the verifier without the host reading them, and the step's acceptance reads them once with the
verifier's choices (``DeviceTokens``): a step reads the device once, as a chain drafted on the device does. The
dynamic tree (``pretrained_tree``) picks where to grow from the scores it reads each level; this one spends its
nodes on a fixed shape instead - the shape EAGLE's first trees, Medusa and SGLang's captured draft loops use, and
the one a captured drafting loop needs.

The draft carries no probabilities (top-k is not a sample), so under sampling it is verified by sample-and-match,
exact for any draft. The fed levels stay in the drafter's cache until the next step's catch-up crops them: the
accepted tokens are fed again with the bonus token in that one forward (counted as catch-up).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Sequence

import torch
from pydantic import Field
from transformers import PreTrainedModel

from metasd.core.decoding.drafter import DrafterParams, Int, StepContext, check_params, register_drafter
from metasd.core.execution.draft_batch import Drafting, Feed
from metasd.core.execution.draft_loop import tree_shape
from metasd.core.execution.kv_cache import cache_length
from metasd.core.execution.tree import DeviceTokens, Draft, tree_layout

from .pretrained import GRAPHS_HELP, HEAD_VOCAB_HELP, PretrainedDrafter


DEFAULT_WIDTHS = [4, 2, 2, 1]


class StaticTreeParams(DrafterParams):
    """Pool-config ``params`` of the static tree drafter."""

    widths: list[Annotated[Int, Field(ge=1, le=64)]] | None = Field(
        None, min_length=1, max_length=16,
        description="children of every node at each level, root first (default [4, 2, 2, 1]: 4 + 8 + 16 + 16 nodes)")
    head_vocab: Int | None = Field(None, ge=2, description=HEAD_VOCAB_HELP)
    graphs: Literal["auto", "on", "off", "fixed"] = Field("auto", description=GRAPHS_HELP)


@register_drafter
class StaticTreeDrafter(PretrainedDrafter):
    """A small pretrained LM drafting a fixed-shape top-k tree per step, on the device (see the module docstring).

    widths: children of every node at each level (the tree's depth is their number; cut to the request's tokens
    left; default ``DEFAULT_WIDTHS``). graphs: the levels after the catch-up drafted as one fixed-shape loop
    (``DraftLoops``), a CUDA graph where the model is on CUDA ("auto"), for one request at a time (a scheduler's forks
    feed level by level, batched across requests); ``fixed_shapes`` runs that loop's buffers eagerly (the CPU check)."""

    kind = "static_tree"
    Params = StaticTreeParams
    cross_tokenizer = False

    def __init__(self, model: PreTrainedModel, tokenizer=None, widths: Sequence[int] | None = None,
                 head_vocab: int | None = None, name: str | None = None, model_ref: str | None = None,
                 graphs: str = "auto", fixed_shapes: bool | None = None):
        check_params(StaticTreeParams, dict(widths=widths, head_vocab=head_vocab, graphs=graphs), name or self.kind)
        super().__init__(model, tokenizer, k=1, head_vocab=head_vocab, name=name, model_ref=model_ref, graphs=graphs,
                         fixed_shapes=fixed_shapes)
        widths = DEFAULT_WIDTHS if widths is None else list(widths)
        self.widths = [int(w) for w in widths]

    def make_draft(self, ctx: StepContext) -> Drafting:
        widths = self.widths[: max(ctx.max_depth, 0)]
        if not widths:
            return Draft.empty()
        logits = yield from self._sync_steps(ctx.tokens.tolist())  # [vocab] after the last committed token
        parents, levels = tree_shape(widths)
        # the whole shape in one loop (a CUDA graph where captured), cut to the depth: alone, its own loop; a
        # scheduler's fork, one loop for every request drafting it, over their rows
        whole = self.loops.feed(self.widths, logits) if self.loops is not None else \
            None if self.rows is None else self.rows.loop_feed(self.widths, self.cache, logits)
        if whole is not None:
            tokens = yield whole  # [n of the whole shape] on the device
            return Draft(DeviceTokens(tokens[: len(parents)]), parents, None, catch_up=self.last_catch_up,
                         meta={"drafter_forwards": len(self.widths)})
        committed = cache_length(self.cache)
        layout = tree_layout(tuple(parents))  # depths and ancestor mask (read only), row/column 0: the root
        drafted = [logits.reshape(1, -1).topk(widths[0], dim=-1).indices.reshape(-1)]  # [w_0] on the device
        for d, (start, end) in enumerate(levels[:-1]):  # feed level d, its children's tokens from its logits
            rows = layout.mask[start + 1: end + 1, 1: end + 1]  # [q, fed so far + q]: ancestors-or-self
            feed_mask = torch.cat([torch.ones(end - start, committed, dtype=torch.bool), rows], dim=1)
            positions = torch.tensor([committed + layout.depths[i + 1] - 1 for i in range(start, end)])
            out = yield Feed(self.model, self.draft_head, self.cache, drafted[-1], mask=feed_mask,
                             positions=positions)  # [q, vocab]
            drafted.append(out.topk(widths[d + 1], dim=-1).indices.reshape(-1))  # [q * w_{d+1}]
        return Draft(DeviceTokens(torch.cat(drafted)), parents, None, catch_up=self.last_catch_up,
                     meta={"drafter_forwards": len(levels)})

    def describe(self) -> dict[str, Any]:
        out = {k: v for k, v in super().describe().items() if k not in ("k", "confidence_threshold", "adaptive_k",
                                                                         "track")}
        return {**out, "widths": self.widths, "graphs": self.graphs}
