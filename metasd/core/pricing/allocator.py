"""The step budget allocator: how many draft nodes each running request may verify in one batched forward
(docs/algorithms.md#speculation-under-load).

B running requests are verified as one padded ``[B, N]`` forward, ``N = 1 + max_i d_i``: row i holds its pending
token, its ``d_i`` draft nodes and padding. The forward costs ``cost(B * N)`` whatever the shorter drafts are, so
within one step every node up to the widest draft is free for the verifier. A step commits, per request, its
accepted tokens plus one (the bonus, or the pending token's successor for a request that did not draft), so its
expected goodput is

    G(d_1..d_B) = (B + sum_i a_i(d_i)) / (cost(B * (1 + max_i d_i)) + sum_i c_i(d_i))

with ``a_i`` request i's arm's acceptance curve (``metasd.core.pricing.acceptance_curve``) and ``c_i(d)`` its drafting
cost for ``d`` nodes (0 when not given: drafting is free or already paid). The pending token is always in: ``d_i = 0``
still verifies row i with one token and commits one token, so no running request ever stalls.

**The width scan.** Because of padding the decision is the common width ``w = max_i d_i``. For each candidate ``w``
(0, every grid point of the curves, every cap, ``max_width``; all clipped to the budget) the allocator sets

- without drafting costs: ``d_i = min(w, cap_i)`` - a node below the width costs the verifier nothing and ``a_i`` is
  non-decreasing, so more never hurts;
- with drafting costs: the best ``d_i`` among the candidate budgets ``<= min(w, cap_i)`` for the ratio above, by
  Dinkelbach's method - at the optimum ``g*`` each request maximises ``a_i(d) - g* c_i(d)`` on its own, so: start
  from ``d_i = min(w, cap_i)``, set ``g`` to its goodput, let each request pick its ``argmax_d a_i(d) - g c_i(d)``
  (largest d on ties), recompute ``g``, repeat until the choice stands (a few rounds; ``g`` never decreases). A
  request drafts less than the width when its marginal tokens cost more drafting than they earn at the batch's rate.

and keeps the width whose allocation has the highest goodput (smallest w on ties) - a drafting width only where its
goodput is at least ``min_gain`` times plain decoding's (``w = 0``): a margin for what the model does not see (its
estimates' error, work outside the priced forwards), so that a step drafts only for an expected gain, not a tie.
Candidate widths are grid points (and caps) so that a chosen width feeds its own point of the curves: a width between
grid points would only ever be known by interpolation. With curves that are linear between their grid points
(``AcceptanceCurve``) and an affine ``cost`` the goodput of a common width is linear over affine between two
candidates, so the scan's best is the best of every integer width; otherwise ``plan(..., widths=range(top + 1))``
scans them all. Cost: O(B * C) curve reads and O(B * C) work per width without drafting costs, O(B * C) per
Dinkelbach round per width with them (numpy, C candidates); deterministic.

**Alternatives.** A request may have other ways to draft than its arm's (``plan(..., alternatives=)``: more (curve,
drafting cost) pairs under the same cap - ``metasd.core.batching.adaptive`` offers a cascade's lookup arms alone while
its model has the prompt still to read). Its candidates are then every (option, budget) pair; Dinkelbach's step picks
the pair maximising ``a(d) - g c(d)`` as it picks a budget (largest budget on ties, then the arm's own option), and the
chosen options are returned (``Allocation.options``). Cost: the work above times the number of options.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import numpy as np


class Curve(Protocol):
    """What the allocator reads of an acceptance curve (``AcceptanceCurve`` is one)."""

    def expected(self, d: float) -> float: ...


@dataclass(frozen=True)
class Allocation:
    """The allocator's decision and what it weighed.

    nodes: ``d_i`` per request (``0 <= d_i <= min(cap_i, max_width)``); row i of the forward holds ``1 + d_i`` tokens.
    width: the chosen common width ``max_i d_i``'s candidate (the forward's ``N`` is ``1 + max(nodes)``).
    goodput: the expected goodput of ``nodes`` (committed tokens per unit of cost).
    table: candidate width -> the expected goodput of the allocation made for it (for logs and tests).
    options: per request, the option it drafts with: 0 its arm's curve and cost, k > 0 ``alternatives[i][k - 1]``
        (0 where it drafts no node).
    tokens: the tokens ``nodes`` are expected to commit, ``B + sum_i a_i(d_i)`` (its cost is ``tokens / goodput``).
    probe: True where an exploration step made it instead of the allocator (``metasd.core.batching.probes``).
    """

    nodes: list[int]
    width: int
    goodput: float
    table: dict[int, float] = field(default_factory=dict)
    options: list[int] = field(default_factory=list)
    tokens: float = 0.0
    probe: bool = False


def _curve_values(curve: Curve, ws: np.ndarray) -> np.ndarray:
    """[C] the curve's E[accepted] at each budget of ``ws``."""
    many = getattr(curve, "expected_many", None)
    if many is not None:
        return np.asarray(many(ws), dtype=np.float64)
    return np.array([float(curve.expected(int(w))) for w in ws.tolist()], dtype=np.float64)


