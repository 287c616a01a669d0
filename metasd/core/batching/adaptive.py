"""Adaptive speculation: a batched scheduler step sized to the load (docs/algorithms.md#speculation-under-load).

``AdaptiveSpeculation`` is owned by a ``Scheduler`` (``Scheduler(engine, adaptive=AdaptiveSpeculation(cost))``) and
wires the building blocks of speculation under load into its step:

1. **load context** - before the arms are selected, every running request gets ``load_features(B, N_prev)`` (B running
   requests, ``N_prev`` tokens of the previous step's padded forward), appended last to a contextual policy's context
   (``Request.load``), so ``per_load`` or LinUCB choose knowing the load;
2. **allocation** - after each request's arm is selected and before it drafts, ``allocator.plan`` chooses each
   request's node budget ``d_i`` (``0 <= d_i <= cap_i``, ``max_i d_i <= max_width``) maximising the step's expected
   goodput ``(B + sum_i a_i(d_i)) / cost(B (1 + max_i d_i))``, ``a_i`` the acceptance curve of request i's arm; the
   request drafts with ``StepContext.max_nodes = d_i`` and its draft is cut to ``draft.first(d_i)`` (exact: an
   ancestor-closed subtree);
3. **pricing** - after the batched verification, request i's step costs its share ``cost(B N) / B + c_i``
   (``goodput.shared_step_cost``, rows ``1 + len(draft_j)``, ``c_i`` its drafting cost: measured seconds over
   ``unit_seconds`` when given, else the meter's modeled cost), and a counterfactual draft of ``n`` nodes the forward
   it would have been in (``goodput.counterfactual_share``);
4. **learning** - the arm's curve learns from the accepted path (``AcceptanceCurve.update``), and its drafting cost:
   per step, per load level and node budget (``DraftPrices``), and per caught-up token (a step whose drafter fed
   more than ``max_width`` committed tokens: a request's first draft feeds its prompt). With ``price_drafting=True``
   the allocator charges them (``plan``'s ``draft_costs``: ``c_i(d) = price(level, d) + rate * unfed * (1 + a(d)) /
   remaining`` for ``d > 0``, the one-off catch-up amortized over the request's remaining tokens - charged whole
   while requests joining the batch will raise the load to a level where the arm would not draft, ``drafts_at``; 0
   at ``d = 0``), and ``min_gain`` keeps a step plain unless drafting is expected to beat it by that factor;
5. **deferred catch-up** (``defer_catch_up``) - a request whose arm's model has its prompt still to read and has
   lookups in it (a cascade) may draft with the lookups alone (``StepContext.lookup_only``): a second option in the
   allocation (``plan``'s ``alternatives``) at the lookups' drafting cost (key ``"<arm>/lookup"``) and **the
   request's own** curve (``lookup_curve``): what a lookup finds is a property of the request's text, not the arm's.
6. **the forward's real price** (with ``unit_seconds``) - measured forward prices (seconds over ``unit_seconds``),
   per load level and token bucket (``ForwardRatios``), price every verify of the level (``forward_cost``).
7. **probes** (with ``price_drafting``; ``probes.py``) - after a run of steps at one width where a wider one was
   possible, one step drafts wider (up to the widest sibling arm, ``siblings``), sampling every narrower budget at
   once: within ``probe_budget`` (``PROBE_SHARE`` of the level's time, no prompt read unpaid), ``probe_stall`` (the
   padded verify and the drafters' reads of unfed tokens, ``probes.stall_cost``; not for one request with none
   joining, whose probe stalls no other stream).

Curves are per drafter, shared by the scheduler's requests: budget arms of one entry (``cascade@4``, ``cascade@16``)
share the inner drafter's. A request's cap is its arm's ``budget`` (budget arms), else ``max_width``; 0 for an arm that
does not speculate (``speculates = False``: the "none" arm) and for a request that drafts with no arm.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ..decoding.drafter import drafts_lookups
from ..decoding.request_features import LOAD_LEVELS, load_features, load_level
from ..pricing.acceptance_curve import AcceptanceCurve
from ..pricing.allocator import Allocation, checked_min_gain, plan
from ..pricing.draft_prices import DraftCost, DraftPrices
from ..pricing.forward_ratios import FORWARD_RATIO_DECAY, ForwardRatios
from ..pricing.goodput import counterfactual_share, shared_step_cost
from ..pricing.padding import Padding, bucket_grid, padded_tokens
from . import probes
from .step_records import AdaptiveRecord, StepPlan

#: weight of the past in an arm's average drafting cost (an exponential average over the steps it drafted)
DRAFT_COST_DECAY = 0.8


class AdaptiveSpeculation:
    """Decides, per batched step, how many draft nodes each running request verifies - from the verifier's forward
    cost (``cost(n_tokens)``: a ``ForwardProfile.cost`` or any monotone callable, units of a 1-token forward), the
    acceptance curve of each request's selected arm (learnt from every verified draft) and ``max_width`` - and
    prices each request's step with its share of the shared forward. See the module docstring.

    cost: the forward's cost over n tokens in all (padding included); max_width: most draft nodes per row;
    grid: the curves' grid of node budgets (default: ``AcceptanceCurve``'s); price_drafting: whether the allocator
    charges each arm's learnt drafting cost (an arm priced out drafts again only where the load falls enough for its
    last estimate to pay - the per-step policy's throughput reward prices drafting either way); unit_seconds: the
    seconds of a one-token verifier forward (the profile's ``seconds_for(1)``): drafting is then priced by its
    measured wall time in ``cost``'s units (``seconds / unit_seconds``), in the allocator and in the step's reward,
    else (None) by the engine meter's modeled cost of the drafters' forwards; min_gain: a step drafts only where the
    allocation's expected goodput is >= ``min_gain`` x a plain step's (``plan``'s margin; 1.0: any gain);
    defer_catch_up: offer a request whose arm's model has its prompt still to read the arm's lookups alone (module
    docstring, 5.; needs ``price_drafting``: unpriced, a catch-up is never a reason to draft otherwise); probe_stall:
    a probe's forward costs at most this many times the one it replaces (``probes.probe``'s ``stall``; None: no bound)
    wherever another request waits for the step (running beside it, or joining).
    A scheduler whose verifier runs fixed shapes prices a forward at the shape it pads to (``checked``)."""

    def __init__(self, cost: Callable[[int], float], *, max_width: int = 48, grid: Sequence[int] | None = None,
                 price_drafting: bool = False, unit_seconds: float | None = None, min_gain: float = 1.0,
                 defer_catch_up: bool = False, probe_stall: float | None = None):
        if not callable(cost):
            raise ValueError(f"cost must be callable (a ForwardProfile's cost), got {type(cost).__name__}")
        if not isinstance(max_width, int) or isinstance(max_width, bool) or max_width < 0:
            raise ValueError(f"max_width must be an integer >= 0, got {max_width!r}")
        self.cost, self.max_width = getattr(cost, "cost", cost), max_width  # a ForwardProfile is accepted too
        if unit_seconds is not None and (isinstance(unit_seconds, bool) or not isinstance(unit_seconds, (int, float))
                                         or not math.isfinite(unit_seconds) or unit_seconds <= 0):
            raise ValueError(f"unit_seconds must be a finite number of seconds > 0 or None, got {unit_seconds!r}")
        self.unit_seconds = None if unit_seconds is None else float(unit_seconds)
        self.min_gain = checked_min_gain(min_gain)
        if defer_catch_up and not price_drafting:
            raise ValueError("defer_catch_up needs price_drafting: the catch-up it defers is priced only then")
        self.price_drafting, self.defer_catch_up = bool(price_drafting), bool(defer_catch_up)
        self.probe_stall = probes.checked_stall(probe_stall)
        self.grid = tuple(grid) if grid is not None else None
        self.curves: dict[str, AcceptanceCurve] = {}
        self.draft_costs: dict[str, float] = {}  # per curve key: average drafting cost of a step it drafted
        # per load level and node budget: what is charged (a level: its most requests; borrowed via the profile)
        self.draft_prices = DraftPrices(DRAFT_COST_DECAY, LOAD_LEVELS + (2 * LOAD_LEVELS[-1],), shape=self.cost)
        self.catch_up_rates: dict[str, float] = {}  # per curve key: average cost of one caught-up token
        self._lookup_curves: "weakref.WeakKeyDictionary[Any, AcceptanceCurve]" = weakref.WeakKeyDictionary()
        self._fed: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # request -> its length
        self._scale: float | None = None  # measured / modeled drafting cost (``modeled_scale``)
        self.ratios = ForwardRatios(self.cost, FORWARD_RATIO_DECAY)  # the verify forwards measured (module doc, 6.)
        self.width_runs = probes.WidthRuns()  # per load level: steps in a row at one width (``probe``)
        self.probe_budget = probes.ProbeBudget()  # per load level: what its probes may lose, how wide they draft
        self.last_forward_tokens = 0  # the previous step's padded forward: B * N tokens (R * T at fixed shapes)
        self.padding: Padding | None = None  # the verifier's fixed shapes, where it runs them (``checked``)

    @classmethod
    def checked(cls, adaptive: Any, padding: Padding | None = None) -> "AdaptiveSpeculation | None":
        """``adaptive`` if it is an ``AdaptiveSpeculation`` or None, else a ``ValueError`` (a Scheduler argument).
        ``padding`` (the verifier's fixed shapes): forwards priced padded, the grid (unless given) ``bucket_grid``'s."""
        if adaptive is not None and not isinstance(adaptive, cls):
            raise ValueError(f"adaptive must be an AdaptiveSpeculation or None, got {type(adaptive).__name__}")
        if adaptive is not None and padding is not None:
            adaptive.padding, adaptive.grid = padding, adaptive.grid or bucket_grid(padding, adaptive.max_width)
        return adaptive

    # ---------------------------------------------------------------- per arm
    @staticmethod
    def curve_key(arm: Any) -> str:
        """The curve an arm reads and feeds: a budget arm's inner drafter's name (budgets share it), else its own."""
        return getattr(getattr(arm, "inner", None), "name", None) or arm.name

    @classmethod
    def lookup_key(cls, arm: Any) -> str:
        """The drafting costs of the arm's lookups drafting alone (``defer_catch_up``): ``"<curve_key>/lookup"``."""
        return cls.curve_key(arm) + "/lookup"

    def lookup_curve(self, request: Any) -> AcceptanceCurve:
        """The request's own acceptance curve of lookup-only drafts (module docstring, 5.), made on first use."""
        if request not in self._lookup_curves:
            self._lookup_curves[request] = AcceptanceCurve(self.grid) if self.grid is not None else AcceptanceCurve()
        return self._lookup_curves[request]

    def curve(self, arm: Any) -> AcceptanceCurve:
        """The arm's acceptance curve (shared by the budget arms of one entry), made on first use."""
        key = self.curve_key(arm)
        if key not in self.curves:
            self.curves[key] = AcceptanceCurve(self.grid) if self.grid is not None else AcceptanceCurve()
        return self.curves[key]

    @staticmethod
    def drafts(arm: Any, budget: int) -> bool:
        """Whether an arm given ``budget`` nodes was asked to draft: it speculates and the budget is > 0."""
        return arm is not None and budget > 0 and getattr(arm, "speculates", True)

    def cap(self, arm: Any) -> int:
        """Most nodes the arm may draft: 0 without an arm or one that does not speculate, a budget arm's ``budget`` (at
        most ``max_width``), else ``max_width``."""
        if arm is None or not getattr(arm, "speculates", True):
            return 0
        budget = getattr(arm, "budget", None)
        return min(int(budget), self.max_width) if budget is not None else self.max_width

    # ---------------------------------------------------------------- the step
    def load(self, running: int) -> np.ndarray:
        """[2] the load features of a step with ``running`` requests (``load_features``)."""
        return load_features(running, self.last_forward_tokens)

    @staticmethod
    def select(request: Any, load: np.ndarray) -> Any:
        """Give the request the step's load features (appended last to a contextual policy's context) and let it
        select its arm (``Request.select_arm``); the drafter selected (None: it does not speculate)."""
        request.load = load
        return request.select_arm()

    def allocate(self, arms: Sequence[Any], requests: Sequence[Any] | None = None, joining: int = 0) -> Allocation:
        """Each request's node budget for this step, given the arms selected (row order; None: no arm) and, for the
        catch-up price, the requests themselves (row order) and how many more are about to join them (``joining``)."""
        caps = [self.cap(a) for a in arms]
        curves = [self.curve(a) if c > 0 else None for a, c in zip(arms, caps)]
        reqs = list(requests) if requests is not None else [None] * len(arms)
        memo: dict = {}  # drafts_at's answers, shared by the step's requests
        costs = [self.draft_cost(a, r, len(arms), joining, memo) if c > 0 and self.price_drafting else None
                 for a, c, r in zip(arms, caps, reqs)]
        others = [self.lookup_alternative(a, r) if c > 0 else None for a, c, r in zip(arms, caps, reqs)] \
            if self.defer_catch_up else None
        forward = self.forward_cost(len(arms))
        alloc = plan(curves, caps, forward, max_width=self.max_width, draft_costs=costs, min_gain=self.min_gain,
                     alternatives=others)
        reach = [d if o > 0 else self.reach(a, c, r)  # a request on its lookups alone keeps them in a probe
                 for a, c, r, d, o in zip(arms, caps, reqs, alloc.nodes, alloc.options)]
        unread = [self.catch_up(a, r) if c > 0 else 0.0 for a, c, r in zip(arms, caps, reqs)]
        reach = self.probe_budget.affordable(load_level(len(arms)), reach, alloc, unread)  # no prompt read unpaid
        least = min((probes.narrowest(self.siblings(a, r), self.cap) for a, c, r in zip(arms, caps, reqs) if c > 0),
                    default=0)  # a probe drafts no fewer nodes than the narrowest budget arm (``probes.probe_width``)
        alone = len(arms) == 1 and joining == 0  # no other stream waits for the step: no stall to bound
        reads = None if self.probe_stall is None or alone else [  # what a probe's stall bound counts
            self.read_cost(a, r) if c > 0 else 0.0 for a, c, r in zip(arms, caps, reqs)]
        out = self.probe(alloc, curves, caps, forward, costs, reach=reach,
                         hopeful=self.forward_cost(len(arms), hopeful=True), alternatives=others, least=least,
                         reads=reads, alone=alone)
        self.probe_budget.planned(load_level(len(arms)), out, alloc.goodput)
        return out

    def reach(self, arm: Any, cap: int, request: Any) -> int:
        """Most nodes a probe may give the request: its widest sibling arm's cap (``siblings``) or its own ``cap``,
        within its ``max_draft_nodes`` (KV rows reserved) and its tokens left less one - a deeper draft is cut by its
        last tokens and teaches nothing (``StepRecord.cut``: the 8-token warm-up spent a level's first probe so)."""
        if cap <= 0:
            return 0
        wide = max(cap, max(self.cap(d) for d in self.siblings(arm, request)))  # its widest sibling's
        left = None if request is None else int(request.tokens_left) - 1
        for bound in (getattr(request, "max_draft_nodes", None), left):
            wide = wide if bound is None else min(wide, max(int(bound), 0))
        return wide

    @staticmethod
    def siblings(arm: Any, request: Any) -> list:
        """The request's budget arms of ``arm``'s pool entry (same inner drafter: ``cascade@4``, ``cascade@16``, ...)
        it may draft with instead this step (``Request.can_switch_arm``), narrowest first; ``[arm]`` otherwise."""
        inner = getattr(arm, "inner", None)
        if inner is None or request is None or not getattr(request, "can_switch_arm", False):
            return [arm]
        return sorted((d for d in request.drafters if getattr(d, "inner", None) is inner), key=lambda d: d.budget)

    def switched(self, arm: Any, request: Any, nodes: int) -> Any:
        """The arm that drafts ``nodes`` nodes for the request: ``arm`` where its cap holds them, else its narrowest
        sibling that does (a probe wider than the arm the policy chose; the scheduler switches the request to it,
        ``Request.switch_arm``, where one request's failure is its own)."""
        if nodes <= self.cap(arm):
            return arm
        return next(d for d in self.siblings(arm, request) if self.cap(d) >= nodes)

    def probe(self, alloc: Allocation, curves: Sequence[Any], caps: Sequence[int], forward: Callable[[int], float],
              costs: Sequence[Any] | None = None, reach: Sequence[int] | None = None,
              hopeful: Callable[[int], float] | None = None, alternatives: Sequence[Any] | None = None,
              least: int = 0, reads: Sequence[float] | None = None, alone: bool = False) -> Allocation:
        """``alloc``, unless it ends its load level's run of steps at one width while a wider one was possible (a
        request's ``reach`` above it: default its cap; ``allocate`` gives its widest sibling arm's, ``siblings``, or the
        nodes of a request kept on its lookups, ``alternatives``, or not to be caught up); then ``probes.probe``'s
        wider allocation, its widths rated at the ``hopeful`` forward price (default ``forward``; module docstring,
        7.), none under ``least`` nodes - where the level's ``probe_budget`` is open, at most its ``most`` nodes;
        ``reads``: each request's ``read_cost``, part of what ``probe_stall`` bounds; ``alone``: the step's one running
        request, none joining - no other stream waits for it, so ``probe_stall`` does not bound its probe."""
        reach = list(caps) if reach is None else [int(r) for r in reach]
        level = load_level(len(caps))  # a level whose probe budget is closed counts no run: nothing wider is possible
        possible = self.price_drafting and max(reach, default=0) > alloc.width and self.probe_budget.open(level)
        if not self.width_runs.due(level, alloc.width, possible):
            return alloc
        return probes.probe(alloc, curves, reach, forward, costs, self.max_width, hopeful, alternatives, least,
                            self.probe_budget.most(level, alloc.width, least), None if alone else self.probe_stall,
                            reads)

    def lookup_alternative(self, arm: Any, request: Any) -> list | None:
        """``[(curve, drafting cost)]`` of the arm's lookups drafting alone, for a request whose arm runs a model with
        more than ``max_width`` committed tokens to read (``unfed``) and has lookups in it; else None: the request's
        ``lookup_curve`` at the lookups' average drafting cost (their catch-up is learnt apart, as the arm's is)."""
        if request is None or self.unfed(request) <= self.max_width or arm.lookup or not drafts_lookups(arm):
            return None
        c = self.draft_costs.get(self.lookup_key(arm), 0.0)
        return [(self.lookup_curve(request), lambda d: c if d > 0 else 0.0)]

    def step_plan(self, jobs: Sequence[int], arms: Sequence[Any], requests: Sequence[Any], joining: int = 0
                  ) -> StepPlan:
        """The step's ``StepPlan`` from the arms selected (``jobs``: the running jobs' ids; all in row order) and the
        requests about to join the batch (``joining``: prefilling, or waiting with room for them)."""
        alloc = self.allocate(arms, requests, joining)
        arms = [self.switched(a, r, d) if a is not None else a for a, r, d in zip(arms, requests, alloc.nodes)]
        return StepPlan(alloc, dict(zip(jobs, alloc.nodes)), dict(zip(jobs, arms)),
                        {j: o > 0 for j, o in zip(jobs, alloc.options)})

    def unfed(self, request: Any) -> int:
        """Committed tokens of the request its drafters have not fed if it drafts now: its text before its first draft
        (but what they held from the start, ``read_at_start``), then the tokens committed since it last drafted."""
        return max(int(request.length) - self._fed.get(request, getattr(request, "read_at_start", 0)), 0)

    def read_cost(self, arm: Any, request: Any) -> float:
        """What the arm's drafters pay to read the request's unread tokens (``unfed``) when it next drafts with them:
        ``rate * unfed`` at the arm's learnt cost per caught-up token; 0 without a request or before a rate is
        learnt."""
        return self.catch_up_rates.get(self.curve_key(arm), 0.0) * self.unfed(request) if request is not None else 0.0

    def catch_up(self, arm: Any, request: Any) -> float:
        """The one-off ``read_cost`` of the request's unread text where that is more than ``max_width`` tokens (its
        prompt, before its first draft); 0 otherwise: a few tokens behind are part of a drafting step's price (``learn``
        takes them out of it, the next allocation does not charge them), though a probe's stall counts them."""
        return self.read_cost(arm, request) if request is not None and self.unfed(request) > self.max_width else 0.0

    def draft_cost(self, arm: Any, request: Any = None, running: int | None = None, joining: int = 0,
                   memo: dict | None = None) -> DraftCost | None:
        """The arm's drafting cost as the allocator prices it, 0 at ``d = 0`` (a request given no nodes does not
        draft) and for ``d > 0``: its per-step drafting price at ``running`` requests for ``d`` nodes
        (``DraftPrices.price``: at a load level where it has not drafted yet, borrowed pessimistically; the arm's
        average over all its steps when ``running`` is None) plus the request's one-off catch-up (``catch_up``)
        amortized over its remaining steps: ``catch_up * (1 + a(d)) / remaining``, ``remaining`` the tokens it may
        still commit and ``1 + a(d)`` the tokens a step commits - unless ``joining`` requests are about to raise the
        load to a level where the arm would not draft (``drafts_at``): then the catch-up is charged whole to this step
        (the level is filling: amortized, it would be paid for steps that stay plain). None before it has drafted;
        with ``memo`` (a step's), the requests with nothing to catch up share one ``DraftCost`` per arm."""
        key = self.curve_key(arm)
        c, rate = self.draft_costs.get(key), self.catch_up_rates.get(key)
        if c is None and rate is None:
            return None
        level = None if running is None else load_level(running)

        def per_step(d):
            price = (c or 0.0) if level is None else self.draft_prices.price(key, level, d)
            return 0.0 if price is None else price
        catch_up = self.catch_up(arm, request)
        if not catch_up:
            return DraftCost(per_step) if memo is None else memo.setdefault(("cost", key, level), DraftCost(per_step))
        if joining > 0 and running is not None and not self.drafts_at(arm, running + joining, memo):
            return DraftCost(per_step, fixed=catch_up)
        return DraftCost(per_step, per_token=catch_up / max(int(request.tokens_left), 1), curve=self.curve(arm))

    def drafts_at(self, arm: Any, rows: int, memo: dict | None = None) -> bool:
        """Whether ``rows`` requests all drafting with ``arm`` (its curve, cap and price at their level, no catch-up)
        would draft at all: the allocator's width for them is > 0; ``memo``: answers by (curve key, rows), per step."""
        key, memo = self.curve_key(arm), {} if memo is None else memo
        if (key, rows) not in memo:  # the price at that load for a request with nothing to catch up: no request
            batch = plan([self.curve(arm)] * rows, [self.cap(arm)] * rows, self.forward_cost(rows),
                         max_width=self.max_width, draft_costs=[self.draft_cost(arm, running=rows)] * rows,
                         min_gain=self.min_gain)
            memo[key, rows] = batch.width > 0
        return memo[key, rows]

    @property
    def forward_ratios(self) -> dict[int, float]:
        """Load level -> the measured / profiled cost of its verify forwards, all widths together (a copy, for logs)."""
        return dict(self.ratios.levels)

    def forward_ratio(self, running: int) -> float:
        """The verify forward's measured / profiled cost at ``running`` requests' load level, all widths together
        (``ForwardRatios.level_ratio``)."""
        return self.ratios.level_ratio(load_level(running))

    def forward_cost(self, running: int, hopeful: bool = False) -> Callable[[int], float]:
        """The price of a verify forward with ``running`` rows over n tokens (padding included), read through the
        forwards the level measured (``ForwardRatios.price``; the profile's cost before any). ``hopeful`` (a
        probe's): a forward wider than any level has run is priced as the widest one (``ForwardRatios.hopeful``)."""
        level, read = load_level(running), self.ratios.hopeful if hopeful else self.ratios.price
        return lambda n: read(level, padded_tokens(self.padding, running, n))  # the shape it runs at

    def record(self, alloc: Allocation, nodes: list[int], forward_tokens: int,
               forward_s: float | None = None) -> AdaptiveRecord:
        """After the step's forward (``forward_tokens``: B * N, the next step's load feature; ``forward_s``: its
        measured seconds, which the level's forward ratios learn from when ``unit_seconds`` is set): its record."""
        self.last_forward_tokens = forward_tokens
        modeled = self.cost(forward_tokens) if nodes else 0.0
        measured = self.unit_seconds is not None and forward_s is not None and forward_s > 0 and modeled > 0
        if measured:
            self.ratios.learn(load_level(len(nodes)), forward_tokens, forward_s / self.unit_seconds)
        self.probe_budget.settle(forward_s / self.unit_seconds if measured else modeled)
        return AdaptiveRecord(alloc.width, nodes, alloc.goodput, dict(alloc.table), list(alloc.options), alloc.tokens,
                              alloc.probe)

    def step_cost(self, rows_tokens: Sequence[int], i: int, draft_cost: float) -> float:
        """Request i's share of the step: ``forward_cost(B)(B N) / B + draft_cost`` (``shared_step_cost``)."""
        return shared_step_cost(self.forward_cost(len(rows_tokens)), rows_tokens, i, max(float(draft_cost), 0.0))

    def pricer(self, rows_tokens: Sequence[int], i: int) -> Callable[[int], float]:
        """The verification price of a counterfactual draft of n nodes for request i: its share of the forward with
        row i at ``1 + n`` tokens and the others as verified (``counterfactual_share``, at ``forward_cost``)."""
        rows, cost = list(rows_tokens), self.forward_cost(len(rows_tokens))
        return lambda n: counterfactual_share(cost, rows, i, int(n))

    def finish(self, request: Any, out: Any, verify_s: float, rows_tokens: Sequence[int], i: int, arm: Any,
               d_i: int, lookup: bool = False) -> tuple[list[int], bool]:
        """Request i's second half of the step (``Request.finish_step``), its step priced at its share of the batched
        forward (``step_cost``), a counterfactual draft at the share of the forward it would have been in
        (``pricer``); then its arm's curve (the request's ``lookup_curve`` where it drafted ``lookup`` only) learns
        from the accepted path at the budget the draft really had (``d_i``, capped by the scheduler's
        ``max_draft_nodes``) - unless the request set its own ``draft_budget`` or its draft was cut by its last
        tokens (``StepRecord.cut``): it says nothing of what the allocator's budget buys, and no client may steer."""
        draft_cost, catch_up = self.drafting_cost(request), request.pending_drafting[2]
        backlog = self.unfed(request)  # committed before this step, unread by its drafters (0: it drafted last step)
        cost = self.step_cost(rows_tokens, i, draft_cost)
        result = request.finish_step(out, verify_s=verify_s, cost=cost, verify_pricer=self.pricer(rows_tokens, i),
                                     modeled_scale=self.modeled_scale(request))
        s, own = request.last_step, self.lookup_curve(request) if lookup else None
        self.probe_budget.add(draft_cost, len(result[0]))
        if request.draft_budget is None and not s.cut:  # a request's own budget, or its last tokens, teach nothing
            cap = getattr(request, "max_draft_nodes", None)  # of what the allocator's budget buys
            self.learn(arm, s.path, s.drafted, d_i if cap is None else min(d_i, cap), draft_cost, catch_up, lookup=own,
                       running=len(rows_tokens), backlog=backlog)
        if self.drafts(arm, d_i) and not lookup:  # its model read the text (a lookup-only step left it unread)
            self._fed[request] = int(request.length)
        return result

    def modeled_scale(self, request: Any) -> float:
        """What one unit of modeled drafting cost is in ``cost``'s units: 1 where drafting is priced by the model
        (``unit_seconds`` None); else the measured / modeled ratio of the drafting the scheduler has seen (a running
        average over steps that drafted with a model, updated here), so that counterfactual arms - whose drafting is
        only modeled - are priced in the played arm's measured units."""
        if self.unit_seconds is None:
            return 1.0
        modeled, seconds, _ = request.pending_drafting
        if modeled > 0 and seconds > 0:
            ratio = seconds / self.unit_seconds / modeled
            self._scale = ratio if self._scale is None else (DRAFT_COST_DECAY * self._scale
                                                             + (1 - DRAFT_COST_DECAY) * ratio)
        return self._scale if self._scale is not None else 1.0

    def drafting_cost(self, request: Any) -> float:
        """The step's drafting cost of a request (between ``propose`` and ``finish_step``) in ``cost``'s units: its
        measured drafting seconds over ``unit_seconds`` when set, else the meter's modeled cost."""
        modeled, seconds, _ = request.pending_drafting
        return seconds / self.unit_seconds if self.unit_seconds is not None else modeled

    def learn(self, arm: Any, path: Sequence[int], drafted: int, budget: int, draft_cost: float | None = None,
              catch_up: int = 0, lookup: AcceptanceCurve | None = None, running: int | None = None,
              backlog: int = 0) -> None:
        """The arm's curve learns from its verified draft: ``drafted`` nodes under node budget ``budget``, ``path``
        accepted; ``draft_cost`` (the step's drafting cost, ``drafting_cost``) updates its average drafting cost -
        or, where the drafter caught up more than ``max_width`` committed tokens (``catch_up``: a request's first
        draft feeds its prompt), its cost per caught-up token: ``(draft_cost - average) / catch_up``. A one-off
        catch-up is charged to its step's reward but is not the price of the request's later steps. ``lookup``: the
        arm's lookups drafted alone - this curve (the request's ``lookup_curve``) and their costs (``lookup_key``)
        learn instead. ``running``: the requests in the step - a steady step's cost is then also learnt as the price
        of ``budget`` nodes at that load level (``draft_prices``). ``backlog``: tokens committed before the step that
        the drafters had not read (steps the request decoded plain since it last drafted); their catch-up, at the
        arm's learnt cost per caught-up token, is taken out of the cost first - the price is what a step costs a
        request that drafts every step, and a step after plain ones (a probe's) must not teach that drafting is dearer
        than it is (each plain step would make the next drafting step dearer: a lock-in into plain steps)."""
        if not self.drafts(arm, budget):
            return
        key, curve = (self.lookup_key(arm), lookup) if lookup is not None else (self.curve_key(arm), self.curve(arm))
        curve.update(list(path), drafted, budget=max(budget, drafted))
        if draft_cost is None:
            return
        c = max(float(draft_cost), 0.0)
        if catch_up > self.max_width:
            key_costs, c = self.catch_up_rates, max(c - self.draft_costs.get(key, 0.0), 0.0) / catch_up
        else:
            key_costs = self.draft_costs
            c = max(c - self.catch_up_rates.get(key, 0.0) * min(max(int(backlog), 0), catch_up), 0.0)
            if running is not None:
                self.draft_prices.learn(key, load_level(running), budget, c)
        key_costs[key] = c if key not in key_costs else DRAFT_COST_DECAY * key_costs[key] + (1 - DRAFT_COST_DECAY) * c


__all__ = ["AdaptiveRecord", "AdaptiveSpeculation", "StepPlan"]
