"""Acceptance curves: per drafter, the expected accepted draft tokens as a function of the node budget
(docs/algorithms.md#speculation-under-load).

``AcceptanceCurve`` keeps, for each budget ``d`` of a grid (default 1, 2, 4, 8, 16, 32, 48, 64), a running estimate of

    a(d) = E[accepted draft tokens | the drafter may propose d nodes]        (bonus token excluded)

learnt from the steps the drafter's drafts were verified in. One verified draft of ``n`` nodes is a sample for every
budget ``d <= n`` at once: cutting the draft to its first ``d`` nodes keeps an ancestor-closed subtree (a node's parent
comes before it), and the path the verifier would have accepted in it is the accepted path's prefix of nodes with
index ``< d`` (``accepted_within``). Under greedy decoding that is exact - the accepted path follows the verifier's
argmax, and a (parent, token) pair names at most one node. Under sampling it is a common-random-numbers sample (the
same draws decide). It assumes the drafter's ``d``-node draft is the first ``d`` nodes of its larger one (true for
chains and for trees built best-first, in the order their nodes are numbered; approximate for drafters that would
build a different tree at a smaller budget).

All functions are pure Python / numpy; nothing here reads a clock or a model.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

#: the default budget grid (node counts)
DEFAULT_GRID: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)


def accepted_within(path: Sequence[int], budget: int) -> int:
    """Accepted draft tokens had the draft been cut to its first ``budget`` nodes: the length of the longest prefix
    of ``path`` (accepted node indices, root to leaf) whose nodes all have an index ``< budget``."""
    count = 0
    for node in path:
        if node >= budget:
            break
        count += 1
    return count


def geometric_prior(alpha: float, d: float) -> float:
    """E[accepted] of a chain of ``d`` tokens each accepted with probability ``alpha`` given its parent was:
    ``sum_{i=1..d} alpha^i = alpha (1 - alpha^d) / (1 - alpha)`` (``d`` for ``alpha = 1``). Non-decreasing in ``d``
    and ``<= d``."""
    if alpha >= 1.0:
        return float(d)
    return alpha * (1.0 - alpha ** d) / (1.0 - alpha)


def implied_alpha(value: float, d: int) -> float:
    """The per-token acceptance ``alpha`` of the chain whose ``geometric_prior(alpha, d)`` is ``value`` (0 for
    ``value <= 0``, 1 for ``value >= d``): bisection, the prior being increasing in ``alpha``."""
    if value <= 0.0:
        return 0.0
    if value >= d:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if geometric_prior(mid, d) < value else (lo, mid)
    return 0.5 * (lo + hi)


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares projection of ``values`` onto non-decreasing sequences (pool adjacent violators).

    values, weights: [G] (weights > 0). A pooled block's value is a weighted mean that lies below its first value
    (blocks pool only when the left one is higher), so ``values[g] <= grid[g]`` survives the projection."""
    blocks: list[list[float]] = []  # [value, weight, length]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return np.array([v for v, _, n in blocks for _ in range(n)], dtype=np.float64)


