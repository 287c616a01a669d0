"""Fused drafts (SpecInfer, arXiv 2305.09781, merges several small models' token trees): the drafts of several arms
merged into one token tree - shared prefixes merged, each arm within its node budget - and verified in one forward.

Greedy verification follows the verifier's argmax through any tree, so greedy output is unchanged. Under sampling the
branches come from different proposal distributions, so the per-node q that recursive rejection needs does not exist:
the fused draft carries no probabilities and is verified by sample-and-match, which is exact for any tree
(docs/algorithms.md#fused-drafts).
"""
from __future__ import annotations

from typing import Annotated, Any, Sequence

import torch
from pydantic import Field, model_validator

from metasd.core.decoding.acceptance import Acceptance, follow
from metasd.core.decoding.drafter import (Drafter, DrafterParams, Int, StepContext, StepFeedback, check_params,
                                          drafting_loop, register_drafter)
from metasd.core.execution.draft_batch import Drafting, drive
from metasd.core.execution.tree import Draft


class FusedParams(DrafterParams):
    """Pool-config ``params`` of the fused drafter."""

    arms: list[str] = Field(min_length=2, description="names of earlier pool entries whose drafts are merged")
    nodes: list[Annotated[Int, Field(ge=0)]] | None = Field(
        None, description="per arm, the most nodes taken from its draft (its first nodes, an ancestor-closed subtree); "
                          "default: all")
    max_nodes: Int | None = Field(None, ge=1, description="the most nodes of the fused tree (default: no bound)")
    enough: Int | None = Field(None, ge=1, description="a draft this deep is enough: the arms after it do not draft "
                                                        "this step (a cascade: put the cheap arms first)")

    @model_validator(mode="after")
    def _lengths(self) -> "FusedParams":
        if self.nodes is not None and len(self.nodes) != len(self.arms):
            raise ValueError(f"nodes gives {len(self.nodes)} budgets for {len(self.arms)} arms")
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct, got {self.arms}")
        return self


