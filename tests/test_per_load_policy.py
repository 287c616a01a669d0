"""Load as policy context (docs/algorithms.md#speculation-under-load): ``load_features`` / ``load_level``
(``metasd.core.decoding.request_features``), the ``per_load`` policy wrapper (``policies/per_load.py``) and LinUCB with
the load features appended to its context. Simulated bandits with fixed seeds, environment seeds offset from the policy's.
"""
from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest

from metasd.core.decoding.request_features import (
    LOAD_LEVELS,
    N_LOAD_FEATURES,
    load_features,
    load_level,
    request_features,
    running_from_features,
    step_features,
)
from metasd.policies import POLICIES, LinUCB, PerLoad, make_policy, policy_params

ENV_SEED_OFFSET = 10_007


def ctx(running: int, forward_tokens: int = 64) -> np.ndarray:
    """A context as a batched caller builds it: the request features (bias first), then the load features."""
    return np.concatenate([[1.0, 0.3], load_features(running, forward_tokens)])


# ---------------------------------------------------------------------------------------------- load features
def test_load_features_values_and_inverse():
    np.testing.assert_allclose(load_features(1, 1), [0.25, 0.1])
    np.testing.assert_allclose(load_features(15, 1023), [1.0, 1.0])
    assert load_features(0, 0).tolist() == [0.0, 0.0] and N_LOAD_FEATURES == 2
    for running in list(range(0, 2000)) + [10_000, 65_535]:
        assert running_from_features(load_features(running, 8)[0]) == running
    with pytest.raises(ValueError, match="integer running"):
        running_from_features(0.3)  # 2**1.2 - 1 = 1.30: no count encodes it
    with pytest.raises(ValueError, match="running"):
        load_features(-1, 4)
    with pytest.raises(ValueError, match="forward_tokens"):
        load_features(2, 1.5)


def test_load_level_buckets():
    expected = {0: 0, 1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 16: 4, 17: 5, 1000: 5}
    assert {r: load_level(r) for r in expected} == expected
    assert LOAD_LEVELS == (1, 2, 4, 8, 16)
    assert [load_level(r, [3]) for r in (1, 3, 4)] == [0, 0, 1]
    with pytest.raises(ValueError):
        load_level(-1)


def test_linucb_takes_the_load_features_after_request_and_step_features():
    """The documented layout: request features, step features, load features - LinUCB infers d from it."""
    categories, n_arms = ["chat", "code"], 3
    x = np.concatenate([request_features(list(range(50)), "code", categories),
                        step_features(3, 0.8, [0.5] * n_arms), load_features(8, 72)])
    assert x.size == 3 + len(categories) + 2 + n_arms + 2
    assert running_from_features(x[-2]) == 8
    policy = LinUCB(n_arms)
    arm = policy.select(x)
    policy.update(arm, 1.0, x)
    assert policy.d == x.size


def load_bandit_means(running: int) -> np.ndarray:
    """Arm 0 (a wide drafter) is best alone, arm 2 ("none") best at high load, arm 1 in between."""
    u = math.log2(1 + running) / 4  # 0.25 .. ~1.25
    return np.array([1.4 - 1.0 * u, 1.0, 0.6 + 0.6 * u])


def play_load_bandit(policy, rounds: int, seed: int, loads=(1, 2, 4, 8, 16, 31)):
    """Rounds at random loads; returns the pseudo-regret against the best arm of each round's load."""
    rng = np.random.default_rng(seed + ENV_SEED_OFFSET)
    regret = 0.0
    for _ in range(rounds):
        running = int(rng.choice(loads))
        means, x = load_bandit_means(running), ctx(running)
        arm = policy.select(x)
        policy.update(arm, float(rng.normal(means[arm], 0.2)), x)
        regret += means.max() - means[arm]
    return regret


def test_load_as_context_beats_every_fixed_arm():
    """A load-dependent best arm: LinUCB on the load features and PerLoad learn it; no fixed arm can."""
    rounds, seeds = 1500, range(2)
    rng = np.random.default_rng(0)
    loads = rng.choice([1, 2, 4, 8, 16, 31], size=10_000)
    fixed = [np.mean([load_bandit_means(int(r)).max() - load_bandit_means(int(r))[a] for r in loads]) * rounds
             for a in range(3)]
    linucb = np.mean([play_load_bandit(LinUCB(3, alpha=0.5), rounds, s) for s in seeds])
    per_load = np.mean([play_load_bandit(make_policy("per_load", 3, seed=s, inner="ucb",
                                                     inner_params={"c": 0.5}), rounds, s) for s in seeds])
    assert linucb < 0.5 * min(fixed), (linucb, fixed)
    assert per_load < 0.5 * min(fixed), (per_load, fixed)


# ---------------------------------------------------------------------------------------------- PerLoad
def test_per_load_is_registered_and_documents_its_parameters():
    assert POLICIES["per_load"] is PerLoad and PerLoad.contextual
    assert policy_params("per_load") == ["inner", "inner_params", "levels", "load_index"]
    for param in policy_params(PerLoad):
        assert param in PerLoad.__doc__
    assert set(inspect.signature(PerLoad.__init__).parameters) >= {"n_arms", "seed"}
    policy = make_policy("per_load", 3, seed=0)
    assert len(policy.policies) == len(LOAD_LEVELS) + 1
    json.dumps(policy.describe())


