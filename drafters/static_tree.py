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

from typing import Annotated, Any, Sequence

import torch
from pydantic import Field
from transformers import PreTrainedModel

from metasd.core.decoding.drafter import DrafterParams, Int, StepContext, check_params, register_drafter
from metasd.core.execution.draft_batch import Drafting, Feed
from metasd.core.execution.kv_cache import cache_length
from metasd.core.execution.tree import DeviceTokens, Draft, ancestor_mask, depths_of

from .pretrained import HEAD_VOCAB_HELP, PretrainedDrafter


DEFAULT_WIDTHS = [4, 2, 2, 1]


class StaticTreeParams(DrafterParams):
    """Pool-config ``params`` of the static tree drafter."""

    widths: list[Annotated[Int, Field(ge=1, le=64)]] | None = Field(
        None, min_length=1, max_length=16,
        description="children of every node at each level, root first (default [4, 2, 2, 1]: 4 + 8 + 16 + 16 nodes)")
    head_vocab: Int | None = Field(None, ge=2, description=HEAD_VOCAB_HELP)


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


@register_drafter
class StaticTreeDrafter(PretrainedDrafter):
    """A small pretrained LM drafting a fixed-shape top-k tree per step, on the device (see the module docstring).

    widths: children of every node at each level (the tree's depth is their number; cut to the request's tokens
    left; default ``DEFAULT_WIDTHS``)."""

    kind = "static_tree"
    Params = StaticTreeParams
    cross_tokenizer = False

    def __init__(self, model: PreTrainedModel, tokenizer=None, widths: Sequence[int] | None = None,
                 head_vocab: int | None = None, name: str | None = None, model_ref: str | None = None):
        super().__init__(model, tokenizer, k=1, head_vocab=head_vocab, name=name, model_ref=model_ref)
        widths = DEFAULT_WIDTHS if widths is None else list(widths)
        check_params(StaticTreeParams, dict(widths=widths, head_vocab=head_vocab), self.name)
        self.widths = [int(w) for w in widths]

    def make_draft(self, ctx: StepContext) -> Drafting:
        widths = self.widths[: max(ctx.max_depth, 0)]
        if not widths:
            return Draft.empty()
        logits = yield from self._sync_steps(ctx.tokens.tolist())  # [vocab] after the last committed token
        committed = cache_length(self.cache)
        parents, levels = tree_shape(widths)
        depths = depths_of(parents)
        mask = ancestor_mask(torch.tensor(parents))  # [n+1, n+1], row/column 0: the root
        drafted = [logits.reshape(1, -1).topk(widths[0], dim=-1).indices.reshape(-1)]  # [w_0] on the device
        for d, (start, end) in enumerate(levels[:-1]):  # feed level d, its children's tokens from its logits
            rows = mask[start + 1: end + 1, 1: end + 1]  # [q, fed so far + q]: the nodes' ancestors and themselves
            feed_mask = torch.cat([torch.ones(end - start, committed, dtype=torch.bool), rows], dim=1)
            positions = torch.tensor([committed + depths[i] - 1 for i in range(start, end)])
            out = yield Feed(self.model, self.draft_head, self.cache, drafted[-1], mask=feed_mask,
                             positions=positions)  # [q, vocab]
            drafted.append(out.topk(widths[d + 1], dim=-1).indices.reshape(-1))  # [q * w_{d+1}]
        return Draft(DeviceTokens(torch.cat(drafted)), parents, None, catch_up=self.last_catch_up,
                     meta={"drafter_forwards": len(levels)})

    def describe(self) -> dict[str, Any]:
        out = {k: v for k, v in super().describe().items() if k not in ("k", "confidence_threshold", "adaptive_k",
                                                                         "track")}
        return {**out, "widths": self.widths}
