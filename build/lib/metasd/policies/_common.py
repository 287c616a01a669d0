"""Shared helpers for the concrete policies (not a policy itself; nothing here is registered)."""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from metasd.core.decoding.policy import Context, Policy


class BasePolicy(Policy):
    """``Policy`` plus argument checking and an optional, JSON-serialisable RNG state.

    Policies that draw random numbers list ``"rng_state"`` in ``_state_items``: the property below reads
    and writes ``self.rng``'s bit-generator state, so ``load_state_dict`` restores the exact random stream
    and a restored policy makes the same selections as an uninterrupted one.
    """

    # -- argument checking -------------------------------------------------------------------------
    def _label(self) -> str:
        return f"{type(self).__name__} ({self.name!r})"

    def _check_arm(self, arm: Any) -> int:
        try:
            index = int(arm)
        except (TypeError, ValueError):
            raise ValueError(f"{self._label()}: arm must be an integer, got {arm!r}") from None
        if index != arm or not 0 <= index < self.n_arms:
            raise ValueError(f"{self._label()}: arm must be an integer in [0, {self.n_arms}), got {arm!r}")
        return index

    def _check_reward(self, reward: Any) -> float:
        return finite_number(reward, f"{self._label()}: reward")

    def _check_unit_reward(self, reward: Any) -> float:
        value = self._check_reward(reward)
        if not 0.0 <= value <= 1.0:
            raise ValueError(
                f"{self._label()}: reward must be in [0, 1], got {value!r} "
                "(use a [0, 1] reward such as block efficiency, or a policy/setting for unbounded rewards)"
            )
        return value

    def _record_sample(self, arm: Any, reward: Any) -> tuple[int, float]:
        """Check ``arm`` and ``reward`` and add them to ``counts`` / ``sums`` / ``t`` (sample-mean policies)."""
        arm, reward = self._check_arm(arm), self._check_reward(reward)
        self.counts[arm] += 1
        self.sums[arm] += reward
        self.t += 1
        return arm, reward

    def _record_round(self, arm: Any, rewards: Mapping[Any, Any]) -> list[tuple[int, float]]:
        """Full information (sample-mean policies): one round (``t`` + 1) in which every arm of ``rewards`` got a
        sample - the chosen ``arm``'s reward and the others' counterfactuals. Returns the checked (arm, reward)s."""
        self._check_arm(arm)
        if arm not in rewards:
            raise ValueError(f"{self._label()}: the chosen arm {arm} has no reward among {sorted(rewards)}")
        samples = [(self._check_arm(a), self._check_reward(r)) for a, r in sorted(rewards.items())]
        for a, r in samples:
            self.counts[a] += 1
            self.sums[a] += r
        self.t += 1
        return samples

    # -- RNG state ---------------------------------------------------------------------------------
    @property
    def rng_state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    @rng_state.setter
    def rng_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


def finite_number(value: Any, what: str) -> float:
    """``float(value)`` for a real, finite number (bools rejected), else a ``ValueError``: "``what`` must be ..."."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return number


def first_unplayed(counts: np.ndarray) -> int:
    """Index of the first arm with a zero count, or -1."""
    zero = np.flatnonzero(counts == 0)
    return int(zero[0]) if zero.size else -1


__all__ = ["BasePolicy", "Context", "finite_number", "first_unplayed"]
