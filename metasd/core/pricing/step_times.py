"""What a scheduler step really costs beside its priced parts, learnt per load level
(docs/algorithms.md#speculation-under-load).

The allocator weighs a step as ``cost(B N) + sum_i c_i(d_i)``: the verifier forward from the profile taken at start
(``ForwardProfile``, the server idle) and each request's drafting at its learnt price. A served step costs more than
that, and the difference is not the same for a plain step and a drafting one:

- **the forward runs slower than profiled** under load - the server's HTTP streams, tokenisation and detokenisation
  share the cores with the forward - by a factor ``k`` (measured verify seconds over the profile's seconds for the
  same tokens);
- **every step does work outside its forwards** - arm selection, the allocation, acceptance, commits, events to
  every running request - a fixed ``o`` per step at a given load.

Both favour fewer, larger steps, which only drafting gives: a plain step's real cost ``k cost(B) + o`` is further
above its modeled ``cost(B)`` than a drafting step's is, in proportion. (Measured on this CPU at two threads in bf16,
4 requests over HTTP: plain decoding ran 0.31 s a step against the profile's 0.20 s.) ``StepTimes`` keeps an
exponential average of ``k`` and ``o`` per load level from the steps the scheduler ran - ``observe`` after each
decode step that prefilled nothing (a prompt's prefill is a one-off per request, not a per-step cost) - and
``step_cost(level)`` returns the cost the allocator should charge: ``n -> k cost(n) + o``. At a level with no step
yet, the nearest observed level's values; with none observed, the profile itself (``k = 1``, ``o = 0``).

Units are the allocator's (a one-token forward); seconds become units by ``unit_seconds``, the profile's one-token
forward. Pure: nothing here reads a clock.
"""
from __future__ import annotations

import math
from typing import Callable

#: weight of the past in each level's averages
STEP_TIMES_DECAY = 0.8


class StepTimes:
    """Per load level: how much slower than profiled the verify forward runs (``scale``) and the step's work outside
    its forwards (``overhead``, in one-token forwards). See the module docstring."""

    def __init__(self, cost: Callable[[int], float], unit_seconds: float, decay: float = STEP_TIMES_DECAY):
        if not (math.isfinite(unit_seconds) and unit_seconds > 0):
            raise ValueError(f"unit_seconds must be a finite number of seconds > 0, got {unit_seconds!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.cost, self.unit_seconds, self.decay = cost, float(unit_seconds), float(decay)
        self._levels: dict[int, tuple[float, float]] = {}  # level -> (scale, overhead)

    def observe(self, level: int, forward_tokens: int, verify_s: float, step_s: float, drafting_s: float) -> None:
        """One decode step at load ``level``: its padded forward of ``forward_tokens`` took ``verify_s`` seconds, its
        drafting (every request's drafter forwards) ``drafting_s``, the whole step ``step_s``."""
        modeled_s = float(self.cost(int(forward_tokens))) * self.unit_seconds
        if not (modeled_s > 0 and verify_s > 0 and step_s > 0):
            return
        scale = verify_s / modeled_s
        overhead = max(step_s - verify_s - max(drafting_s, 0.0), 0.0) / self.unit_seconds
        prev = self._levels.get(int(level))
        if prev is not None:
            d = self.decay
            scale, overhead = d * prev[0] + (1 - d) * scale, d * prev[1] + (1 - d) * overhead
        self._levels[int(level)] = (scale, overhead)

    def at(self, level: int) -> tuple[float, float]:
        """(scale, overhead) at ``level``: its own, else the nearest observed level's (the lower on a tie), else
        (1, 0)."""
        if int(level) in self._levels:
            return self._levels[int(level)]
        if not self._levels:
            return 1.0, 0.0
        near = min(self._levels, key=lambda lv: (abs(lv - level), lv))
        return self._levels[near]

    def step_cost(self, level: int) -> Callable[[int], float]:
        """The cost of a step's verify forward over ``n`` tokens at ``level`` with the step's own work:
        ``k cost(n) + o``."""
        scale, overhead = self.at(level)
        return lambda n: scale * float(self.cost(n)) + overhead

    def to_dict(self) -> dict[int, dict[str, float]]:
        """``{level: {"scale": k, "overhead": o}}`` - for logs and benchmark reports."""
        return {lv: {"scale": k, "overhead": o} for lv, (k, o) in sorted(self._levels.items())}


__all__ = ["STEP_TIMES_DECAY", "StepTimes"]