@register_drafter
class FusedDrafter(Drafter):
    """Drafts with each of its ``arms`` (other drafters of the pool, shared with it) and merges their drafts into one
    tree. Each arm keeps its own state: after verification it is told what its own draft had accepted (the longest
    prefix of the accepted path in its draft), as if it had drafted alone. ``Draft.meta`` counts each arm's nodes
    and how many of them an earlier arm had already proposed (``shared``).

    ``enough`` makes it a cascade: once an arm's draft is at least that deep, the arms after it do not draft in that
    step (put a cheap lookup first and an expensive model after it: a long match is drafted for free, and the model
    drafts only where the lookup has little to offer); a skipped arm catches up when it drafts next. A draft not deep
    enough is merged after the later arms' drafts: where the lookup had little to offer the model's nodes come
    first, so a node bound keeps them (a shallow but wide lookup tree would otherwise fill a small bound and stop
    the model: on this CPU the cascade cut to 8 nodes committed 17 tokens a step at 4 requests where the model's own
    8-node tree committed 21).

    ``ctx.max_nodes`` (a budget arm's budget, drafters/budgeted.py) bounds the fused tree as ``max_nodes`` does, reaches
    the arms (a ``pretrained_tree`` arm then drafts fewer nodes) and stops the arms after the tree is full: the fused
    draft is then exactly the unbounded one's first ``max_nodes`` nodes. ``ctx.lookup_only`` leaves out the arms that
    are not lookups (``Drafter.lookup``); they catch up when they draft next."""

    kind = "fused"
    model_field, checkpoint_field = "never", "never"
    Params = FusedParams
    refers_to = "arms"

    def __init__(self, arms: Sequence[Drafter], nodes: Sequence[int] | None = None, max_nodes: int | None = None,
                 enough: int | None = None, name: str | None = None):
        super().__init__(name)
        check_params(FusedParams, dict(arms=[a.name for a in arms], nodes=None if nodes is None else list(nodes),
                                       max_nodes=max_nodes, enough=enough), self.name)
        self.arms = list(arms)
        self.nodes = None if nodes is None else list(nodes)
        self.max_nodes, self.enough = max_nodes, enough
        self.hidden_layers = tuple(sorted({layer for a in self.arms for layer in a.hidden_layers}))
        self._last: list[tuple[Drafter, Draft, int]] = []  # per arm that drafted: it, its draft, the nodes kept

    @classmethod
    def from_config(cls, name, params, build):
        build.refuse_quantize(name, cls.kind)
        missing = [a for a in params["arms"] if a not in build.pool]
        if missing:
            raise ValueError(f"arms {missing} are not earlier entries of the pool (entries before it: {list(build.pool)})")
        return cls([build.pool[a] for a in params["arms"]], name=name, **{k: v for k, v in params.items() if k != "arms"})

    def _forked(self, cross_request: bool) -> None:
        self._last = []  # the arms were forked with it (Drafter.fork)

    def components(self) -> list[Drafter]:
        return list(self.arms)

    @property
    def lookup(self) -> bool:  # type: ignore[override]
        return all(a.lookup for a in self.arms)

    def modules(self):
        return []  # the arms' networks are counted as the arms'

    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    def drafting(self, ctx: StepContext) -> Drafting:
        """The arms' drafting loops one after another (their forwards yielded: batched drafting), merged."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (fused parent, token) -> fused node
        meta: dict[str, Any] = {}
        self._last = []
        catch_up = 0
        # ctx.max_nodes (a budget arm's budget) bounds the fused tree like ``max_nodes``, and reaches the arms (each
        # may draft less). Nodes are appended in order, so the bounded tree is the unbounded one's first nodes: an
        # arm's node j lands at fused index >= j, so an arm's nodes past the bound never enter it
        bound = getattr(ctx, "max_nodes", None)  # (ctx is None where a test drives arms that ignore it)
        limit = self.max_nodes if bound is None else min(bound, self.max_nodes or bound)
        lookup_only = getattr(ctx, "lookup_only", False)
        deferred: list[tuple[int, Drafter, Draft]] = []  # a cascade's arms whose drafts were not deep enough

        def merge(i: int, arm: Drafter, draft: Draft) -> None:
            budget = len(draft) if self.nodes is None else min(self.nodes[i], len(draft))
            mapped: list[int] = []  # arm node -> fused node, -1: dropped (over the fused tree's bound)
            new = shared = 0
            for t, p in zip(draft.tokens[:budget].tolist(), draft.parents[:budget].tolist()):
                parent = -1 if p < 0 else mapped[p]
                if p >= 0 and parent < 0:  # its parent was dropped
                    mapped.append(-1)
                    continue
                key = (parent, t)
                if key in index:
                    shared += 1
                elif limit is not None and len(tokens) >= limit:
                    mapped.append(-1)
                    continue
                else:
                    index[key] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    new += 1
                mapped.append(index[key])
            self._last.append((arm, draft, budget))
            meta[f"nodes_{arm.name}"] = new + shared
            meta[f"shared_{arm.name}"] = shared

        for i, arm in enumerate(self.arms):
            if bound is not None and len(tokens) >= limit:  # full: the later arms cannot add a node
                meta["budget_stop"] = True
                break
            if lookup_only and not arm.lookup:  # a model arm: it reads the committed text when it next drafts
                meta["lookup_only"] = True
                continue
            draft = yield from drafting_loop(arm, ctx)
            catch_up += draft.catch_up
            cascading = self.enough is not None and i + 1 < len(self.arms)
            if cascading and draft.depth < self.enough:
                deferred.append((i, arm, draft))  # too shallow: the later arms' nodes come first
                continue
            merge(i, arm, draft)
            if cascading:  # deep enough
                meta["cascade_stop"] = True  # counted per request: steps where the later arms did not draft
                break
        for i, arm, draft in deferred:
            merge(i, arm, draft)
        fused = Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), meta=meta,
                      catch_up=catch_up)
        return fused

    def observe(self, feedback: StepFeedback) -> None:
        """Each arm learns what its own draft had accepted: the longest prefix of the accepted tokens in the part of
        its draft that was verified, then the token the verifier committed next (its bonus)."""
        accepted = feedback.committed[:-1]
        for arm, draft, kept in self._last:
            kept_draft = Draft(draft.tokens[:kept], draft.parents[:kept])
            path, _ = follow(kept_draft, accepted)
            bonus = feedback.committed[len(path)]
            own = StepFeedback(draft, Acceptance(path, bonus), feedback.committed[: len(path) + 1],
                               seconds=feedback.seconds, cost=feedback.cost)
            arm.observe(own)
        self._last = []

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "arms": [a.name for a in self.arms], "nodes": self.nodes,
                "max_nodes": self.max_nodes, "enough": self.enough}
