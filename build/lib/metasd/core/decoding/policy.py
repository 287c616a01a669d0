"""The policy interface: a multi-armed bandit that picks which drafter (arm) drafts next.

Concrete policies live in ``metasd.policies`` (one family per file) and depend only on this module.
The engine calls ``select`` before a step (or a request), then ``update`` with the reward it measured.
"""
from __future__ import annotations

import abc
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from .params import Bool, Float, Int, PluginParams, check_params  # noqa: F401  (policies import them here)
from .registry import registrar

# A context is a fixed-length feature vector of cheap request features (see ``metasd.core.decoding.request_features``);
# context-free policies ignore it.
Context = Sequence[float] | np.ndarray | None


class PolicyParams(PluginParams):
    """Base of a policy's ``Params``: its hyper-parameters, checked by the constructor - for a pool file, an
    experiment file and a Python caller alike - before anything else runs. Unknown names are refused."""


class Policy(abc.ABC):
    """A bandit over ``n_arms`` arms (drafters, indexed 0..n_arms-1).

    Hyper-parameters are declared once, as the class's ``Params`` model (a ``PolicyParams``): the constructor
    checks the keyword arguments it is given against it (``Policy(n_arms, seed, **params)``) and ``configure``
    takes them (by default, each as an attribute of the same name). Subclasses keep all learnt state in plain
    Python / numpy values so that ``state_dict`` can return JSON-serialisable data. ``select`` must be cheap
    (the engine calls it every step: < 1 ms).
    """

    #: name used in configs and on the CLI (``policy: {name: ucb}``)
    name: ClassVar[str] = ""
    #: True for contextual policies: the engine then passes ``metasd.core.decoding.request_features.request_features``
    contextual: ClassVar[bool] = False
    #: the hyper-parameters (see the class docstring); the base declares none
    Params: ClassVar[type[PolicyParams]] = PolicyParams

    @property
    def requires_bounded_rewards(self) -> bool:
        """True when this policy (as configured) only accepts rewards in [0, 1]; the engine then refuses
        an unbounded reward such as throughput at construction time instead of failing mid-request."""
        return False

    def __init__(self, n_arms: int, seed: int | None = None, **params: Any):
        if isinstance(n_arms, bool) or not isinstance(n_arms, (int, np.integer)) or n_arms < 1:
            raise ValueError(f"{type(self).__name__}: n_arms must be an integer >= 1, got {n_arms!r}")
        self.n_arms = int(n_arms)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.params = check_params(type(self).Params, params, type(self).__name__)
        self.configure(self.params)
        self.reset()

    def configure(self, params: PolicyParams) -> None:
        """Take the checked hyper-parameters (default: each as an attribute of the same name); a policy checks here
        what needs ``n_arms`` as well."""
        for name in type(params).model_fields:
            setattr(self, name, getattr(params, name))

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything learnt (called per request when the policy does not persist)."""

    @abc.abstractmethod
    def select(self, context: Context = None) -> int:
        """Return the arm to play next."""

    @abc.abstractmethod
    def update(self, arm: int, reward: float, context: Context = None) -> None:
        """Record the reward observed for ``arm`` (the arm returned by the last ``select``)."""

    #: True when ``observe`` learns from other arms' counterfactual rewards too (full-information feedback)
    uses_counterfactuals: ClassVar[bool] = False
    #: True when what ``observe`` learns of an arm does not depend on the probability the policy gave it - so a
    #: scheduler may make a step draft with another arm than the one selected (``Request.switch_arm``: a probe) and
    #: report it played without biasing the policy. False for a policy that weighs a played arm's reward by its
    #: probability (EXP3, Hedge's arms scored only when played) and for one that learns no counterfactuals
    forced_arms_unbiased: ClassVar[bool] = False

    def observe(self, arm: int, rewards: Mapping[int, float], context: Context = None) -> None:
        """One round with feedback for several arms: ``rewards[arm]`` is what the chosen ``arm`` earned, the others
        what those arms would have earned (counterfactuals from the verified text: no extra verifier call).
        Default: bandit feedback, ``update(arm, rewards[arm])``; a policy that can use the others overrides this
        and sets ``uses_counterfactuals``."""
        self.update(arm, rewards[arm], context)

    def state_dict(self) -> dict[str, Any]:
        """Learnt state as JSON-serialisable values (numpy arrays become lists)."""
        out: dict[str, Any] = {"name": self.name, "n_arms": self.n_arms}
        for key, value in self._state_items().items():
            out[key] = value.tolist() if isinstance(value, np.ndarray) else value
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if state.get("n_arms", self.n_arms) != self.n_arms:
            raise ValueError(f"{type(self).__name__}: state has n_arms={state.get('n_arms')}, policy has {self.n_arms}")
        current = self._state_items()
        for key in current:
            if key not in state:
                raise KeyError(f"{type(self).__name__}: state is missing {key!r}")
            value = state[key]
            setattr(self, key, np.asarray(value, dtype=current[key].dtype) if isinstance(current[key], np.ndarray) else value)

    def _state_items(self) -> dict[str, Any]:
        """Attributes that make up the learnt state; override to list them."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Hyper-parameters, for logging."""
        return {"name": self.name, **self.params.model_dump()}


# Registry of policy classes by name; ``register_policy`` is also used for user classes.
POLICIES: dict[str, type[Policy]] = {}
register_policy = registrar(POLICIES, "name", "Class decorator: make a policy available by its ``name`` in configs "
                                              "and on the CLI.")


def policy_params(name_or_cls: str | type[Policy]) -> list[str]:
    """Hyper-parameter names a registered policy (or a policy class) accepts: its ``Params`` fields."""
    return list(resolve_policy(name_or_cls).Params.model_fields)


def resolve_policy(name_or_cls: str | type[Policy]) -> type[Policy]:
    """A registered policy name (or a ``Policy`` class, returned as it is) -> the class; ``ValueError`` listing the
    registered names."""
    if isinstance(name_or_cls, type):
        return name_or_cls
    if name_or_cls not in POLICIES:
        raise ValueError(f"unknown policy {name_or_cls!r}; registered policies: {sorted(POLICIES)}")
    return POLICIES[name_or_cls]


def make_policy(name_or_cls: str | type[Policy], n_arms: int, seed: int | None = None, **params: Any) -> Policy:
    """The one policy factory: the registered policy ``name`` (or a ``Policy`` class) over ``n_arms`` arms.

    ``ValueError`` for an unknown name (listing the registered ones), an unknown parameter (listing the accepted
    ones) and a bad value (naming the parameter and what it must be).
    """
    return resolve_policy(name_or_cls)(n_arms, seed=seed, **params)
