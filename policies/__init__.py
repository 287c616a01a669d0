"""Bandit policies that pick which drafter (arm) drafts next; see docs/algorithms.md#bandit-policies.

One family per module, each class registered by name in ``POLICIES`` (the name used in configs):

- ``ucb`` (UCB1): stationary rewards, the MetaSD default;
- ``discounted_ucb`` (DiscountedUCB): drifting rewards (discount ``gamma``);
- ``sliding_window_ucb`` (SlidingWindowUCB): abruptly changing rewards (``window``);
- ``thompson`` (ThompsonSampling): Beta-Bernoulli for [0, 1] rewards, Gaussian for tokens/s;
- ``exp3`` (EXP3): adversarial rewards;
- ``epsilon_greedy`` (EpsilonGreedy): simple baseline;
- ``sequential_halving`` (SequentialHalving): few drafter switches, fixed exploration budget;
- ``linucb`` (LinUCB): contextual, request features -> drafter;
- ``fixed`` (Fixed), ``round_robin`` (RoundRobin), ``random`` (RandomPolicy): non-learning baselines.

Build one with ``make_policy(name, n_arms, seed=None, **params)``.
"""
from __future__ import annotations

import inspect
from typing import Any

from metasd.core.policy import POLICIES, Policy, register_policy

from .non_learning import Fixed, RandomPolicy, RoundRobin
from .epsilon_greedy import EpsilonGreedy
from .exp3 import EXP3
from .linucb import LinUCB
from .sequential_halving import SequentialHalving
from .thompson import ThompsonSampling
from .ucb import UCB1, DiscountedUCB, SlidingWindowUCB

UCB = UCB1  # the short name (``from metasd.policies import UCB``)


def policy_params(name_or_cls: str | type[Policy]) -> list[str]:
    """Hyper-parameter names a policy accepts (its constructor's keywords besides ``n_arms`` and ``seed``)."""
    cls = POLICIES[name_or_cls] if isinstance(name_or_cls, str) else name_or_cls
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "n_arms", "seed")
            and params[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def make_policy(name: str, n_arms: int, seed: int | None = None, **params: Any) -> Policy:
    """Build the registered policy ``name`` over ``n_arms`` arms.

    Raises ``ValueError`` for an unknown name (listing the registered ones), for a parameter the policy
    does not accept (listing the accepted ones) and, from the policy itself, for a bad parameter value
    (naming the parameter).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; registered policies: {sorted(POLICIES)}")
    cls = POLICIES[name]
    signature = inspect.signature(cls.__init__)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    accepted = policy_params(cls)
    unknown = sorted(set(params) - set(accepted))
    if unknown and not takes_any:
        raise ValueError(
            f"policy {name!r} ({cls.__name__}) got unexpected parameter(s) {unknown}; "
            f"accepted parameters: {accepted or 'none'}"
        )
    return cls(n_arms, seed=seed, **params)


__all__ = [
    "POLICIES", "Policy", "register_policy", "make_policy", "policy_params",
    "UCB", "UCB1", "DiscountedUCB", "SlidingWindowUCB", "ThompsonSampling", "EXP3", "EpsilonGreedy",
    "SequentialHalving", "LinUCB", "Fixed", "RoundRobin", "RandomPolicy",
]
