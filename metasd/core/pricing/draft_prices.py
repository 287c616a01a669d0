"""What a drafting step costs, learnt per arm, per load level and per node budget (docs/algorithms.md#speculation-under-load).

The allocator (``metasd.core.pricing.allocator``) charges a request ``c(d)`` for drafting ``d`` nodes. One average per
arm is wrong twice over:

- **by budget**: a model drafter asked for ``d`` nodes runs about one forward per level of its tree, so 4 nodes cost a
  fraction of 48 - an average learnt while drafting 32-node trees prices a 4-node draft at a 32-node one's cost;
- **by load**: with batched drafting (``metasd.core.batching.drafting``) every request drafting with a model shares
  each level's forward, so a request's share falls as more requests draft beside it - a price learnt with one request
  running says little of four (on this CPU in bf16: a 0.5B drafter's step learnt at 1.99 verifier forwards alone kept
  the allocator from drafting at 4 requests, where a fixed 8-node tree was 1.5x plain decoding).

``DraftPrices`` keeps an exponential average per (arm, load level, budget). ``price`` reads a budget's own average;
between two budgets learnt at the same level, it interpolates linearly; below the smallest it scales that one by
``d / budget`` (drafting fewer nodes never costs more forwards); above the largest it takes the largest's (optimistic:
a wider draft is tried once and then known). At a level where the arm has learnt nothing, the price is borrowed
pessimistically: the dearest learnt level's, scaled by a request's share of a batched forward (``share``:
``shape(rows) / rows``, ``level_rows`` the requests a level stands for, ``shape`` a forward's cost by its tokens -
the verifier's start-up profile in the scheduler; ``1 / rows`` without one) where a request's share is larger at the
fresh level (fewer rows to share a forward with), never where it is smaller. Until then the nearest level lent its
price scaled both ways, and a fresh level's first steps drafted on whatever that level had happened to measure: at
two threads on a Zen 4 CPU, 4 requests' narrow probes priced the 0.5B's 4-node step at 0.31 forwards, the 8-request
level borrowed it, drafted, and measured 0.43 - and in 2 of 3 repeats ended below speculation off (BENCHMARKS.md,
"Two threads per server on the Zen 4 CPU"). Halving the price from 8 requests to 16 (the ``1 / rows`` prior) had
made a fresh 16-request level's first step draft and catch up every prompt at once ("One thread: what a level's
probes may lose, bounded"). The level's own steps then price it - its probes (``metasd.core.batching.probes``)
measure a level that the borrowed price keeps plain. With no level learnt, None: the caller decides.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Sequence

import numpy as np

#: weight of the past in each key's average (an exponential average over the steps that drafted with it)
PRICE_DECAY = 0.8


class DraftPrices:
    """Learnt drafting cost of one step per (arm key, load level, node budget), in the allocator's cost units (see the
    module docstring). ``learn`` adds a step's measured cost; ``price`` reads it back for any budget."""

    def __init__(self, decay: float = PRICE_DECAY, level_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                 shape: Callable[[int], float] | None = None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if not level_rows or any(r < 1 for r in level_rows):
            raise ValueError(f"level_rows must be positive request counts, got {level_rows!r}")
        if shape is not None and not callable(shape):
            raise ValueError(f"shape must be a forward's cost by its tokens (callable) or None, got {shape!r}")
        self.decay, self.level_rows, self.shape = decay, tuple(int(r) for r in level_rows), shape
        self._table: dict[tuple[str, int], dict[int, float]] = {}  # (key, level) -> {budget: average cost}

    def learn(self, key: str, level: int, budget: int, cost: float) -> None:
        """One step of ``key``'s arm drafted with node budget ``budget`` at load ``level`` and cost ``cost``."""
        if budget < 1:
            return  # a step that did not draft says nothing of drafting's price
        row = self._table.setdefault((key, int(level)), {})
        prev = row.get(int(budget))
        c = max(float(cost), 0.0)
        row[int(budget)] = c if prev is None else self.decay * prev + (1.0 - self.decay) * c

    def known(self, key: str, level: int) -> bool:
        """Whether ``key`` has drafted at load ``level``."""
        return bool(self._table.get((key, int(level))))

    def price(self, key: str, level: int, d: int) -> float | None:
        """The cost of drafting ``d`` nodes with ``key``'s arm at load ``level`` (0 for ``d <= 0``: no drafting);
        at a level it has not drafted at, the dearest of the learnt levels' prices, each scaled by ``share(level) /
        share(learnt)`` where that is above 1 (fewer rows to share with), never below; None where the arm has drafted
        at no level."""
        if d <= 0:
            return 0.0
        row = self._table.get((key, int(level)))
        if row:
            return self._read(row, d)
        learnt = [lv for (k, lv), r in self._table.items() if k == key and r]
        if not learnt:
            return None
        # borrowed pessimistically: the dearest learnt level's, scaled up to a request's share at a level with fewer
        # rows to share a forward with, never down (``share``'s prior is what a level's own steps measure)
        return max(self._read(self._table[(key, lv)], d) * max(self.share(level) / self.share(lv), 1.0)
                   for lv in learnt)

    def share(self, level: int) -> float:
        """A request's share of a batched forward at ``level``, in a one-row forward's cost: ``shape(rows) / rows``
        (``1 / rows`` without a shape), ``rows`` the level's ``level_rows``."""
        rows = self.level_rows[min(max(int(level), 0), len(self.level_rows) - 1)]
        one = float(self.shape(1)) if self.shape is not None else 0.0
        return float(self.shape(rows)) / one / rows if one > 0 else 1.0 / rows

    @staticmethod
    def _read(row: dict[int, float], d: int) -> float:
        budgets = sorted(row)
        i = bisect.bisect_left(budgets, d)
        if i < len(budgets) and budgets[i] == d:
            return row[d]
        if i == 0:  # below every budget learnt: fewer nodes, at most proportionally fewer forwards' cost
            return row[budgets[0]] * d / budgets[0]
        if i == len(budgets):  # above every budget learnt: the widest one's (tried, then known)
            return row[budgets[-1]]
        lo, hi = budgets[i - 1], budgets[i]
        return row[lo] + (row[hi] - row[lo]) * (d - lo) / (hi - lo)

    def to_dict(self) -> dict[str, dict[int, float]]:
        """``{"<key>@level<l>": {budget: cost}}`` - for logs and benchmark reports."""
        return {f"{key}@level{level}": dict(sorted(row.items())) for (key, level), row in sorted(self._table.items())}


class DraftCost:
    """One request's drafting cost for ``d`` nodes as the allocator charges it (``AdaptiveSpeculation.draft_cost``):
    0 at ``d <= 0`` (no draft), else ``per_step(d) + fixed + per_token * (1 + max(a(d), 0))`` - its arm's price for
    one step at its load, plus a one-off catch-up charged whole (``fixed``) or amortized over the tokens a step
    commits (``per_token``; ``curve``'s ``a``, the arm's acceptance curve). Callable for one budget; ``many(ds)`` for
    several at once, which the allocator reads once per distinct cost a step (requests with nothing to catch up share
    one)."""

    def __init__(self, per_step: Callable[[int], float], fixed: float = 0.0, per_token: float = 0.0,
                 curve: Any = None):
        if per_token and curve is None:
            raise ValueError("DraftCost: an amortized catch-up (per_token) needs the arm's acceptance curve")
        self.per_step, self.fixed, self.per_token, self.curve = per_step, float(fixed), float(per_token), curve

    def __call__(self, d: int) -> float:
        if d <= 0:
            return 0.0
        extra = self.per_token * (1.0 + max(float(self.curve.expected(d)), 0.0)) if self.per_token else 0.0
        return self.per_step(d) + self.fixed + extra

    def many(self, ds: Sequence[int] | np.ndarray) -> np.ndarray:
        """[len(ds)] float64: the cost at each budget of ``ds``."""
        ds = np.asarray(ds, dtype=np.int64)
        out = np.array([self.per_step(int(d)) if d > 0 else 0.0 for d in ds.tolist()], dtype=np.float64)
        if self.fixed:
            out += self.fixed
        if self.per_token:
            out += self.per_token * (1.0 + np.maximum(np.asarray(self.curve.expected_many(ds), dtype=np.float64), 0.0))
        return np.where(ds > 0, out, 0.0)


__all__ = ["DraftCost", "DraftPrices", "PRICE_DECAY"]