def _cost_values(fn: Callable[[int], float], ws: np.ndarray) -> np.ndarray:
    """[C] the drafting cost at each budget of ``ws`` (``fn.many`` where it has one: ``DraftCost``)."""
    many = getattr(fn, "many", None)
    if many is not None:
        return np.asarray(many(ws), dtype=np.float64)
    return np.array([float(fn(int(w))) for w in ws.tolist()], dtype=np.float64)


def _int(value, what: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"allocate: {what} must be an integer >= 0, got {value!r}")
    return int(value)


def candidate_widths(curves: Sequence[Optional[Curve]], caps: Sequence[int], max_width: int | None = None
                     ) -> list[int]:
    """The widths the allocator scans: 0, every grid point of the curves (``curve.grid`` where present), every cap of a
    speculating request and ``max_width``, clipped to ``min(max_width, largest cap)``, sorted, without repeats."""
    spec_caps = [int(c) for cu, c in zip(curves, caps) if cu is not None]
    top = max(spec_caps, default=0)
    if max_width is not None:
        top = min(top, int(max_width))
    ws = {0, top, *spec_caps}
    for cu in curves:
        if cu is not None and getattr(cu, "grid", None) is not None:
            ws.update(int(g) for g in np.asarray(cu.grid).tolist())
    return sorted(w for w in ws if w <= top)


