"""Hedge: exponential weights for full-information feedback (every arm scored every round)."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Mapping

import numpy as np
from pydantic import Field

from metasd.core.decoding.policy import Float, PolicyParams, register_policy

from ._common import BasePolicy, Context


class HedgeParams(PolicyParams):
    """Hyper-parameters of Hedge (see the class docstring)."""

    eta: Float = Field(1.0, gt=0.0, allow_inf_nan=False, description="learning rate on rewards scaled to [0, 1]")
    discount: Float = Field(0.95, gt=0.0, le=1.0, description="each round, past scores are multiplied by this "
                                                              "(memory ~ 1 / (1 - discount) rounds; 1: none)")
    gamma: Float = Field(0.05, ge=0.0, le=1.0, description="share of uniform exploration mixed into the choice")
    reward_scale: Annotated[Float, Field(gt=0.0, allow_inf_nan=False)] | Literal["running_max"] = Field(
        "running_max", description="rewards are divided by this (running_max: the largest seen so far)")


@register_policy
class Hedge(BasePolicy):
    """Hedge (Freund & Schapire 1997; HedgeSpec, arXiv 2510.20064, for drafter selection): keep a score per arm, play
    arm i with probability ``(1 - gamma) * softmax(eta * S)_i + gamma / K`` (drawn with ``self.rng``).

    Each round every arm scored in it adds its reward, scaled to [0, 1], to its score after all scores are multiplied
    by ``discount``. With full-information feedback (``feedback: full``) the arms that can be scored without being
    played (lookup drafters, tracked model drafters) are scored every round, so no round is spent exploring them;
    an arm that is scored only when it is played (bandit-fed) adds ``reward / p_i`` when played, the importance-weighted
    estimate of EXP3, so its score is not starved by the rounds it sits out. An arm counts as full-information once it
    has been scored in a round it was not played. Regret against the best arm O(sqrt(T log K)) for the full-information
    arms; the discount trades that for tracking a best arm that changes within a request (prose, then a copied block).

    Parameters: ``eta`` (default 1.0), ``discount`` (default 0.95), ``gamma`` (default 0.05), ``reward_scale``
    (default "running_max": for unbounded rewards such as throughput).
    """

    name = "hedge"
    Params = HedgeParams
    uses_counterfactuals = True

    def reset(self) -> None:
        self.scores = np.zeros(self.n_arms, dtype=np.float64)
        self.full_info = np.zeros(self.n_arms, dtype=bool)  # arms scored in rounds they were not played
        self.max_reward = 0.0
        self.last_p = self.probabilities()

    def probabilities(self) -> np.ndarray:
        z = self.eta * (self.scores - self.scores.max())
        w = np.exp(z)
        return (1.0 - self.gamma) * w / w.sum() + self.gamma / self.n_arms

    def select(self, context: Context = None) -> int:
        self.last_p = self.probabilities()
        return int(self.rng.choice(self.n_arms, p=self.last_p))

    def _scaled(self, reward: float) -> float:
        if reward < 0:
            raise ValueError(f"{self._label()}: reward must be >= 0, got {reward!r}")
        if self.reward_scale == "running_max":
            self.max_reward = max(self.max_reward, reward)
            return reward / self.max_reward if self.max_reward > 0 else 0.0
        return min(reward / self.reward_scale, 1.0)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        self.observe(arm, {arm: reward}, context)

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        arm = self._check_arm(arm)
        if arm not in rewards:
            raise ValueError(f"{self._label()}: the chosen arm {arm} has no reward among {sorted(rewards)}")
        checked = {self._check_arm(a): self._check_reward(r) for a, r in rewards.items()}
        for a in checked:
            if a != arm:
                self.full_info[a] = True
        self.scores *= self.discount
        for a, r in sorted(checked.items()):
            x = self._scaled(r)
            if a == arm and not self.full_info[a]:
                x /= max(float(self.last_p[a]), 1e-12)  # played and only scored when played: importance weight
            self.scores[a] += x

    def _state_items(self) -> dict[str, Any]:
        return {"scores": self.scores, "full_info": self.full_info, "max_reward": self.max_reward,
                "last_p": self.last_p, "rng_state": self.rng_state}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "effective_memory": math.inf if self.discount == 1 else 1 / (1 - self.discount)}


__all__ = ["Hedge", "HedgeParams"]
