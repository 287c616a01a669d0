"""Probes: a load level's exploration of wider drafts (docs/algorithms.md, "The step, adapting", 7.).

A load level never measures the widths it does not draft: a drafting price learnt high (a first contact, a slow
moment) or an acceptance curve learnt low (one unlucky wide draft) would keep it plain, or narrow, for good - wider
drafts are priced and rated from what narrower ones measured, and narrow drafts never sample the wide budgets. After
a run of steps at one width where a wider one was possible, one step drafts wider (``probe``): its verified draft
samples every narrower budget's acceptance at once, and its measured price and accepted tokens update the level's
estimates. The runs grow geometrically per level (``WidthRuns.period``: ``PROBE_FIRST`` steps, then twice as many
after each probe, up to ``PROBE_EVERY``). A level starts from priors - the start-up profile's forward extrapolated from
one and four tokens, no drafting measured - and with a fixed 16-step run four requests decoded 14-15 plain steps
before their first draft, and two running requests 13 plain steps and no draft at all (BENCHMARKS.md, "Probes that
reach the wide budgets"); a level whose probes lose still pays for one probe in ``PROBE_EVERY`` steps only.

A probe is exploration, so its width is chosen hopefully: each request's curve read by ``AcceptanceCurve.hopeful_many``
(a budget sampled less than the narrow one measured many times is rated as that one's acceptance implies, or at its
own upper confidence bound where it was sampled a few times: one unlucky wide draft is not its last word), the
forward wider than any level has run priced as the widest would be at this level (``ForwardRatios.hopeful``), and each
request may draft up to its ``reach`` - its arm's cap, or, where the request may switch arms
(``Request.can_switch_arm``), the widest budget arm of the same pool entry: the policy's arms score alike once the
allocator gives them all the same few nodes, and a probe capped by the narrow arm it settled on never sampled the wide
budgets again (BENCHMARKS.md, "Budget arms as exploration").

What a level's probes may lose is bounded (``ProbeBudget``). Beside 16 rows on this CPU a level's first probe drafted
48 nodes a request, each request's drafter reading its prompt first: 52-62 s for 133-145 tokens, where plain steps
made 16 tokens in 2 s - a third of the level's run lost to one probe. So per level a probe drafts at most twice the
widest the level has drafted (``ProbeBudget.most``: 4, 8, 16, ... from the narrowest budget arm up), and a level
probes only while its balance is not negative: each of its steps credits ``PROBE_SHARE`` of its measured cost, each
probe debits its loss - its measured cost less the cost at which the allocation it replaced would have committed the
same tokens (a gain credits). Probes that pay (a GPU's flat forward, one request on this CPU) keep the balance up;
probes that lose cost at most ``PROBE_SHARE`` of the level's time, once the first one's loss is repaid. Nor does a
probe make a drafter read a request's prompt unless the balance covers that catch-up (``ProbeBudget.affordable``).

A probe may also be bounded in how long it stalls the batch (``probe``'s ``stall``, ``serving.probe_stall``; off
unless set, 2 in the embedded serving pool): every running request waits for the step, so a probe is a gap in each of
their streams (a step of one request with none joining is not bounded: ``AdaptiveSpeculation.allocate``). With a
bound its padded verify forward may cost at most ``stall`` times the forward of the step it replaces, at the prices
its widths are rated at (a width wider than any level has run priced as the widest that has, so the first probe there
measures it), plus what the drafters of the requests it makes draft pay to read the tokens they have not fed
(``stall_cost``: a request's prompt, or the tokens it committed in plain steps since it last drafted, at the learnt
cost per caught-up token). Drafting's per-step price is left out (a drafting price learnt high is what a probe is
there to measure again); a read is not a price learnt, it is the tokens behind. Beside 12-16 rows on a CPU without
AVX512-BF16 the level's probes (4 nodes a row after runs of plain steps) took 3.2-3.5 s against ~1.0 s for a plain
step, their verify 2.5x of it: within a bound of 3 on the forward alone. Beside 16 rows on this CPU a probe of 4
nodes a request padded the forward to 80 tokens, 2.7 s against 0.58 s for a plain step, and set the streams'
99th-percentile inter-token latency. A bound of 3 did not remove it, at one thread or two (the estimate priced that
forward under 3x; BENCHMARKS.md, "Two threads per server on the Zen 4 CPU"); with a fresh level's drafting price
borrowed pessimistically it made 4 requests 1.22x speculation off against 1.12x without it at two threads ("A fresh
level's borrowed price read pessimistically"). The served pool's bound is 2: on a CPU without AVX512-BF16 a 16-row
first probe priced under 3x a plain step took 4x (the estimate of a width a level never ran a third low, or more),
and with 2 every load level kept within 0.95x of the best fixed configuration on the medians of two runs ("A probe
bound of 2, again").
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from ..pricing.allocator import Allocation, candidate_widths, expected_goodput

#: a load level's first probe: after this many steps in a row at one width where a wider one was possible
PROBE_FIRST = 2
#: each later probe of the level after twice the run of the one before, up to this many steps
PROBE_EVERY = 16
#: a probe drafts the widest width whose (hopeful) expected goodput is at least this share of the allocation's
PROBE_FLOOR = 0.9
#: the share of a load level's measured step cost its probes may lose (``ProbeBudget``)
PROBE_SHARE = 0.05


def checked_stall(stall: Any) -> float | None:
    """``stall`` as a probe's bound (``probe``): None (no bound) or a finite number >= 1, else a ``ValueError``."""
    if stall is None:
        return None
    if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not math.isfinite(stall) or stall < 1:
        raise ValueError(f"probe_stall must be a finite number >= 1 or None, got {stall!r}")
    return float(stall)


