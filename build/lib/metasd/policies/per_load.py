"""PerLoad: one inner policy per load level, so what is learnt at batch 1 does not decide at batch 16."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from pydantic import Field, field_validator

from metasd.core.decoding.policy import POLICIES, Int, PolicyParams, make_policy, register_policy
from metasd.core.decoding.request_features import LOAD_LEVELS, load_level, running_from_features

from ._common import BasePolicy, Context


class PerLoadParams(PolicyParams):
    """Hyper-parameters of PerLoad (see the class docstring)."""

    inner: str = Field("ucb", description="the registered policy run at each load level")
    inner_params: dict[str, Any] = Field(default_factory=dict, description="the inner policy's parameters")
    levels: list[Int] = Field(default_factory=lambda: list(LOAD_LEVELS),
                              description="ascending upper bounds of the load levels (running requests)")
    load_index: Int = Field(-2, description="position of log2(1 + running) / 4 in the context")

    @field_validator("levels")
    @classmethod
    def _ascending(cls, levels: list[int]) -> list[int]:
        if any(b < 1 for b in levels) or any(b <= a for a, b in zip(levels, levels[1:])):
            raise ValueError("must be strictly increasing integers >= 1")
        return levels

    @field_validator("inner")
    @classmethod
    def _known(cls, inner: str) -> str:
        if inner == "per_load":
            raise ValueError("must be another policy than per_load")
        if inner not in POLICIES:
            raise ValueError(f"must be a registered policy, one of {sorted(POLICIES)}")
        return inner


@register_policy
class PerLoad(BasePolicy):
    """A wrapper that keeps one ``inner`` policy per load level and lets the level in the context decide which one
    chooses and learns. The best drafter (and budget arm: ``"cascade@16"``, ``"none"``) depends on the load: at batch
    1 the verifier's forward is almost free per extra token and wide drafts pay; at batch 16 every padded node is paid
    by every row (docs/algorithms.md#speculation-under-load). Statistics from one load level never move another's
    choice.

    **How the load reaches it.** Through the ``context`` that ``select``, ``update`` and ``observe`` already take
    (``metasd/core/decoding/policy.py``): the caller appends
    ``metasd.core.decoding.request_features.load_features(running, forward_tokens)`` last, and PerLoad reads ``running``
    back exactly from the entry at ``load_index`` (default -2: ``log2(1 + running) / 4``, ``running_from_features``) and
    plays level ``load_level(running, levels)``. So one context vector serves PerLoad and a contextual policy alike, and
    ``update`` learns at the level the context of the step had (pass the context used at ``select``). ``context=None``
    counts as one running request (level 0). The whole context is passed on to the inner policy, so a contextual inner
    (``linucb``) sees the request, step and load features too. A context whose load entry does not encode a count is
    refused (a check, not a guarantee: a value that happens to encode one is read as a load). A scheduler with adaptive
    speculation (``metasd.core.batching.adaptive``; a pool's ``serving.adaptive: true``) appends them; the
    single-request engine does not, so a pool that names ``per_load`` must be served that way (``metasd generate`` would
    read an arm's recent acceptance as the load; refused where that value encodes no count).

    Parameters: ``inner`` (a registered policy name, default "ucb"), ``inner_params`` (its parameters, checked by it),
    ``levels`` (ascending upper bounds of the levels, default [1, 2, 4, 8, 16]: levels 1, 2, 3-4, 5-8, 9-16, 17+),
    ``load_index`` (where the running-count feature sits in the context, default -2). Level ``j``'s inner policy is
    seeded with ``[seed, j]`` (None stays None). Deterministic given the seed; state (every level's) is
    JSON-serialisable and restorable.
    """

    name = "per_load"
    contextual = True
    Params = PerLoadParams

    def configure(self, params: PerLoadParams) -> None:
        super().configure(params)
        n_levels = len(self.levels) + 1
        try:
            self.policies = [make_policy(self.inner, self.n_arms, seed=None if self.seed is None else [self.seed, j],
                                         **self.inner_params) for j in range(n_levels)]
        except ValueError as err:
            raise ValueError(f"{self._label()}: inner policy {self.inner!r}: {err}") from None
        self.uses_counterfactuals = self.policies[0].uses_counterfactuals
        self.forced_arms_unbiased = self.policies[0].forced_arms_unbiased

    @property
    def requires_bounded_rewards(self) -> bool:
        return self.policies[0].requires_bounded_rewards

    def reset(self) -> None:
        for policy in self.policies:
            policy.reset()

    def level(self, context: Context) -> int:
        """The load level the context says (level of 1 running request for ``context=None``)."""
        if context is None:
            return load_level(1, self.levels)
        x = np.asarray(context, dtype=np.float64).reshape(-1)
        if not -x.size <= self.load_index < x.size:
            raise ValueError(f"{self._label()}: context of {x.size} features has no load entry at {self.load_index}")
        try:
            running = running_from_features(x[self.load_index])
        except ValueError as err:
            raise ValueError(f"{self._label()}: {err}") from None
        return load_level(running, self.levels)

    def select(self, context: Context = None) -> int:
        return self.policies[self.level(context)].select(context)

    def update(self, arm: int, reward: float, context: Context = None) -> None:
        self.policies[self.level(context)].update(self._check_arm(arm), reward, context)

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        self.policies[self.level(context)].observe(self._check_arm(arm), rewards, context)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n_arms": self.n_arms, "inner": self.inner, "levels": list(self.levels),
                "policies": [p.state_dict() for p in self.policies]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("n_arms", self.n_arms) != self.n_arms:
            raise ValueError(f"{self._label()}: state has n_arms={state.get('n_arms')}, policy has {self.n_arms}")
        for key in ("inner", "levels", "policies"):
            if key not in state:
                raise KeyError(f"{self._label()}: state is missing {key!r}")
        if state["inner"] != self.inner or list(state["levels"]) != list(self.levels):
            raise ValueError(f"{self._label()}: state is for inner={state['inner']!r} levels={list(state['levels'])}, "
                             f"policy has inner={self.inner!r} levels={list(self.levels)}")
        for policy, inner_state in zip(self.policies, state["policies"], strict=True):
            policy.load_state_dict(inner_state)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "inner": self.policies[0].describe(), "levels": list(self.levels),
                "load_index": self.load_index}


__all__ = ["PerLoad", "PerLoadParams"]