@pytest.mark.parametrize("params, match", [
    ({"inner": "nope"}, "inner"),
    ({"inner": "per_load"}, "inner"),
    ({"inner": "ucb", "inner_params": {"c": -1.0}}, "'c'"),
    ({"inner": "ucb", "inner_params": {"beta": 1.0}}, "beta"),
    ({"levels": [2, 2]}, "levels"),
    ({"levels": [0, 4]}, "levels"),
    ({"window": 3}, "window"),
])
def test_per_load_refuses_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        make_policy("per_load", 3, **params)


def test_levels_keep_separate_statistics():
    """Training at load 1 does not change the choices at load 8 (nor any level but the trained one's state)."""
    def level8_picks(policy, rounds=200):
        rng = np.random.default_rng(7)
        out = []
        for _ in range(rounds):
            arm = policy.select(ctx(8))
            policy.update(arm, float(rng.random() < [0.2, 0.5, 0.8][arm]), ctx(8))
            out.append(arm)
        return out

    trained = make_policy("per_load", 3, seed=0, inner="thompson")
    untouched = make_policy("per_load", 3, seed=0, inner="thompson")
    before = [json.dumps(p.state_dict()) for p in trained.policies]
    rng = np.random.default_rng(1)
    for _ in range(500):  # load 1: arm 0 always pays
        arm = trained.select(ctx(1))
        trained.update(arm, float(arm == 0 or rng.random() < 0.1), ctx(1))
    after = [json.dumps(p.state_dict()) for p in trained.policies]
    assert after[0] != before[0] and after[1:] == before[1:]
    assert level8_picks(trained) == level8_picks(untouched)
    assert trained.select(ctx(1)) == 0


def test_context_decides_the_level():
    policy = make_policy("per_load", 2, seed=0, inner="ucb", levels=[1, 4])
    assert [policy.level(ctx(r)) for r in (1, 2, 4, 5, 100)] == [0, 1, 1, 2, 2]
    assert policy.level(None) == 0
    with pytest.raises(ValueError, match="integer running"):
        policy.select([1.0, 0.3, 0.3, 0.5])  # no load features: -2 holds 0.3
    with pytest.raises(ValueError, match="no load entry"):
        policy.select([])
    first = make_policy("per_load", 2, seed=0, load_index=0)  # load first
    assert first.level(np.r_[load_features(9, 8), 1.0]) == 4
    policy.observe(0, {0: 1.0, 1: 0.0}, ctx(3))  # full information goes to the context's level
    assert policy.policies[1].counts.tolist() == [1, 1] and policy.policies[0].counts.tolist() == [0, 0]


def test_per_load_delegates_reward_bounds_and_counterfactuals():
    assert make_policy("per_load", 3, inner="exp3").requires_bounded_rewards
    assert not make_policy("per_load", 3, inner="ucb").requires_bounded_rewards
    assert make_policy("per_load", 3, inner="ucb").uses_counterfactuals
    assert not make_policy("per_load", 3, inner="exp3").uses_counterfactuals


@pytest.mark.parametrize("inner, inner_params", [("thompson", {"likelihood": "gaussian"}), ("linucb", {}),
                                                 ("ucb", {"normalize": True})])
def test_state_roundtrips_through_json_and_continues_identically(inner, inner_params):
    first, second = 300, 300
    rng = np.random.default_rng(99)
    loads = rng.choice([1, 2, 3, 6, 12, 40], size=first + second)
    rewards = rng.random((first + second, 3))

    def play(policy, start, stop):
        out = []
        for t in range(start, stop):
            x = ctx(int(loads[t]), int(loads[t]) * 9)
            arm = policy.select(x)
            policy.update(arm, float(rewards[t, arm]), x)
            out.append(arm)
        return out

    original = make_policy("per_load", 3, seed=1, inner=inner, inner_params=inner_params)
    play(original, 0, first)
    blob = json.dumps(original.state_dict())
    restored = make_policy("per_load", 3, seed=2, inner=inner, inner_params=inner_params)
    restored.load_state_dict(json.loads(blob))
    assert json.dumps(restored.state_dict()) == blob
    assert play(restored, first, first + second) == play(original, first, first + second)
    other = make_policy("per_load", 3, inner=inner, inner_params=inner_params, levels=[1, 8])
    with pytest.raises(ValueError, match="levels"):
        other.load_state_dict(json.loads(blob))
    state = json.loads(blob)
    del state["policies"]
    with pytest.raises(KeyError, match="policies"):
        restored.load_state_dict(state)


def test_reset_forgets_every_level():
    policy = make_policy("per_load", 3, seed=0, inner="ucb")
    fresh = json.dumps(policy.state_dict())
    play_load_bandit(policy, 200, 0)
    assert json.dumps(policy.state_dict()) != fresh
    policy.reset()
    assert json.dumps(policy.state_dict()) == fresh