class AcceptanceCurve:
    """Running estimate of ``a(d) = E[accepted draft tokens | node budget d]`` for one arm (drafter), on a grid of
    budgets, updated from each verified draft (see the module docstring for why one draft samples every smaller
    budget).

    **Estimator.** Per grid point, a bias-corrected exponential moving average: sample ``k`` at a point moves its mean
    by ``(x - mean) * max(1 / k, 1 - decay)``, so the first ``1 / (1 - decay)`` samples give their plain (count-
    weighted) mean and later ones an exponential one with memory ``~1 / (1 - decay)`` samples (default ``decay=0.95``:
    ~20 drafts). Why not a plain mean: acceptance drifts - within a request (prose, then a copied block) and across
    the requests a persistent estimate serves - and a count-weighted mean would freeze after a few hundred steps.
    Why not a plain EMA: its first samples would be pulled towards the initial value.

    **Prior.** ``prior_alpha`` defines ``prior(d) = geometric_prior(prior_alpha, d)`` (a chain accepted token by token
    with probability ``prior_alpha``; default 0.5, so ``prior(d) < 1`` for every d), worth ``prior_weight`` samples
    (default 1) at every grid point that has samples: ``value(d) = (prior_weight * prior(d) + n_eff(d) * mean(d)) /
    (prior_weight + n_eff(d))``, ``n_eff`` the sample count capped at ``1 / (1 - decay)``. A budget without samples
    is ``prior(d)`` clipped into ``[value of the nearest seen budget below, value of the nearest seen budget above]``:
    with no data the curve is the prior; beyond the widest budget seen ``d*`` it is the chain that budget's value
    implies - ``prior_alpha`` replaced by the ``alpha`` with ``geometric_prior(alpha, d*) = a(d*)`` (``implied_alpha``)
    - or the prior, whichever is higher; an unseen budget never moves a seen one. Beyond ``d*`` the curve is thus as
    hopeful as the drafts seen: a flat line there would be self-confirming where nothing drafts wider for free (at
    one running request, with drafting priced, the allocator would never try a wider budget); within the seen range
    the prior is neither optimistic nor pessimistic - the allocator explores wider budgets for free through padding
    (a request drafts up to the batch's common width whenever drafting costs nothing), and those drafts sample the
    wider points.

    **Shape.** ``values()`` is the weighted isotonic (pool-adjacent-violators) projection of the seen points' values
    onto non-decreasing sequences (weights ``prior_weight + n_eff``), the unseen points filled in as above, then
    capped at ``d``. Every sample at ``d`` is ``<= d``, and so is the prior, so the cap only guards rounding. So ``a``
    is non-decreasing and ``a(d) <= d`` by construction. ``expected(d)`` interpolates linearly between (0, 0) and the
    grid points (which keeps both properties) and holds the last value beyond the grid (no evidence that more nodes
    help).

    Parameters: ``grid`` (strictly increasing positive node counts), ``decay`` in [0, 1) (0: the last sample only),
    ``prior_alpha`` in [0, 1], ``prior_weight`` > 0. Deterministic; state is JSON-serialisable (``state_dict``).
    """

    def __init__(self, grid: Iterable[int] = DEFAULT_GRID, *, decay: float = 0.95, prior_alpha: float = 0.5,
                 prior_weight: float = 1.0):
        grid = [int(g) for g in grid]
        if not grid or any(g < 1 for g in grid) or any(b <= a for a, b in zip(grid, grid[1:])):
            raise ValueError(f"AcceptanceCurve: grid must be strictly increasing positive node counts, got {grid}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"AcceptanceCurve: decay must be in [0, 1), got {decay!r}")
        if not 0.0 <= prior_alpha <= 1.0:
            raise ValueError(f"AcceptanceCurve: prior_alpha must be in [0, 1], got {prior_alpha!r}")
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"AcceptanceCurve: prior_weight must be > 0, got {prior_weight!r}")
        self.grid = np.asarray(grid, dtype=np.int64)  # [G]
        self.decay, self.prior_alpha, self.prior_weight = float(decay), float(prior_alpha), float(prior_weight)
        self.prior = np.array([geometric_prior(self.prior_alpha, g) for g in grid], dtype=np.float64)  # [G]
        self.reset()

    def reset(self) -> None:
        """Forget every sample (back to the prior)."""
        self.means = np.zeros(len(self.grid), dtype=np.float64)  # [G] running mean of the samples at each point
        self.counts = np.zeros(len(self.grid), dtype=np.int64)  # [G] samples seen at each point
        self._cache: np.ndarray | None = None

    # -- learning ----------------------------------------------------------------------------------------------
    def update(self, path: Sequence[int] | int, drafted: int, *, budget: int | None = None) -> None:
        """Learn from one verified draft.

        path: the accepted node indices, root to leaf (``Acceptance.path``), or for a chain the accepted count ``n``
            (the path ``0..n-1``).
        drafted: the draft's node count; every grid budget ``d <= drafted`` gets the sample ``accepted_within(path,
        d)``. budget: the node budget the drafter was given (default ``drafted``). When it drafted fewer nodes than
            allowed (a lookup drafter with a short match, a model drafter that stopped early) its draft is what every
            budget in ``(drafted, budget]`` would have produced too, so those grid points get the full draft's count.
        """
        if isinstance(path, (int, np.integer)):
            path = range(int(path))
        path = [int(p) for p in path]
        drafted = int(drafted)
        budget = drafted if budget is None else max(int(budget), drafted)
        if drafted < 0 or len(path) > drafted or any(p < 0 or p >= max(drafted, 1) for p in path):
            raise ValueError(f"AcceptanceCurve.update: path {path} does not fit a draft of {drafted} nodes")
        full = len(path)
        for g, d in enumerate(self.grid.tolist()):
            if d > budget:
                break
            x = accepted_within(path, d) if d <= drafted else full
            self.counts[g] += 1
            rate = max(1.0 / self.counts[g], 1.0 - self.decay)
            self.means[g] += (x - self.means[g]) * rate
        self._cache = None

    # -- reading -----------------------------------------------------------------------------------------------
    def n_eff(self) -> np.ndarray:
        """[G] effective sample counts: the counts capped at the exponential memory ``1 / (1 - decay)``."""
        return np.minimum(self.counts.astype(np.float64), 1.0 / (1.0 - self.decay))

    def values(self) -> np.ndarray:
        """[G] the estimate at each grid point: prior and samples mixed, projected to non-decreasing, capped at d."""
        if self._cache is None:
            n = self.n_eff()
            w = self.prior_weight + n  # [G]
            raw = (self.prior_weight * self.prior + n * self.means) / w  # [G]
            seen = self.counts > 0  # [G]
            out = self.prior.copy()
            out[seen] = _isotonic(raw[seen], w[seen])
            # an unseen budget: the prior, clipped into [nearest seen value below, nearest seen value above]
            fitted = np.where(seen, out, -np.inf)
            lo = np.maximum.accumulate(np.concatenate([[0.0], fitted[:-1]]))  # [G] best seen value to the left
            above = np.where(seen, out, np.inf)
            hi = np.minimum.accumulate(above[::-1])[::-1]  # [G] smallest seen value to the right (or here)
            out = np.where(seen, out, np.clip(self.prior, lo, np.maximum(lo, hi)))
            if seen.any():  # beyond the widest budget seen: the chain its acceptance implies, not a flat line
                last = int(np.flatnonzero(seen)[-1])
                alpha = implied_alpha(float(out[last]), int(self.grid[last]))
                beyond = np.arange(len(self.grid)) > last
                out[beyond] = np.maximum(out[beyond], [geometric_prior(alpha, int(d)) for d in self.grid[beyond]])
            self._cache = np.minimum(np.maximum.accumulate(out), self.grid.astype(np.float64))
        return self._cache

    def expected(self, d: float) -> float:
        """E[accepted | budget d]: linear interpolation through (0, 0) and the grid points; the last grid value
        beyond the grid; 0 for ``d <= 0``."""
        return float(self.expected_many([d])[0])

    def expected_many(self, ds: Sequence[float] | np.ndarray) -> np.ndarray:
        """``expected`` for several budgets at once: [len(ds)] float64."""
        return self._interpolated(ds, self.values())

    def hopeful_many(self, ds: Sequence[float] | np.ndarray) -> np.ndarray:
        """[len(ds)] a hopeful reading, for exploration (a scheduler's probe; the allocator reads ``expected``): where a
        budget wider than the widest well-sampled one ``d*`` has fewer effective samples (``n_eff``: the estimate's
        memory, not the lifetime count - a budget a probe samples once in 16 steps is read as learnt once its memory
        is as full) - ``d*`` the widest grid point with at least half the most-sampled one's - the chain ``a(d*)``
        implies (``implied_alpha``) if that is higher than the estimate. Narrow drafts never sample wide budgets, so
        one unlucky wide draft (a first contact's) would otherwise rate them low for good; read hopefully, they are as
        good as the narrow budget measured many times promises. A budget sampled fewer times than ``d*`` (but sampled)
        is also read at its upper confidence bound, ``a + (d - a) * w / (w + n_eff)`` (``w`` = ``prior_weight``: the
        samples it has, and ``w`` pseudo-samples of a draft accepted whole): the chain ``a(d*)`` implies is no hope
        where the narrow budget is mediocre but its drafts often accepted whole (bursts: code, copied text) - one
        request on a CPU without AVX512-BF16 probed 4 nodes for 180 steps after a 16-node first draft accepted 1,
        though 16-node drafts later accepted 15, 14, 7 (BENCHMARKS.md, "One unlucky first draft"). The bound shrinks
        as the budget's own samples come in. Non-decreasing and ``<= d`` as ``values()``; the prior where nothing
        was sampled."""
        out = self.values().copy()  # [G]
        n = self.n_eff()  # [G]
        if n.max() > 0:
            well = int(np.flatnonzero(n * 2 >= n.max())[-1])
            alpha = implied_alpha(float(out[well]), int(self.grid[well]))
            chain = np.array([geometric_prior(alpha, int(d)) for d in self.grid.tolist()])  # [G]
            fewer = (np.arange(len(self.grid)) > well) & (n < n[well])
            grid = self.grid.astype(np.float64)  # [G]
            bound = np.where(self.counts > 0, out + (grid - out) * self.prior_weight / (self.prior_weight + n), out)
            out = np.where(fewer, np.maximum(out, np.maximum(chain, bound)), out)
            out = np.minimum(np.maximum.accumulate(out), grid)
        return self._interpolated(ds, out)

    def _interpolated(self, ds: Sequence[float] | np.ndarray, values: np.ndarray) -> np.ndarray:
        """[len(ds)] ``values`` ([G], one per grid point) read at budgets ``ds``: linear through (0, 0) and the grid
        points, the last value beyond the grid, 0 for ``d <= 0``."""
        xs = np.concatenate([[0.0], self.grid.astype(np.float64)])
        return np.interp(np.maximum(np.asarray(ds, dtype=np.float64), 0.0), xs, np.concatenate([[0.0], values]))

    # -- persistence -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the configuration, to check on load, and the samples)."""
        return {"grid": self.grid.tolist(), "decay": self.decay, "prior_alpha": self.prior_alpha,
                "prior_weight": self.prior_weight, "means": self.means.tolist(), "counts": self.counts.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s samples; ``ValueError`` when the state was made on another grid."""
        if list(state["grid"]) != self.grid.tolist():
            raise ValueError(f"AcceptanceCurve: state grid {list(state['grid'])} != {self.grid.tolist()}")
        self.means = np.asarray(state["means"], dtype=np.float64).copy()
        self.counts = np.asarray(state["counts"], dtype=np.int64).copy()
        self._cache = None

    def __repr__(self) -> str:
        pts = ", ".join(f"{d}: {v:.2f}" for d, v in zip(self.grid.tolist(), self.values().tolist()))
        return f"AcceptanceCurve({{{pts}}})"


__all__ = ["DEFAULT_GRID", "AcceptanceCurve", "accepted_within", "geometric_prior", "implied_alpha"]
