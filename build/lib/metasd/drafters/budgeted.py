"""Draft budgets and "no speculation" as arms the policy chooses (docs/algorithms.md#budget-arms).

A pool entry with ``budgets: [4, 16, 48]`` becomes one arm per budget, ``"cascade@4"``, ``"cascade@16"``, ...: each a
``BudgetedArm`` around ONE shared inner drafter (one model, one state), proposing the inner drafter's draft cut to its
first ``budget`` nodes (``Draft.first``: an ancestor-closed subtree, exact under every acceptance rule). The arms of
one entry also share one ``_Shared`` holder (``budget_arms`` builds them so): the last proposal any of them made, which
the others read for their counterfactuals. The budget is passed down as ``StepContext.max_nodes``, so an inner
drafter that can draft less does (``pretrained_tree``, ``fused`` passing it on to its arms); the others are cut after
drafting.

``no_speculation_arm: true`` adds ``NoSpeculation`` (arm "none"): an empty draft, i.e. one plain decoding step - the
right choice when the verifier's batch is full and a draft costs more than it saves.

Counterfactuals for free (``feedback: full``). When ``cascade@16`` drafted and was verified, ``cascade@4`` of the same
inner drafter would have proposed the verified draft's first 4 nodes (node indices are topological and kept by
``Draft.first``; an inner drafter honouring ``max_nodes`` must return its unbounded draft's first nodes). The verifier
scored every one of those nodes, and an accepted path's node indices increase along it, so the accepted path
restricted to indices < 4 is a prefix of it: exactly what verifying the 4-node draft accepts under greedy
verification, and under sampling what sample-and-match or recursive rejection accepts with the same random draws
(siblings are tried in index order, so the draws on nodes < 4 are the same ones). A larger budget learns the same
outcome when the drafter drafted fewer nodes than the smaller budget allowed (its draft would not change); otherwise it
was not verified, and gets no counterfactual (None). ``NoSpeculation``'s counterfactual is always known: nothing
drafted, nothing accepted, no drafting work.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from metasd.core.pricing.cost import open_meter
from metasd.core.decoding.drafter import Counterfactual, Drafter, StepContext, StepFeedback, drafting_loop
from metasd.core.execution.draft_batch import Drafting, drive
from metasd.core.execution.tree import Draft

#: the name of the no-speculation arm (reserved when a pool's ``no_speculation_arm`` is true)
NO_SPECULATION = "none"


def budget_arm_name(entry: str, budget: int) -> str:
    """The arm name of one budget of a pool entry: ``"cascade@16"``."""
    return f"{entry}@{budget}"


@dataclass
class _Proposal:
    """One budget arm's proposal in the step ``ctx``: the inner drafter's draft (cut to the step's depth) and the
    metered cost of drafting it, in verifier decode steps."""

    ctx: StepContext
    budget: int
    full: Draft  # the inner drafter's draft (its first ``budget`` nodes if it honoured max_nodes)
    proposed: Draft  # full.first(budget): what the arm proposed
    reindexed: bool  # the depth cut renumbered nodes (then no counterfactual: indices no longer match ``full``)
    cost: float


class _Shared:
    """What the budget arms of one inner drafter share: the last proposal any of them made, and the inner drafter's
    own counterfactual of the step when an arm of another entry drafted (asked once per step, not once per budget).

    One holder per inner drafter: made with the arms (``budget_arms``), passed to each arm, and forked with the inner
    drafter (``BudgetedArm.fork``: once per memo, so a request's forked arms share one new, empty holder)."""

    def __init__(self):
        self.last: _Proposal | None = None
        self.inner_cf: tuple[StepContext, Counterfactual | None] | None = None


class BudgetedArm(Drafter):
    """One budget arm: ``inner``'s draft cut to its first ``budget`` nodes. Every arm of one pool entry holds the same
    ``inner`` drafter (one model, one state) and the same ``shared`` holder (``budget_arms`` builds them so; an arm
    given no holder gets one of its own - right for an arm alone, not for siblings); ``fork(memo)`` keeps that sharing
    (the inner drafter and the holder are forked once per memo, as a fused drafter's arms are). ``observe`` forwards to
    the inner drafter; ``counterfactual`` is exact for budgets up to the one a sibling arm drafted with (module
    docstring)."""

    kind = ""  # built by the pool (an entry's ``budgets``), not a type of its own

    def __init__(self, inner: Drafter, budget: int, name: str | None = None, *, shared: _Shared | None = None):
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"budget must be an integer >= 1, got {budget!r}")
        super().__init__(name or budget_arm_name(inner.name, budget))
        self.inner = inner
        self.budget = budget
        self.shared = _Shared() if shared is None else shared
        self.hidden_layers = inner.hidden_layers

    def fork(self, cross_request: bool = False, memo: dict[int, Any] | None = None) -> BudgetedArm:
        """``Drafter.fork``, and the holder forked with the inner drafter: the arms forked with one memo share one new
        holder (the memo maps the old holder's id to it), forks with another memo (another request) get their own."""
        memo = {} if memo is None else memo
        if id(self) in memo:
            return memo[id(self)]
        twin = super().fork(cross_request, memo)
        shared = memo.get(id(self.shared))
        if shared is None:
            shared = memo[id(self.shared)] = _Shared()
        twin.shared = shared
        return twin

    def components(self) -> list[Drafter]:
        return [self.inner]  # the engine begins, ends and locks the inner drafter once, whatever its arms

    def modules(self):
        return []  # the inner drafter's networks are counted as the inner drafter's

    def propose(self, ctx: StepContext) -> Draft:
        return drive(self.drafting(ctx))

    def drafting(self, ctx: StepContext) -> Drafting:
        """The inner drafter's drafting loop under this arm's budget, cut to it (the inner drafter's forwards are
        yielded: batched drafting)."""
        limit = self.budget if ctx.max_nodes is None else min(self.budget, ctx.max_nodes)
        meter = open_meter()
        before = meter.steps if meter is not None else 0.0
        full = yield from drafting_loop(self.inner, dataclasses.replace(ctx, max_nodes=limit))
        meter = open_meter()  # the meter open now: a scheduler drafting many requests opens each one's own
        cost = (meter.steps - before) if meter is not None else 0.0
        reindexed = full.depth > ctx.max_depth
        if reindexed:  # cut here (the request would), so that the budget counts the nodes that are verified
            full = full.truncated(ctx.max_depth)
        proposed = full.first(self.budget)
        self.shared.last = _Proposal(ctx, self.budget, full, proposed, reindexed, cost)
        return proposed

    def observe(self, feedback: StepFeedback) -> None:
        """The inner drafter learns the step as if it had drafted alone: its own draft, with the accepted path (node
        indices of the first nodes are its own, ``Draft.first`` keeps them) - as a fused drafter tells its arms."""
        last = self.shared.last
        if last is not None and not last.reindexed and _is_prefix(feedback.draft, last.proposed):
            feedback = dataclasses.replace(feedback, draft=last.full)
        self.inner.observe(feedback)

    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual | None:
        """What this budget would have had accepted in a step another arm drafted.

        A sibling (same inner drafter, budget B) drafted: exact when ``budget <= B`` or when the drafter drafted
        fewer than B nodes (the module docstring). ``drafted``/``depth`` are those of the verified draft's first
        ``budget`` nodes; the drafting is priced as the sibling's drafting metered (``drafting_cost``): the same
        forwards for an inner drafter that does not honour ``max_nodes``, an upper bound for one that does (its
        drafting of fewer nodes may stop earlier); the verification is priced by the engine for ``drafted`` nodes.
        An arm of another entry drafted: the inner drafter's own counterfactual (asked once per step for all
        budgets), when its draft fits the budget (the cut changes nothing); else None."""
        shared = self.shared
        last = shared.last
        if last is not None and last.ctx is ctx:
            return self._from_sibling(last, feedback)
        if shared.inner_cf is None or shared.inner_cf[0] is not ctx:
            shared.inner_cf = (ctx, self.inner.counterfactual(ctx, feedback))
        c = shared.inner_cf[1]
        return c if c is not None and c.drafted <= self.budget else None

    def _from_sibling(self, last: _Proposal, feedback: StepFeedback) -> Counterfactual | None:
        verified = feedback.draft  # last.proposed, or its first nodes (a scheduler's draft budget)
        if last.reindexed or last.ctx.lookup_only or not _is_prefix(verified, last.proposed):
            return None  # (a lookup-only draft says nothing of what the arm drafts in full)
        if self.budget > last.budget and len(last.full) >= last.budget:
            return None  # the larger budget's extra nodes were never drafted nor verified
        n = min(self.budget, len(verified))  # this arm's draft: the verified draft's first n nodes
        path = [i for i in feedback.acceptance.path if i < n]  # indices increase along a path: a prefix of it
        return Counterfactual(len(path), n, verified.first(n).depth, drafting_cost=last.cost)

    @property
    def lookup(self) -> bool:  # type: ignore[override]
        return self.inner.lookup

    def longest_match(self, tokens: torch.Tensor) -> int | None:
        return self.inner.longest_match(tokens)

    def confidence(self) -> float | None:
        return self.inner.confidence()

    def describe(self) -> dict[str, Any]:
        return {"kind": "budgeted", "name": self.name, "budget": self.budget, "inner": self.inner.describe()}


def budget_arms(inner: Drafter, budgets: Iterable[int]) -> list[BudgetedArm]:
    """The budget arms of one pool entry, one per budget in the order given: each around ``inner``, all sharing one
    new ``_Shared`` holder."""
    shared = _Shared()
    return [BudgetedArm(inner, b, shared=shared) for b in budgets]


class NoSpeculation(Drafter):
    """The "none" arm: an empty draft, so its step is one plain decoding step (the verifier scores the pending token
    alone and commits its next token). Its counterfactual is always known: 0 drafted, 0 accepted, no forwards."""

    kind = ""  # built by the pool (``no_speculation_arm: true``), not a type of its own
    speculates = False  # never drafts: a scheduler's allocator gives it no nodes

    def __init__(self, name: str = NO_SPECULATION):
        super().__init__(name)

    def propose(self, ctx: StepContext) -> Draft:
        return Draft.empty()

    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual:
        return Counterfactual(0, 0, 0)


def _is_prefix(draft: Draft, of: Draft) -> bool:
    """Whether ``draft`` is ``of``'s first nodes (``of`` itself, or ``of.first(n)``: the same tokens and parents)."""
    if draft is of:
        return True
    n = len(draft)
    return n <= len(of) and torch.equal(draft.tokens, of.tokens[:n]) and torch.equal(draft.parents, of.parents[:n])
