"""The verify forward's measured price against its profile, learnt per load level and token count
(docs/algorithms.md, "The step, adapting", 6.).

The profile (``ForwardProfile``) times one row's forward at a few token counts, once, at start, within a time budget:
counts it cannot afford are extrapolated along its last segment. A scheduler's batched forward of B rows over the
rows' real contexts, on a machine whose speed drifts, costs another multiple of it - and not one multiple at every
width: on a 2-core CPU without AVX-512 the profile's 5 seconds timed 1 and 4 tokens (a matrix-vector kernel, then a
matrix-matrix one at 2.6x), extrapolated 16 tokens to 9.7x one token's seconds and 64 to 28x, where they took 2.65x
and 4.9x. So every verify forward's measured seconds over its modeled cost is learnt per load level and per token
bucket (``token_bucket``: 1, 2, 3-4, 5-8, ... tokens), an exponential average each; a forward is priced at the ratio
of its own bucket, or - where it has not run yet - interpolated between the nearest learnt buckets of its level, the
nearest one's beyond them (``ForwardRatios.ratio``).

A width the level never ran keeps the profile's price, which a probe (``metasd/core/batching/probes.py``) reads
hopefully: a forward wider than the widest the level has run costs what that one did (``ForwardRatios.widest``), so
a probe tries it once and the bucket is measured from then on.

Pure Python; nothing here reads a clock or a model.
"""
from __future__ import annotations

#: weight of the past in each learnt ratio (an exponential average over the forwards of its bucket)
FORWARD_RATIO_DECAY = 0.8


def token_bucket(n: int) -> int:
    """The bucket of a forward over ``n`` tokens: ``ceil(log2(n))`` (1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...)."""
    return max(int(n) - 1, 0).bit_length()


class ForwardRatios:
    """Per load level, the measured / profiled seconds of the verify forwards it ran: an exponential average per
    token bucket (``by_level``), one over all its forwards (``levels``: logs, the level's summary) and the widest
    forward it ran (``widest``). See the module docstring."""

    def __init__(self, decay: float = FORWARD_RATIO_DECAY):
        self.decay = float(decay)
        self.by_level: dict[int, dict[int, float]] = {}  # level -> token bucket -> ratio
        self.levels: dict[int, float] = {}  # level -> ratio over all its forwards
        self.tokens: dict[int, int] = {}  # level -> the most tokens of a forward it ran

    def _average(self, table: dict, key: int, ratio: float) -> None:
        prev = table.get(key)
        table[key] = ratio if prev is None else self.decay * prev + (1 - self.decay) * ratio

    def learn(self, level: int, tokens: int, ratio: float) -> None:
        """A forward of ``tokens`` tokens at load level ``level`` took ``ratio`` times its profiled price."""
        self._average(self.by_level.setdefault(level, {}), token_bucket(tokens), ratio)
        self._average(self.levels, level, ratio)
        self.tokens[level] = max(self.tokens.get(level, 0), int(tokens))

    def nearest(self, level: int) -> int | None:
        """The learnt level nearest ``level`` (the lower on a tie); None before any forward."""
        return min(self.levels, key=lambda lv: (abs(lv - level), lv)) if self.levels else None

    def level_ratio(self, level: int) -> float:
        """The nearest learnt level's ratio over all its forwards; 1 before any forward."""
        near = self.nearest(level)
        return 1.0 if near is None else self.levels[near]

    def ratio(self, level: int, tokens: int) -> float:
        """The ratio a forward of ``tokens`` tokens at ``level`` is priced at: the nearest learnt level's ratio of
        its bucket, else linearly interpolated (in buckets) between the nearest learnt buckets below and above it,
        else the nearest learnt bucket's; 1 before any forward."""
        near = self.nearest(level)
        if near is None:
            return 1.0
        learnt, b = self.by_level[near], token_bucket(tokens)
        if b in learnt:
            return learnt[b]
        below, above = [k for k in learnt if k < b], [k for k in learnt if k > b]
        if below and above:
            lo, hi = max(below), min(above)
            return learnt[lo] + (learnt[hi] - learnt[lo]) * (b - lo) / (hi - lo)
        return learnt[max(below)] if below else learnt[min(above)]

    def widest(self, level: int) -> int | None:
        """The most tokens of a forward the nearest learnt level ran (None before any forward)."""
        near = self.nearest(level)
        return None if near is None else self.tokens[near]


__all__ = ["FORWARD_RATIO_DECAY", "ForwardRatios", "token_bucket"]
