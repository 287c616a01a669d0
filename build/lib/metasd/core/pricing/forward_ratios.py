"""The verify forward's measured price against its profile, learnt per load level and token count
(docs/algorithms.md, "The step, adapting", 6.).

The profile (``ForwardProfile``) times one row's forward at a few token counts, once, at start, within a time budget:
counts it cannot afford are extrapolated along its last segment. A scheduler's batched forward of B rows over the
rows' real contexts, on a machine whose speed drifts, costs another multiple of it - and not one multiple at every
width: on a 2-core CPU without AVX-512 the profile's 5 seconds timed 1 and 4 tokens (a matrix-vector kernel, then a
matrix-matrix one at 2.6x), extrapolated 16 tokens to 9.7x one token's seconds and 64 to 28x, where they took 2.65x
and 4.9x. So every verify forward's measured price (its seconds in one-token-forward units) is learnt per load
level and per token bucket (``token_bucket``: 1, 2, 3-4, 5-8, ... tokens): an exponential average of the bucket's
token counts and of their prices, one measured point per bucket. A forward is priced through a level's points as the
profile's fit reads its own (``ForwardRatios.price``): piecewise-linear between them (their running maximum: never
cheaper for more tokens), below the narrowest the profile scaled by it - so a measured width is priced as measured and
every other width is priced through the nearest measurements, not through one ratio for the level.

Beyond a level's widest point the shape in tokens is the machine's, not the level's: where another level ran wider
forwards, the price follows that level's points, scaled to meet this level's widest (``shape``) - four requests'
first steps priced their drafts through the profile's extrapolation of one to four tokens while the one-request level
had measured forwards of up to 49. Beyond every measured width, the profile's slope scaled by the widest point's ratio.
A probe (``metasd/core/batching/probes.py``) reads the widths no level ran hopefully (``hopeful``): a forward wider
than the widest any level has run costs what that one would at this level, so a probe tries it once and it is
measured from then on.

Pure Python; nothing here reads a clock or a model.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Callable

#: weight of the past in each measured point (exponential averages of a bucket's tokens and prices) and level ratio
FORWARD_RATIO_DECAY = 0.8


def token_bucket(n: int) -> int:
    """The bucket of a forward over ``n`` tokens: ``ceil(log2(n))`` (1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...)."""
    return max(int(n) - 1, 0).bit_length()


class ForwardRatios:
    """Per load level, the verify forwards it ran, measured: per token bucket an exponential average of their tokens
    and of their price in ``cost``'s units (``points``); per level the average of measured / profiled price over all
    its forwards (``levels``, logs) and the widest forward it ran (``widest``). ``cost``: the profile's price of a
    forward over n tokens (``ForwardProfile.cost``). See the module docstring."""

    def __init__(self, cost: Callable[[float], float], decay: float = FORWARD_RATIO_DECAY):
        self.cost, self.decay = cost, float(decay)
        self.points: dict[int, dict[int, tuple[float, float]]] = {}  # level -> bucket -> (tokens, price)
        self.levels: dict[int, float] = {}  # level -> measured / profiled price over all its forwards
        self.tokens: dict[int, int] = {}  # level -> the most tokens of a forward it ran
        # level -> its points by tokens: (tokens, their prices' running maximum), made by ``learn`` for ``price``
        self._anchors: dict[int, tuple[list[float], list[float]]] = {}

    def _average(self, prev: float | None, x: float) -> float:
        return x if prev is None else self.decay * prev + (1 - self.decay) * x

    def learn(self, level: int, tokens: int, price: float) -> None:
        """A forward of ``tokens`` tokens at load level ``level`` cost ``price`` (measured seconds over the seconds of
        a profiled one-token forward)."""
        bucket, points = token_bucket(tokens), self.points.setdefault(level, {})
        t, p = points.get(bucket, (None, None))
        points[bucket] = (self._average(t, float(tokens)), self._average(p, float(price)))
        self.levels[level] = self._average(self.levels.get(level), price / self.cost(tokens))
        self.tokens[level] = max(self.tokens.get(level, 0), int(tokens))
        pts = sorted(points.values())  # by tokens
        self._anchors[level] = ([t for t, _ in pts], list(itertools.accumulate((p for _, p in pts), max)))

    def nearest(self, level: int) -> int | None:
        """The learnt level nearest ``level`` (the lower on a tie); None before any forward."""
        return min(self.levels, key=lambda lv: (abs(lv - level), lv)) if self.levels else None

    def level_ratio(self, level: int) -> float:
        """The nearest learnt level's measured / profiled price over all its forwards; 1 before any forward."""
        near = self.nearest(level)
        return 1.0 if near is None else self.levels[near]

    def price(self, level: int, tokens: float) -> float:
        """The price of a forward of ``tokens`` tokens at ``level``, through the nearest learnt level's points (the
        module docstring); the profile's ``cost`` before any forward. Non-decreasing in the tokens."""
        near = self.nearest(level)
        if near is None:
            return self.cost(tokens)
        ts, ps = self._anchors[near]
        shape = self.shape(near) if tokens > ts[-1] else None
        if shape is not None:  # the machine's shape, measured at a level with wider forwards
            return ps[-1] * self._own(shape, tokens) / self._own(shape, ts[-1])
        return self._own(near, tokens)

    def _own(self, level: int, tokens: float) -> float:
        """The price of a forward of ``tokens`` tokens through ``level``'s own points (it has some)."""
        ts, ps = self._anchors[level]  # ps: never cheaper for more tokens
        if tokens <= ts[0]:
            return ps[0] * self.cost(tokens) / self.cost(ts[0])
        if tokens >= ts[-1]:
            return ps[-1] + ps[-1] / self.cost(ts[-1]) * (self.cost(tokens) - self.cost(ts[-1]))
        i = bisect.bisect_left(ts, tokens)  # ts[i-1] < tokens <= ts[i]
        return ps[i - 1] + (ps[i] - ps[i - 1]) * (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])

    def shape(self, level: int) -> int | None:
        """The learnt level whose measured points reach the most tokens, where they reach beyond ``level``'s widest
        point (the lower level on a tie); else None."""
        own = self._anchors[level][0][-1]
        wider = [lv for lv, (ts, _) in self._anchors.items() if ts[-1] > own]
        return min(wider, key=lambda lv: (-self._anchors[lv][0][-1], lv)) if wider else None

    def hopeful(self, level: int, tokens: float) -> float:
        """A probe's price (module docstring): ``price``, with a forward wider than the widest any level has run
        priced as that one."""
        most = max(self.tokens.values(), default=None)
        return self.price(level, tokens if most is None else min(tokens, max(most, 1)))

    def ratio(self, level: int, tokens: float) -> float:
        """``price`` over the profile's ``cost`` at ``tokens`` (logs, tests)."""
        return self.price(level, tokens) / self.cost(tokens)

    @property
    def by_level(self) -> dict[int, dict[int, float]]:
        """Level -> bucket -> its measured point's price over the profile's (logs: ``step_breakdown --trace``)."""
        return {lv: {b: p / self.cost(t) for b, (t, p) in pts.items()} for lv, pts in self.points.items()}

    def widest(self, level: int) -> int | None:
        """The most tokens of a forward ``level`` itself ran (None before it ran one)."""
        return self.tokens.get(level)


__all__ = ["FORWARD_RATIO_DECAY", "ForwardRatios", "token_bucket"]
