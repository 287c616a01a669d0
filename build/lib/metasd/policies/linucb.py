"""LinUCB: a contextual bandit on cheap request features (``metasd.core.decoding.request_features.request_features``)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from pydantic import Field

from metasd.core.decoding.policy import Float, Int, PolicyParams, register_policy

from ._common import BasePolicy, Context, first_unplayed


class LinUCBParams(PolicyParams):
    """Hyper-parameters of LinUCB."""

    alpha: Float = Field(1.0, ge=0.0, allow_inf_nan=False, description="exploration weight")
    d: Int | None = Field(None, ge=1, description="context dimension (None: from the first context)")
    reg: Float = Field(1.0, gt=0.0, allow_inf_nan=False, description="ridge regularisation of A_a")


@register_policy
class LinUCB(BasePolicy):
    """LinUCB with disjoint linear models (Li, Chu, Langford & Schapire 2010, Algorithm 1), for picking a
    drafter from request features (task category, prompt length, prompt n-gram overlap) when the best
    drafter depends on the request. Usually run as a persistent policy across requests.

    Each arm is played once first (as in UCB1; not in Li et al.), so an untried arm is never judged by the
    zero prior alone. Model per arm ``a``: ``A_a = reg * I + sum x x^T`` and ``b_a = sum reward * x``
    over the contexts ``x`` in which ``a`` was played; ``theta_a = A_a^-1 b_a``. Rule:
    ``argmax_a theta_a^T x + alpha * sqrt(x^T A_a^-1 x)`` (ties: lowest index). ``A_a^-1`` is kept
    directly and updated with the Sherman-Morrison formula, so a round costs O(K d^2) and inverts nothing.

    Context: a length-``d`` vector. ``d`` is given or inferred from the first ``select``/``update`` call
    (``context=None`` on that call means ``d = 1``). ``context=None`` means the bias-only context
    ``[1.0, 0, ..., 0]`` (the first feature of ``request_features`` is the bias), which for ``d = 1``
    makes LinUCB a UCB on each arm's mean. A context of another length raises ``ValueError``.
    Rewards may be any finite float, but ``alpha`` and the ridge prior (theta = 0) are on the reward's
    scale: for rewards like tokens/s divide by a reference rate first (e.g. plain decoding's), or the
    shrinkage towards 0 and a bonus far below the noise make the policy nearly greedy.

    Parameters: ``alpha`` (exploration weight, default 1.0), ``d`` (context dimension, default None =
    inferred), ``reg`` (ridge regularisation of ``A_a``, default 1.0). Deterministic.
    """

    name = "linucb"
    contextual = True
    Params = LinUCBParams

    def configure(self, params: LinUCBParams) -> None:
        self.alpha, self.reg = params.alpha, params.reg
        self.d_param = params.d  # ``d`` itself is learnt state: the dimension in use

    def reset(self) -> None:
        self.d: int | None = None
        self.A_inv: np.ndarray | None = None
        self.b: np.ndarray | None = None
        self.theta: np.ndarray | None = None
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        if self.d_param is not None:
            self._allocate(self.d_param)

    def _allocate(self, d: int) -> None:
        self.d = int(d)
        self.A_inv = np.tile(np.eye(self.d) / self.reg, (self.n_arms, 1, 1))
        self.b = np.zeros((self.n_arms, self.d), dtype=np.float64)
        self.theta = np.zeros((self.n_arms, self.d), dtype=np.float64)

    def _context(self, context: Context) -> np.ndarray:
        if context is None:
            if self.d is None:
                self._allocate(1)
            x = np.zeros(self.d, dtype=np.float64)
            x[0] = 1.0
            return x
        x = np.asarray(context, dtype=np.float64).reshape(-1)
        if self.d is None:
            if x.size == 0:
                raise ValueError(f"{self._label()}: context must have at least one feature")
            self._allocate(x.size)
        if x.size != self.d:
            raise ValueError(f"{self._label()}: context has {x.size} features, expected d={self.d}")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{self._label()}: context must be finite, got {x.tolist()}")
        return x

    def select(self, context: Context = None) -> int:
        x = self._context(context)
        arm = first_unplayed(self.counts)
        if arm >= 0:
            return arm
        a_inv_x = self.A_inv @ x  # (K, d)
        width = np.sqrt(np.maximum(a_inv_x @ x, 0.0))
        return int(np.argmax(self.theta @ x + self.alpha * width))

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        arm = self._check_arm(arm)
        reward = self._check_reward(reward)
        x = self._context(context)
        a_inv = self.A_inv[arm]
        a_inv_x = a_inv @ x
        a_inv -= np.outer(a_inv_x, a_inv_x) / (1.0 + x @ a_inv_x)
        self.b[arm] += reward * x
        self.theta[arm] = a_inv @ self.b[arm]
        self.counts[arm] += 1

    uses_counterfactuals = True
    forced_arms_unbiased = True  # per-arm estimates from the rewards alone

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        """Full information: every scored arm's linear model learns its sample in the same context."""
        self._check_arm(arm)
        if arm not in rewards:
            raise ValueError(f"{self._label()}: the chosen arm {arm} has no reward among {sorted(rewards)}")
        for a, r in sorted(rewards.items()):
            self.update(a, r, context)

    def _state_items(self) -> dict[str, Any]:
        return {"d": self.d, "A_inv": self.A_inv, "b": self.b, "counts": self.counts}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        d = state.get("d")
        if self.d_param is not None and d is not None and d != self.d_param:
            raise ValueError(f"{self._label()}: state has d={d}, policy was built with d={self.d_param}")
        super().load_state_dict(state)
        if self.d is None:  # nothing learnt yet
            self.reset()
            return
        self.d = int(self.d)
        self.A_inv = np.asarray(self.A_inv, dtype=np.float64).reshape(self.n_arms, self.d, self.d).copy()
        self.b = np.asarray(self.b, dtype=np.float64).reshape(self.n_arms, self.d).copy()
        self.theta = np.empty_like(self.b)
        for arm in range(self.n_arms):  # same expression as update(), so the values are bit-identical
            self.theta[arm] = self.A_inv[arm] @ self.b[arm]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "alpha": self.alpha, "d": self.d if self.d is not None else self.d_param,
                "reg": self.reg}


__all__ = ["LinUCB"]
