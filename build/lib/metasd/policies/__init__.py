"""Bandit policies that pick which drafter (arm) drafts next; see docs/algorithms.md#bandit-policies.

One family per module, each class registered by name in ``POLICIES`` (the name used in configs):

- ``ucb`` (UCB1): stationary rewards, the MetaSD default;
- ``discounted_ucb`` (DiscountedUCB): drifting rewards (discount ``gamma``);
- ``sliding_window_ucb`` (SlidingWindowUCB): abruptly changing rewards (``window``);
- ``thompson`` (ThompsonSampling): Beta-Bernoulli for [0, 1] rewards, Gaussian for tokens/s;
- ``exp3`` (EXP3): adversarial rewards;
- ``hedge`` (Hedge): exponential weights for full-information feedback (``feedback: full``);
- ``epsilon_greedy`` (EpsilonGreedy): simple baseline;
- ``sequential_halving`` (SequentialHalving): few drafter switches, fixed exploration budget;
- ``linucb`` (LinUCB): contextual, request features -> drafter;
- ``fixed`` (Fixed), ``round_robin`` (RoundRobin), ``random`` (RandomPolicy): non-learning baselines;
- ``per_load`` (PerLoad): a wrapper, one inner policy per load level (running requests, from the context).

Build one with ``make_policy(name, n_arms, seed=None, **params)`` (or the class: ``UCB1(n_arms, c=2.0)``); each
declares its hyper-parameters once, as its ``Params`` model.
"""
from __future__ import annotations

from metasd.core.decoding.policy import POLICIES, Policy, PolicyParams, make_policy, policy_params, register_policy

from .non_learning import Fixed, RandomPolicy, RoundRobin
from .epsilon_greedy import EpsilonGreedy
from .exp3 import EXP3
from .hedge import Hedge
from .linucb import LinUCB
from .per_load import PerLoad
from .sequential_halving import SequentialHalving
from .thompson import ThompsonSampling
from .ucb import UCB1, DiscountedUCB, SlidingWindowUCB

UCB = UCB1  # the short name (``from metasd.policies import UCB``)


__all__ = [
    "POLICIES", "Policy", "PolicyParams", "register_policy", "make_policy", "policy_params",
    "UCB", "UCB1", "DiscountedUCB", "SlidingWindowUCB", "ThompsonSampling", "EXP3", "EpsilonGreedy",
    "SequentialHalving", "LinUCB", "Fixed", "RoundRobin", "RandomPolicy", "Hedge", "PerLoad",
]
