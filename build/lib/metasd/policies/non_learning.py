"""Non-learning baselines: one fixed drafter, round-robin, uniformly random."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from metasd.core.decoding.policy import Int, PolicyParams, register_policy

from ._common import BasePolicy, Context


class FixedParams(PolicyParams):
    arm: Int = Field(0, ge=0, description="the arm always played (< n_arms)")


@register_policy
class Fixed(BasePolicy):
    """Always play arm ``arm``: the single-drafter baseline ("best specialist" / "one drafter for all").

    Rule: ``select() = arm``. Rewards are checked (finite) and ignored. Parameters: ``arm`` (default 0).
    """

    name = "fixed"
    Params = FixedParams

    def configure(self, params: FixedParams) -> None:
        if params.arm >= self.n_arms:  # needs n_arms
            raise ValueError(f"{type(self).__name__}: parameter 'arm' must be in [0, n_arms={self.n_arms}), got {params.arm}")
        self.arm = params.arm

    def reset(self) -> None:
        pass

    def select(self, context: Context = None) -> int:
        return self.arm

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        self._check_arm(arm)
        self._check_reward(reward)


@register_policy
class RoundRobin(BasePolicy):
    """Cycle through the arms: the arm after the one last updated (arm 0 first).

    Rule: ``select() = (last updated arm + 1) mod K``, so calling ``select`` twice without ``update``
    returns the same arm. A uniform-exploration baseline that switches drafter every step (the worst case
    for catch-up cost). No parameters.
    """

    name = "round_robin"

    def reset(self) -> None:
        self.next_arm = 0

    def select(self, context: Context = None) -> int:
        return self.next_arm

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        self._check_reward(reward)
        self.next_arm = (arm + 1) % self.n_arms

    def _state_items(self) -> dict[str, Any]:
        return {"next_arm": self.next_arm}


@register_policy
class RandomPolicy(BasePolicy):
    """Play an arm drawn uniformly at random each round (through ``self.rng``): the "random" baseline of
    MetaSD's comparison and the reference for pseudo-regret in the tests. No parameters.
    """

    name = "random"

    def reset(self) -> None:
        pass

    def select(self, context: Context = None) -> int:
        return int(self.rng.integers(self.n_arms))

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        self._check_arm(arm)
        self._check_reward(reward)

    def _state_items(self) -> dict[str, Any]:
        return {"rng_state": self.rng_state}


__all__ = ["Fixed", "RandomPolicy", "RoundRobin"]
