"""Upper-confidence-bound policies: UCB1 and its discounted / sliding-window variants.

All three play every arm once first (an arm with no (windowed) observation has an infinite index), then
the arm maximising ``mean_i + c * s * sqrt(2 ln n / n_i)``. ``c`` is the exploration weight (``beta`` in
docs/algorithms.md#bandit-policies; ``c = 1`` is Auer et al.'s UCB1 for rewards in [0, 1]). ``s`` is 1 unless
``normalize=True``, in which case ``s = 2 * std`` of all rewards observed so far: for an unbounded reward
such as tokens/s this puts the bonus on the reward's scale (a [0, 1] reward with std 1/2 gets ``s = 1``,
i.e. plain UCB1). While fewer than two distinct rewards have been seen, ``s`` falls back to 1.
Rewards may be any finite float.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping

import numpy as np

from pydantic import Field

from metasd.core.decoding.policy import Bool, Float, Int, PolicyParams, register_policy

from ._common import BasePolicy, Context, first_unplayed


class UCBParams(PolicyParams):
    """Hyper-parameters of UCB1 (and, extended, of its discounted and sliding-window variants)."""

    c: Float = Field(1.0, ge=0.0, allow_inf_nan=False, description="exploration weight (beta)")
    normalize: Bool = Field(False, description="scale the bonus by 2 x the observed reward std (unbounded rewards)")


class DiscountedUCBParams(UCBParams):
    gamma: Float = Field(0.995, gt=0.0, le=1.0, description="discount per round (memory ~ 1 / (1 - gamma) rounds)")


class SlidingWindowUCBParams(UCBParams):
    window: Int = Field(200, ge=1, description="rounds the statistics cover")


class _UCBBase(BasePolicy):
    """Exploration weight, optional reward-scale normalisation (running Welford std), index argmax."""

    Params = UCBParams

    def _reset_scale(self) -> None:
        self.r_n = 0
        self.r_mean = 0.0
        self.r_m2 = 0.0

    def _track_scale(self, reward: float) -> None:
        if not self.normalize:
            return
        self.r_n += 1
        delta = reward - self.r_mean
        self.r_mean += delta / self.r_n
        self.r_m2 += delta * (reward - self.r_mean)

    def _scale(self) -> float:
        if self.normalize and self.r_n >= 2 and self.r_m2 > 0.0:
            return 2.0 * math.sqrt(self.r_m2 / self.r_n)
        return 1.0

    def _argmax_index(self, means: np.ndarray, counts: np.ndarray, n: float) -> int:
        # counts > 0 for every arm here (unplayed arms are returned before this is called).
        bonus = (self.c * self._scale()) * np.sqrt((2.0 * math.log(max(n, 1.0))) / counts)
        return int(np.argmax(means + bonus))

    def _scale_items(self) -> dict[str, Any]:
        return {"r_n": self.r_n, "r_mean": self.r_mean, "r_m2": self.r_m2}


@register_policy
class UCB1(_UCBBase):
    """UCB1 (Auer, Cesa-Bianchi & Fischer 2002): the MetaSD default for stationary rewards.

    Rule: play each arm once, then ``argmax_i mean_i + c * s * sqrt(2 ln t / n_i)`` with ``t`` the number
    of rounds so far and ``n_i`` the plays of arm ``i`` (``s`` as in the module docstring). Regret grows
    as ``O(sum_i ln T / gap_i)``. Deterministic (ties go to the lowest index).

    Parameters: ``c`` (exploration weight, default 1.0), ``normalize`` (scale the bonus by the observed
    reward std, default False; use it for unbounded rewards such as tokens/s).
    """

    name = "ucb"

    def reset(self) -> None:
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.t = 0
        self._reset_scale()

    def select(self, context: Context = None) -> int:
        arm = first_unplayed(self.counts)
        if arm >= 0:
            return arm
        return self._argmax_index(self.sums / self.counts, self.counts, self.t)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm, reward = self._record_sample(arm, reward)
        self._track_scale(reward)

    uses_counterfactuals = True
    forced_arms_unbiased = True  # per-arm estimates from the rewards alone

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        """Full information: every scored arm's mean takes its sample (its count grows), ``t`` counts rounds, so the
        bonus of an arm scored every step shrinks as if it were played every step - without being played."""
        for _, reward in self._record_round(arm, rewards):
            self._track_scale(reward)

    def _state_items(self) -> dict[str, Any]:
        return {"counts": self.counts, "sums": self.sums, "t": self.t, **self._scale_items()}


@register_policy
class DiscountedUCB(_UCBBase):
    """Discounted UCB (Garivier & Moulines 2008, "On upper-confidence bound policies for non-stationary
    bandit problems"): UCB over exponentially discounted statistics, for rewards that drift or jump.

    After each round every arm's discounted count ``N_i`` and reward sum ``S_i`` are multiplied by
    ``gamma`` and the played arm's get ``+1`` / ``+reward``. Rule: ``argmax_i S_i / N_i +
    c * s * sqrt(2 ln n / N_i)`` with ``n = sum_i N_i`` (their ``2B sqrt(xi ln n / N_i)`` with B = 1,
    xi = 1/2); arms never played have an infinite index. Effective memory ~ ``1 / (1 - gamma)`` rounds;
    ``gamma = 1`` is UCB1.

    Parameters: ``gamma`` (discount in (0, 1], default 0.995, i.e. a ~200-round memory), ``c`` (default
    1.0), ``normalize`` (default False).
    """

    name = "discounted_ucb"
    Params = DiscountedUCBParams

    def reset(self) -> None:
        self.counts = np.zeros(self.n_arms, dtype=np.float64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.total = 0.0  # sum of the discounted counts
        self._reset_scale()

    def select(self, context: Context = None) -> int:
        arm = first_unplayed(self.counts)  # also catches counts that underflowed to 0 after ages unplayed
        if arm >= 0:
            return arm
        return self._argmax_index(self.sums / self.counts, self.counts, self.total)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        reward = self._check_reward(reward)
        self.counts *= self.gamma
        self.sums *= self.gamma
        self.counts[arm] += 1.0
        self.sums[arm] += reward
        self.total = self.total * self.gamma + 1.0
        self._track_scale(reward)

    def _state_items(self) -> dict[str, Any]:
        return {"counts": self.counts, "sums": self.sums, "total": self.total, **self._scale_items()}


@register_policy
class SlidingWindowUCB(_UCBBase):
    """Sliding-window UCB (Garivier & Moulines 2008): UCB over the last ``window`` rounds only, for
    rewards with abrupt changes (e.g. a request that switches from prose to code).

    Rule: with ``N_i`` / ``S_i`` the plays / reward sum of arm ``i`` among the last ``tau = window``
    rounds, an arm with ``N_i = 0`` is played first, else ``argmax_i S_i / N_i + c * s *
    sqrt(2 ln min(t, tau) / N_i)``. Keeps a deque of the last ``tau`` (arm, reward) pairs; counts and
    sums are updated incrementally, so a round is O(n_arms) whatever ``tau``.

    Parameters: ``window`` (tau, rounds, default 200), ``c`` (default 1.0), ``normalize`` (default False).
    """

    name = "sliding_window_ucb"
    Params = SlidingWindowUCBParams

    def reset(self) -> None:
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.history: deque[tuple[int, float]] = deque()
        self._reset_scale()

    def select(self, context: Context = None) -> int:
        arm = first_unplayed(self.counts)
        if arm >= 0:
            return arm
        return self._argmax_index(self.sums / self.counts, self.counts, len(self.history))

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        reward = self._check_reward(reward)
        self.history.append((arm, reward))
        self.counts[arm] += 1
        self.sums[arm] += reward
        if len(self.history) > self.window:
            old_arm, old_reward = self.history.popleft()
            self.counts[old_arm] -= 1
            # reset exactly when the arm leaves the window, so float error cannot accumulate forever
            self.sums[old_arm] = self.sums[old_arm] - old_reward if self.counts[old_arm] else 0.0
        self._track_scale(reward)

    def _state_items(self) -> dict[str, Any]:
        return {"counts": self.counts, "sums": self.sums, "history": [[a, r] for a, r in self.history],
                **self._scale_items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.history = deque((int(a), float(r)) for a, r in self.history)
        while len(self.history) > self.window:  # state saved with a larger window
            old_arm, old_reward = self.history.popleft()
            self.counts[old_arm] -= 1
            self.sums[old_arm] = self.sums[old_arm] - old_reward if self.counts[old_arm] else 0.0
