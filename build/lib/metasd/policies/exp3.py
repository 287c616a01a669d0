"""EXP3: exponential weights for adversarial (non-stochastic) bandits."""
from __future__ import annotations

from typing import Any

import numpy as np

from typing import Annotated, Literal

from pydantic import Field

from metasd.core.decoding.policy import Float, PolicyParams, register_policy

from ._common import BasePolicy, Context


class EXP3Params(PolicyParams):
    """Hyper-parameters of EXP3 (see the class docstring)."""

    gamma: Float = Field(0.1, gt=0.0, le=1.0, description="exploration rate")
    reward_scale: Annotated[Float, Field(gt=0.0, allow_inf_nan=False)] | Literal["running_max"] | None = Field(
        None, description="None, a positive ceiling, or 'running_max' (rewards divided by the largest seen)")


@register_policy
class EXP3(BasePolicy):
    """EXP3 (Auer, Cesa-Bianchi, Freund & Schapire 2002): no stochastic assumption on the rewards, so it
    suits requests whose best drafter keeps changing; the price is slower learning than UCB on stationary
    rewards.

    Rule: ``p_i = (1 - gamma) * w_i / sum_j w_j + gamma / K``; draw the arm from ``p`` (with ``self.rng``);
    on reward ``x`` in [0, 1] for arm ``i``: ``w_i *= exp(gamma * (x / p_i) / K)`` (importance-weighted
    estimate). Weights are kept as logs (shifted so the largest is 0) to avoid overflow.

    Rewards must be in [0, 1]. ``reward_scale`` maps other rewards there:
      - ``None`` (default): rewards are used as given; outside [0, 1] raises ``ValueError``;
      - a positive number ``s``: reward ``r >= 0`` is used as ``min(r / s, 1)`` (``s`` a known ceiling);
      - ``"running_max"``: ``r >= 0`` is divided by the largest reward seen so far (this one included),
        for unbounded non-negative rewards such as tokens/s. The scale drifts upwards early on, which
        makes the importance-weighted estimates slightly inconsistent across rounds; it is a heuristic.
      Negative rewards raise ``ValueError`` with a scale.

    Parameters: ``gamma`` (exploration rate in (0, 1], default 0.1), ``reward_scale`` (default None).
    """

    name = "exp3"
    Params = EXP3Params

    @property
    def requires_bounded_rewards(self) -> bool:
        return self.reward_scale is None

    def reset(self) -> None:
        self.log_weights = np.zeros(self.n_arms, dtype=np.float64)
        self.running_max = 0.0

    def probabilities(self) -> np.ndarray:
        """The current sampling distribution over arms."""
        w = np.exp(self.log_weights - self.log_weights.max())
        return (1.0 - self.gamma) * (w / w.sum()) + self.gamma / self.n_arms

    def select(self, context: Context = None) -> int:
        p = self.probabilities()
        # inverse-CDF draw: one uniform per round, cheaper than rng.choice
        arm = int(np.searchsorted(np.cumsum(p), self.rng.random() * p.sum(), side="right"))
        return min(arm, self.n_arms - 1)

    def _scaled(self, reward: Any) -> float:
        if self.reward_scale is None:
            return self._check_unit_reward(reward)
        value = self._check_reward(reward)
        if value < 0.0:
            raise ValueError(f"{self._label()}: reward must be >= 0 with reward_scale={self.reward_scale!r}, "
                             f"got {value!r}")
        if self.reward_scale == "running_max":
            self.running_max = max(self.running_max, value)
            return value / self.running_max if self.running_max > 0.0 else 0.0
        return min(value / self.reward_scale, 1.0)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        x = self._scaled(reward)
        p = self.probabilities()[arm]
        self.log_weights[arm] += self.gamma * (x / p) / self.n_arms
        self.log_weights -= self.log_weights.max()

    def _state_items(self) -> dict[str, Any]:
        return {"log_weights": self.log_weights, "running_max": self.running_max, "rng_state": self.rng_state}


__all__ = ["EXP3"]