def checked_min_gain(value, where: str = "") -> float:
    """``value`` as a float if it is a finite number >= 1 (a drafting width's least goodput over a plain step's),
    else a ``ValueError`` starting with ``where``."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1.0):
        raise ValueError(f"{where}min_gain must be a finite number >= 1, got {value!r}")
    return float(value)


def plan(curves: Sequence[Optional[Curve]], caps: Sequence[int], cost: Callable[[int], float], *,
         max_width: int | None = None, draft_costs: Sequence[Optional[Callable[[int], float]]] | None = None,
         widths: Sequence[int] | None = None, min_gain: float = 1.0,
         alternatives: Sequence[Optional[Sequence[tuple[Curve, Optional[Callable[[int], float]]]]]] | None = None
         ) -> Allocation:
    """Choose each running request's draft nodes for one step, maximising the expected goodput (module docstring).

    curves: per request, its arm's acceptance curve (anything with ``expected(d)``), or None: the request does not
        speculate this step (``d_i = 0``).
    caps: per request, its arm's node budget (``cascade@16``: 16); ``d_i <= caps[i]``.
    cost: the verifier forward's cost over ``n`` tokens in all (``B * N`` with padding), any positive non-decreasing
        function; in units of a 1-token forward, goodput 1.0 is plain decoding's rate at batch 1.
    max_width: the step's node budget: no ``d_i`` exceeds it (None: the caps alone bound).
    draft_costs: per request, None or ``c_i(d)``, its drafting cost for ``d`` nodes in ``cost``'s units (``c_i(0)``
        should be 0); the costs add up (requests draft one after another).
    widths: the candidate widths to scan instead of ``candidate_widths`` (clipped to the budget; 0 always added).
    min_gain: a drafting width is chosen only where its goodput is >= ``min_gain`` x the plain step's (w = 0); >= 1.
    alternatives: per request, None or more ``(curve, draft_cost)`` options under the same cap (the module
        docstring); ignored for a request without a curve.

    Returns an ``Allocation`` (``nodes``, ``width``, ``goodput``, ``table``, ``options``). An empty batch gets empty
    nodes.
    """
    B = len(curves)
    checked_min_gain(min_gain, "allocate: ")
    if len(caps) != B:
        raise ValueError(f"allocate: {B} curves but {len(caps)} caps")
    if draft_costs is not None and len(draft_costs) != B:
        raise ValueError(f"allocate: {B} curves but {len(draft_costs)} draft costs")
    if alternatives is not None and len(alternatives) != B:
        raise ValueError(f"allocate: {B} curves but {len(alternatives)} alternatives")
    caps_ = [_int(c, f"caps[{i}]") for i, c in enumerate(caps)]
    if max_width is not None:
        max_width = _int(max_width, "max_width")
        caps_ = [min(c, max_width) for c in caps_]
    caps_ = [c if cu is not None else 0 for cu, c in zip(curves, caps_)]  # a curve-less request does not speculate
    if B == 0:
        return Allocation([], 0, 0.0, {}, [])
    # options[i]: request i's (curve, drafting cost) pairs, its arm's first (a curve-less request has no other)
    others = alternatives if alternatives is not None else [None] * B
    options = [[(cu, None if draft_costs is None else draft_costs[i]), *((others[i] or []) if cu is not None else [])]
               for i, cu in enumerate(curves)]
    top = max(caps_)
    if widths is None:
        W = candidate_widths(curves, caps_, max_width)
    else:
        W = sorted({0, *(min(_int(w, "widths[]"), top) for w in widths)})
    # every cap must be a column so that min(w, cap_i) is one: C candidate budgets, ascending
    W = sorted(set(W) | set(caps_))
    ws = np.asarray(W, dtype=np.int64)  # [C]
    C, O = len(W), max(len(o) for o in options)
    col = {w: k for k, w in enumerate(W)}
    cap_col = np.array([col[c] for c in caps_], dtype=np.int64)  # [B]

    # candidate (budget k, option o) is a column: acc[i, column] = a_io(W_k), dc[i, column] = c_io(W_k); columns
    # beyond cap_i or of a missing option are never allowed
    acc = np.zeros((B, C, O), dtype=np.float64)
    dc = np.zeros((B, C, O), dtype=np.float64)
    valid = np.zeros((B, O), dtype=bool)  # [B, O] the options each request has
    priced = np.zeros(B, dtype=bool)  # [B] requests with a drafting cost or a choice of options
    read: dict[tuple, np.ndarray] = {}  # (reader, id of a curve or cost) -> its [C] values: one read each, shared

    def values(what, n: int, at: Callable[[object, np.ndarray], np.ndarray]) -> np.ndarray:  # [n] the first n
        key = (at, id(what))  # ``options`` holds every curve and cost alive until the end: ids stay theirs
        if key not in read:
            read[key] = at(what, ws)
        return read[key][:n]

    for i, opts in enumerate(options):
        if opts[0][0] is None:
            continue
        n = int(cap_col[i]) + 1
        priced[i] = len(opts) > 1
        for o, (cu, fn) in enumerate(opts):
            valid[i, o] = True
            acc[i, :n, o] = np.minimum(np.maximum(values(cu, n, _curve_values), 0.0), ws[:n])  # 0 <= a(d) <= d
            if fn is not None:
                priced[i] = True
                dc[i, :n, o] = values(fn, n, _cost_values)
    if not np.all(np.isfinite(dc)) or np.any(dc < 0):
        raise ValueError("allocate: drafting costs must be finite and >= 0")
    # options in reverse within a budget, so that on a tie the largest column is the lowest option (the arm's own)
    acc, dc = acc[:, :, ::-1].reshape(B, C * O), dc[:, :, ::-1].reshape(B, C * O)  # [B, C * O]
    budget_of = np.repeat(np.arange(C), O)  # [C * O] column -> its budget's index k
    option_of = np.tile(np.arange(O)[::-1], C)  # [C * O] column -> its option o

    cost_memo: dict[int, float] = {}

    def forward(n_tokens: int) -> float:
        if n_tokens not in cost_memo:
            value = float(cost(n_tokens))
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"allocate: cost({n_tokens}) must be finite and > 0, got {value!r}")
            cost_memo[n_tokens] = value
        return cost_memo[n_tokens]

    rows = np.arange(B)

    def goodput(pick: np.ndarray) -> float:  # pick: [B] column per request
        width = int(ws[budget_of[pick]].max())
        return (B + acc[rows, pick].sum()) / (forward(B * (1 + width)) + dc[rows, pick].sum())

    best: tuple[float, int, np.ndarray] | None = None
    table: dict[int, float] = {}
    for j, w in enumerate(W):
        pick = np.minimum(cap_col, j) * O + O - 1  # [B] d_i = min(w, cap_i), each with its arm's option
        if priced.any():
            # Dinkelbach for the ratio with the forward charged at this width, F = cost(B (1 + w)), over each priced
            # request's candidates with budgets <= min(w, cap_i) (free requests keep min(w, cap_i)): at the optimum
            # g*, every request maximises a_i(d) - g* c_i(d) on its own
            F = forward(B * (1 + w))
            allowed = (budget_of[None, :] <= (pick // O)[:, None]) & valid[:, option_of]  # [B, C * O]

            def ratio(p: np.ndarray) -> float:
                return (B + acc[rows, p].sum()) / (F + dc[rows, p].sum())

            g = ratio(pick)
            for _ in range(100):  # finite: g rises strictly each round over finitely many choices
                score = np.where(allowed, acc - g * dc, -np.inf)  # [B, C * O]
                # [B] on ties: the largest budget, then the lowest option
                choice = C * O - 1 - np.argmax(score[:, ::-1], axis=1)
                choice = np.where(priced, choice, pick)
                g_new = ratio(choice)
                if not g_new > g:  # no choice beats g: pick is optimal for this width
                    break
                pick, g = choice, g_new
        g = goodput(pick)  # the true forward: N = 1 + max_i d_i (<= 1 + w)
        table[w] = float(g)
        if w > 0 and g < min_gain * table[0]:  # W[0] == 0: the plain step's goodput is known first
            continue
        if best is None or g > best[0]:
            best = (float(g), w, pick.copy())
    g, w, pick = best
    nodes = [int(x) for x in ws[budget_of[pick]].tolist()]
    options = [int(o) if d > 0 else 0 for o, d in zip(option_of[pick].tolist(), nodes)]  # no node: no option
    return Allocation(nodes, int(w), g, table, options, float(B + acc[rows, pick].sum()))


def allocate(curves: Sequence[Optional[Curve]], caps: Sequence[int], cost: Callable[[int], float], *,
             max_width: int | None = None, draft_costs: Sequence[Optional[Callable[[int], float]]] | None = None
             ) -> list[int]:
    """Each running request's draft nodes for one step: ``plan(...).nodes`` (see ``plan`` and the module docstring).
    ``0 <= d_i <= min(caps[i], max_width)``; every request is verified with its pending token plus ``d_i`` nodes."""
    return plan(curves, caps, cost, max_width=max_width, draft_costs=draft_costs).nodes


def expected_goodput(curves: Sequence[Optional[Curve]], nodes: Sequence[int], cost: Callable[[int], float], *,
                     draft_costs: Sequence[Optional[Callable[[int], float]]] | None = None) -> float:
    """The expected goodput of a given allocation ``nodes`` (the allocator's objective, for comparisons):
    ``(B + sum_i a_i(d_i)) / (cost(B * (1 + max_i d_i)) + sum_i c_i(d_i))``; a request without a curve accepts 0."""
    B = len(nodes)
    if B == 0:
        return 0.0
    acc = sum(0.0 if cu is None else min(max(float(cu.expected(int(d))), 0.0), d) for cu, d in zip(curves, nodes))
    drafting = 0.0 if draft_costs is None else sum(0.0 if fn is None else float(fn(int(d)))
                                                    for fn, d in zip(draft_costs, nodes))
    return (B + acc) / (float(cost(B * (1 + max(nodes)))) + drafting)


__all__ = ["Allocation", "Curve", "allocate", "candidate_widths", "checked_min_gain", "expected_goodput", "plan"]
