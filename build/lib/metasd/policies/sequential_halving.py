"""Sequential Halving: fixed-budget best-arm identification with few drafter switches."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from pydantic import Field

from metasd.core.decoding.policy import Int, PolicyParams, register_policy

from ._common import BasePolicy, Context


class SequentialHalvingParams(PolicyParams):
    """Hyper-parameters of Sequential Halving."""

    budget: Int = Field(200, ge=1, description="rounds per episode spent exploring (T)")


@register_policy
class SequentialHalving(BasePolicy):
    """Sequential Halving (Karnin, Koren & Somekh 2013), used by MetaSD because it limits switching:
    every drafter switch costs a catch-up prefill of the newly chosen drafter's cache.

    Rule, per episode (``reset`` starts one; MetaSD resets per request): with ``K`` arms and budget ``T``
    rounds, run ``L = ceil(log2 K)`` phases. Phase ``r`` plays each surviving arm
    ``max(1, floor(T / (|S_r| * L)))`` times, contiguously (all plays of one arm, then the next; the arm
    played last in the previous phase goes first if it survived, so a phase boundary costs no switch), then
    keeps the ``ceil(|S_r| / 2)`` survivors with the highest empirical mean (ties: lower index). Once one
    arm is left it is played for the rest of the episode. So an episode has at most ``sum_r |S_r|``
    switches (``<= 2K + ceil(log2 K)``; e.g. at most 14 for K = 8), against ~T for UCB-style policies.
    If ``T < K * L`` the phases still play every survivor once, so the exploration overruns ``T``.

    Difference from the paper: the means used for halving pool all of an arm's samples in the episode
    (the paper uses only the current phase's), which is no worse for stationary rewards.

    Parameters: ``budget`` (T, rounds per episode spent exploring, default 200). Deterministic.
    """

    name = "sequential_halving"
    Params = SequentialHalvingParams

    @property
    def n_phases(self) -> int:
        return math.ceil(math.log2(self.n_arms)) if self.n_arms > 1 else 0

    def reset(self) -> None:
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.phase_counts = np.zeros(self.n_arms, dtype=np.int64)
        self.survivors: list[int] = list(range(self.n_arms))
        self.phase = 0
        self.best = 0 if self.n_arms == 1 else -1  # -1 while still exploring
        self.t = 0

    def quota(self) -> int:
        """Plays per surviving arm in the current phase."""
        return max(1, self.budget // (len(self.survivors) * max(self.n_phases, 1)))

    def select(self, context: Context = None) -> int:
        if self.best >= 0:
            return self.best
        quota = self.quota()
        for arm in self.survivors:
            if self.phase_counts[arm] < quota:
                return arm
        return self.survivors[0]  # unreachable: update() closes a phase as soon as its quota is met

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm, reward = self._record_sample(arm, reward)
        if self.best >= 0:
            return
        self.phase_counts[arm] += 1
        quota = self.quota()
        if all(self.phase_counts[a] >= quota for a in self.survivors):
            self._halve(last_played=arm)

    def _halve(self, last_played: int) -> None:
        means = {a: self.sums[a] / self.counts[a] for a in self.survivors}
        ranked = sorted(self.survivors, key=lambda a: (-means[a], a))
        keep = sorted(ranked[: math.ceil(len(self.survivors) / 2)])
        if last_played in keep:
            keep.remove(last_played)
            keep.insert(0, last_played)
        self.survivors = [int(a) for a in keep]
        self.phase += 1
        self.phase_counts[:] = 0
        if len(self.survivors) == 1:
            self.best = self.survivors[0]

    def _state_items(self) -> dict[str, Any]:
        return {"counts": self.counts, "sums": self.sums, "phase_counts": self.phase_counts,
                "survivors": list(self.survivors), "phase": self.phase, "best": self.best, "t": self.t}


__all__ = ["SequentialHalving"]