class _Hopeful:
    """A curve read hopefully (``AcceptanceCurve.hopeful_many``) where ``expected_goodput`` reads ``expected``."""

    def __init__(self, curve: Any):
        self.curve = curve

    def expected(self, d: float) -> float:
        hopeful = getattr(self.curve, "hopeful_many", None)
        return float(hopeful([d])[0]) if hopeful is not None else float(self.curve.expected(d))


class WidthRuns:
    """Per load level: the width of its last steps, how many steps in a row it held while a wider one was possible,
    and how many probes the level has had; ``due`` says when a probe is."""

    def __init__(self):
        self.runs: dict[int, tuple[int, int]] = {}  # load level -> (width, steps in a row at it)
        self.probes: dict[int, int] = {}  # load level -> probes so far

    def period(self, level: int) -> int:
        """Steps in a row at one width before the level's next probe: ``PROBE_FIRST`` doubled per probe the level has
        had, at most ``PROBE_EVERY`` (2, 4, 8, 16, 16, ...)."""
        return min(PROBE_EVERY, PROBE_FIRST << min(self.probes.get(level, 0), 16))

    def due(self, level: int, width: int, wider_possible: bool) -> bool:
        """Count a step of ``level`` at ``width``; True on the ``period``-th in a row at one width where a wider one
        was possible (the count starts again after it, or after a step where none was)."""
        if not wider_possible:
            self.runs.pop(level, None)
            return False
        last, run = self.runs.get(level, (width, 0))
        run = run + 1 if last == width else 1
        if run < self.period(level):
            self.runs[level] = (width, run)
            return False
        self.runs.pop(level, None)
        self.probes[level] = self.probes.get(level, 0) + 1
        return True


