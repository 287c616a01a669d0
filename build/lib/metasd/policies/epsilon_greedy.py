"""Epsilon-greedy: the simplest explore/exploit baseline."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from pydantic import Field

from metasd.core.decoding.policy import Float, PolicyParams, register_policy

from ._common import BasePolicy, Context, first_unplayed


class EpsilonGreedyParams(PolicyParams):
    """Hyper-parameters of epsilon-greedy."""

    epsilon: Float = Field(0.1, ge=0.0, le=1.0, description="exploration probability (at t = 0)")
    decay: Float = Field(0.0, ge=0.0, allow_inf_nan=False, description="epsilon_t = epsilon / (1 + decay * t)")


@register_policy
class EpsilonGreedy(BasePolicy):
    """Epsilon-greedy (Sutton & Barto 2018, sec. 2.2; decaying schedule as in Auer et al. 2002).

    Rule: play each arm once first; then with probability ``eps_t`` play an arm drawn uniformly at random
    (any arm, the greedy one included), otherwise the arm with the highest mean reward (ties: lowest
    index). ``eps_t = epsilon / (1 + decay * t)`` with ``t`` the number of rounds so far, so ``decay = 0``
    (the default) keeps epsilon constant and ``decay > 0`` anneals it like ``1/t`` (the schedule whose
    regret is logarithmic). Rewards may be any finite float. Randomness through ``self.rng``.

    Parameters: ``epsilon`` (in [0, 1], default 0.1), ``decay`` (>= 0, default 0.0).
    """

    name = "epsilon_greedy"
    Params = EpsilonGreedyParams

    def reset(self) -> None:
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.t = 0

    def current_epsilon(self) -> float:
        return self.epsilon / (1.0 + self.decay * self.t)

    def select(self, context: Context = None) -> int:
        arm = first_unplayed(self.counts)
        if arm >= 0:
            return arm
        # Always draw the coin so the random stream does not depend on the means.
        if self.rng.random() < self.current_epsilon():
            return int(self.rng.integers(self.n_arms))
        return int(np.argmax(self.sums / self.counts))

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm, reward = self._record_sample(arm, reward)

    uses_counterfactuals = True
    forced_arms_unbiased = True  # per-arm estimates from the rewards alone

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        """Full information: every scored arm's mean takes its sample; ``t`` (epsilon's decay) counts rounds."""
        self._record_round(arm, rewards)

    def _state_items(self) -> dict[str, Any]:
        return {"counts": self.counts, "sums": self.sums, "t": self.t, "rng_state": self.rng_state}


__all__ = ["EpsilonGreedy"]