class ProbeBudget:
    """Per load level, what its probes may still lose and how wide they may draft (module docstring). The scheduler's
    step tells it the allocation it drafts (``planned``), each request's drafting cost and committed tokens
    (``add``) and the forward's cost (``settle``), in the allocator's cost units."""

    def __init__(self, share: float = PROBE_SHARE):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share!r}")
        self.share = float(share)
        self.balance: dict[int, float] = {}  # load level -> what its probes may still lose (cost units)
        self.widest: dict[int, int] = {}  # load level -> the most nodes a request drafted at it
        self._step: tuple[int, float | None] | None = None  # the step in flight: (level, replaced goodput if a probe)
        self._drafting, self._tokens = 0.0, 0

    def open(self, level: int) -> bool:
        """Whether ``level`` may probe: its balance is not negative."""
        return self.balance.get(level, 0.0) >= 0.0

    def most(self, level: int, width: int, least: int = 0) -> int:
        """The widest a probe of ``level`` may draft, its allocation drafting ``width``: twice the widest the level has
        drafted (this width included), not under ``least`` (the narrowest budget arm) and at least one node."""
        return max(2 * max(self.widest.get(level, 0), width), least, 1)

    def affordable(self, level: int, reach: Sequence[int], alloc: Allocation, catch_up: Sequence[float]) -> list[int]:
        """``reach`` with every request a probe would make read its text first - ``catch_up[i] > 0``, its drafters'
        estimated catch-up (its prompt, before its first draft), where the allocation gives it no nodes - held at the
        allocation's nodes, but for the cheapest whose catch-ups together ``level``'s balance covers: a probe explores
        widths; a drafter's first read of a request's text is the allocator's choice (priced, amortized) or paid from
        the balance. Beside 8 and 16 rows on a CPU whose forward is flat in tokens, a level's first probe made every
        drafter read its prompt: 8 s for 61 tokens where plain steps made 16 in 0.37 s (BENCHMARKS.md)."""
        allowance, out = max(self.balance.get(level, 0.0), 0.0), [int(r) for r in reach]
        for i in sorted(range(len(out)), key=lambda i: catch_up[i]):
            if catch_up[i] <= 0 or alloc.nodes[i] > 0:
                continue
            if catch_up[i] <= allowance:
                allowance -= catch_up[i]
            else:
                out[i] = alloc.nodes[i]
        return out

    def planned(self, level: int, alloc: Allocation, replaced: float) -> None:
        """The step drafts ``alloc`` at ``level``; ``replaced``: the goodput of the allocation a probe replaced."""
        self.widest[level] = max(self.widest.get(level, 0), max(alloc.nodes, default=0))
        self._step = (level, replaced if alloc.probe else None)
        self._drafting, self._tokens = 0.0, 0

    def add(self, drafting: float, tokens: int) -> None:
        """One request of the step drafted at ``drafting``'s cost and committed ``tokens`` tokens."""
        self._drafting += max(float(drafting), 0.0)
        self._tokens += int(tokens)

    def settle(self, forward: float) -> float | None:
        """The step's forward cost ``forward``: its level is credited ``share`` of the step's cost and, after a probe,
        debited its loss (returned; None after a step that was no probe or with none planned)."""
        if self._step is None:
            return None
        (level, replaced), cost = self._step, max(float(forward), 0.0) + self._drafting
        self._step = None
        loss = cost - self._tokens / replaced if replaced is not None and replaced > 0 else None
        self.balance[level] = self.balance.get(level, 0.0) + self.share * cost - (loss or 0.0)
        return loss


def wider_ratings(alloc: Allocation, curves: Sequence[Any], reach: Sequence[int], forward: Callable[[int], float],
                  costs: Sequence[Any] | None, max_width: int, most: int | None = None) -> dict[int, float]:
    """Every width wider than the allocation's that some request may reach, up to ``most`` nodes, rated for a probe:
    the allocator's own rating (``alloc.table``) or every request drafting ``min(width, reach_i)`` nodes read
    hopefully, whichever is higher."""
    hopeful = [None if cu is None else _Hopeful(cu) for cu in curves]
    ratings, top = {}, max(reach, default=0)
    widths = set(alloc.table) | set(candidate_widths(curves, reach, max_width))
    if most is not None and most < top:  # the bound is itself a width a probe may draft
        top = most
        widths.add(most)
    for x in sorted(widths):
        if alloc.width < x <= top:
            own = expected_goodput(hopeful, [min(x, r) for r in reach], forward, draft_costs=costs)
            ratings[x] = max(alloc.table.get(x, own), own)
    return ratings


def probe_width(ratings: dict[int, float], goodput: float, least: int = 0) -> int:
    """A probe's width from ``wider_ratings``: the widest rated at least ``PROBE_FLOOR`` times the allocation's
    ``goodput`` - beside 8 rows on this CPU a 32-48-node probe took the time of ~13 plain steps - else (none is: the
    level's curves or prices were learnt low) the widest rated at least ``PROBE_FLOOR`` times the best-rated wider one;
    and never under ``least`` (the narrowest budget the request's arms draft). Where every width rates under the
    allocation a per-step drafting price favours the narrowest, and one request decoding plain probed with 1 node in
    15 of 20 probes - samples of no budget its arms choose among, so a curve one unlucky first draft had learnt low
    stayed low for 300 steps (BENCHMARKS.md, "A start-up profile of 30 s instead of 5 s, tried")."""
    fair = [x for x, g in ratings.items() if g >= PROBE_FLOOR * goodput]
    if not fair:
        best = max(ratings.values())
        fair = [x for x, g in ratings.items() if g >= PROBE_FLOOR * best]
    return max(max(fair), min(least, max(ratings)))


def narrowest(siblings: Sequence[Any], cap: Callable[[Any], int]) -> int:
    """A probe's floor for a request: the narrowest ``cap`` among the budget arms it may switch to (``siblings``,
    more than one), else 0."""
    return min(cap(d) for d in siblings) if len(siblings) > 1 else 0


def stall_cost(nodes: Sequence[int], options: Sequence[int], forward: Callable[[int], float],
               reads: Sequence[float] | None = None) -> float:
    """How long a step drafting ``nodes`` holds the batch, as ``probe``'s ``stall`` bounds it: its padded verify
    forward, every row at ``1 + max(nodes)`` tokens, plus ``reads[i]`` (the request's drafters reading the tokens they
    have not fed, ``AdaptiveSpeculation.read_cost``) for each request that drafts with its model (``nodes[i] > 0``,
    not on its lookups alone: ``options[i] == 0``). Drafting's per-step price is left out (module docstring)."""
    rows = len(nodes)
    cost = float(forward(rows * (1 + max(nodes, default=0))))
    if reads is not None:
        cost += sum(float(r) for r, d, o in zip(reads, nodes, options) if d > 0 and o == 0)
    return cost


def probe(alloc: Allocation, curves: Sequence[Any], reach: Sequence[int], forward: Callable[[int], float],
          costs: Sequence[Any] | None, max_width: int, hopeful: Callable[[int], float] | None = None,
          alternatives: Sequence[Any] | None = None, least: int = 0, most: int | None = None,
          stall: float | None = None, reads: Sequence[float] | None = None) -> Allocation:
    """The probe replacing ``alloc``: every request drafts ``min(w, reach_i)`` nodes, ``w`` the ``probe_width`` of
    the wider widths' ratings (``wider_ratings``, up to ``most`` nodes) and ``least`` among the widths whose step
    stalls the batch at most ``stall`` times as long as ``alloc``'s (``stall_cost``; None: no bound) - ``alloc``
    itself, no probe, where none does or the widest that does is under the width ``least`` would ask for. Its
    expected goodput and tokens are those of its own nodes (``expected_goodput`` at ``forward`` and the drafting
    ``costs`` the allocation was planned with), not of the allocation it replaces; its table holds the allocator's
    ratings and the probe's. ``hopeful``: the forward's price read hopefully for the ratings
    (``AdaptiveSpeculation.forward_cost(..., hopeful=True)``: a width the level never ran priced as the widest it did),
    default ``forward``. A request the allocation put on one of its ``alternatives`` (its lookups alone: its model
    would first read its unread text) keeps that option, read at its curve and cost; its ``reach`` is the nodes it was
    given."""
    curves, costs = list(curves), None if costs is None else list(costs)
    for i, o in enumerate(alloc.options):
        if o > 0:
            curves[i], cost = alternatives[i][o - 1]
            if costs is not None:
                costs[i] = cost
    price = forward if hopeful is None else hopeful
    ratings = wider_ratings(alloc, curves, reach, price, costs, max_width, most)
    if stall is not None and ratings:  # a probe is a gap in every running request's stream: bounded
        limit = stall * stall_cost(alloc.nodes, alloc.options, price, reads)
        fits = {x: g for x, g in ratings.items()
                if stall_cost([min(x, r) for r in reach], alloc.options, price, reads) <= limit}
        if not fits or max(fits) < min(least, max(ratings)):
            return alloc
        ratings = fits
    w = probe_width(ratings, alloc.goodput, least)
    nodes = [min(w, r) for r in reach]
    tokens = len(reach) + sum(float(cu.expected(d)) for cu, d in zip(curves, nodes) if cu is not None)
    goodput = expected_goodput(curves, nodes, forward, draft_costs=costs)
    options = [o if d > 0 else 0 for o, d in zip(alloc.options, nodes)]
    return Allocation(nodes, w, goodput, {**alloc.table, **ratings}, options, tokens, probe=True)


__all__ = ["PROBE_EVERY", "PROBE_FIRST", "PROBE_FLOOR", "PROBE_SHARE", "ProbeBudget", "WidthRuns",
           "checked_stall", "narrowest", "probe", "probe_width", "stall_cost", "wider_ratings"]
