"""Behavioural tests of the bandit policies (``metasd.policies``) and request features (``metasd.core.decoding.request_features``).

Simulated bandits with fixed seeds; assertions compare policies with each other (regret ratios), not with
magic numbers. The environment's RNG is always seeded differently from the policy's: identically seeded
streams would correlate the policy's coin flips with the rewards.
"""
from __future__ import annotations

import inspect
import json
import math
import time

import numpy as np
import pytest

from metasd.core.decoding.request_features import n_features, ngram_self_overlap, request_features
from metasd.policies import (
    EXP3,
    POLICIES,
    UCB1,
    DiscountedUCB,
    EpsilonGreedy,
    Fixed,
    LinUCB,
    Policy,
    RandomPolicy,
    RoundRobin,
    SequentialHalving,
    SlidingWindowUCB,
    ThompsonSampling,
    make_policy,
    policy_params,
)

BERNOULLI_MEANS = [0.3, 0.5, 0.7]
GAUSSIAN_MEANS = [20.0, 25.0, 30.0]  # a tokens/s-like reward
GAUSSIAN_STD = 5.0
ENV_SEED_OFFSET = 10_007

EXPECTED_NAMES = {
    "ucb", "discounted_ucb", "sliding_window_ucb", "thompson", "exp3", "epsilon_greedy",
    "sequential_halving", "linucb", "fixed", "round_robin", "random",
}


def simulate(policy: Policy, means, rounds: int, env_seed: int, *, gaussian_std: float | None = None,
             means_after=None, change_at: int | None = None):
    """Play ``rounds`` rounds; return (per-round pseudo-regret, selected arms)."""
    rng = np.random.default_rng(env_seed + ENV_SEED_OFFSET)
    before = np.asarray(means, dtype=np.float64)
    after = before if means_after is None else np.asarray(means_after, dtype=np.float64)
    regret = np.empty(rounds)
    picks = np.empty(rounds, dtype=np.int64)
    for t in range(rounds):
        m = before if change_at is None or t < change_at else after
        arm = policy.select()
        if gaussian_std is None:
            reward = float(rng.random() < m[arm])
        else:
            reward = float(rng.normal(m[arm], gaussian_std))
        policy.update(arm, reward)
        regret[t] = m.max() - m[arm]
        picks[t] = arm
    return regret, picks


def mean_regret(name: str, params: dict, rounds: int, seeds, means=BERNOULLI_MEANS, **kw) -> float:
    return float(np.mean([
        simulate(make_policy(name, len(means), seed=s, **params), means, rounds, s, **kw)[0].sum()
        for s in seeds
    ]))


# --------------------------------------------------------------------------------------------------
# registry and construction
# --------------------------------------------------------------------------------------------------

def test_all_policies_registered_with_docstrings():
    assert EXPECTED_NAMES <= set(POLICIES)
    for name in EXPECTED_NAMES:
        cls = POLICIES[name]
        assert cls.name == name
        assert cls.__doc__ and len(cls.__doc__.strip()) > 80, f"{cls.__name__} needs a docstring"
        policy = make_policy(name, 3, seed=0)
        assert isinstance(policy, cls)
        assert policy.describe()["name"] == name
        json.dumps(policy.describe())


def test_make_policy_unknown_name_lists_registered():
    with pytest.raises(ValueError) as err:
        make_policy("ucb2", 3)
    for name in ("ucb", "thompson", "linucb"):
        assert name in str(err.value)


def test_make_policy_unexpected_parameter_lists_accepted():
    with pytest.raises(ValueError) as err:
        make_policy("ucb", 3, beta=2.0)
    message = str(err.value)
    assert "beta" in message and "'c'" in message and "normalize" in message
    with pytest.raises(ValueError, match="window"):
        make_policy("discounted_ucb", 3, window=10)  # a sliding-window parameter
    assert policy_params("sliding_window_ucb") == ["c", "normalize", "window"]


@pytest.mark.parametrize("name, params, bad", [
    ("ucb", {"c": -1.0}, "c"),
    ("ucb", {"c": "high"}, "c"),
    ("ucb", {"normalize": "yes"}, "normalize"),
    ("discounted_ucb", {"gamma": 1.5}, "gamma"),
    ("discounted_ucb", {"gamma": 0.0}, "gamma"),
    ("sliding_window_ucb", {"window": 0}, "window"),
    ("sliding_window_ucb", {"window": 2.5}, "window"),
    ("thompson", {"likelihood": "poisson"}, "likelihood"),
    ("thompson", {"prior_alpha": 0.0}, "prior_alpha"),
    ("thompson", {"noise_std": -1.0}, "noise_std"),
    ("exp3", {"gamma": 0.0}, "gamma"),
    ("exp3", {"reward_scale": "max"}, "reward_scale"),
    ("exp3", {"reward_scale": -2.0}, "reward_scale"),
    ("epsilon_greedy", {"epsilon": 1.5}, "epsilon"),
    ("epsilon_greedy", {"decay": -0.1}, "decay"),
    ("sequential_halving", {"budget": 0}, "budget"),
    ("linucb", {"alpha": -0.5}, "alpha"),
    ("linucb", {"d": 0}, "d"),
    ("fixed", {"arm": 3}, "arm"),
    ("fixed", {"arm": -1}, "arm"),
])
def test_make_policy_bad_values_name_the_parameter(name, params, bad):
    with pytest.raises(ValueError, match=f"'{bad}'"):
        make_policy(name, 3, **params)


def test_n_arms_must_be_positive():
    for name in EXPECTED_NAMES:
        with pytest.raises(ValueError, match="n_arms"):
            make_policy(name, 0)


# --------------------------------------------------------------------------------------------------
# reward and arm validation
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: ThompsonSampling(3, seed=0),
    lambda: EXP3(3, seed=0),
])
@pytest.mark.parametrize("reward", [1.5, -0.1])
def test_unit_interval_policies_reject_out_of_range_rewards(make, reward):
    policy = make()
    arm = policy.select()
    with pytest.raises(ValueError) as err:
        policy.update(arm, reward)
    assert policy.name in str(err.value) and "[0, 1]" in str(err.value)


def test_exp3_importance_weighted_update():
    policy = EXP3(3, seed=0, gamma=0.2)
    policy.log_weights[:] = [0.0, -1.0, -2.0]
    p = policy.probabilities()
    w = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose(p, 0.8 * w / w.sum() + 0.2 / 3)
    policy.update(2, 0.6)
    # w_2 *= exp(gamma * (x / p_2) / K), then shifted so the max log-weight is 0
    np.testing.assert_allclose(policy.log_weights, [0.0, -1.0, -2.0 + 0.2 * (0.6 / p[2]) / 3])
    draws = np.bincount([policy.select() for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(draws, policy.probabilities(), atol=0.03)


def test_exp3_reward_scale_maps_unbounded_rewards():
    running = EXP3(3, seed=0, reward_scale="running_max")
    for reward in (25.0, 40.0, 10.0):
        running.update(running.select(), reward)
    assert running.running_max == 40.0
    with pytest.raises(ValueError, match="exp3"):
        running.update(0, -1.0)
    fixed = EXP3(3, seed=0, reward_scale=50.0)
    before = fixed.log_weights.copy()
    fixed.update(1, 500.0)  # clipped to 1
    expected = fixed.gamma * (1.0 / (1.0 / 3)) / 3
    assert fixed.log_weights[1] - fixed.log_weights[0] == pytest.approx(expected - (before[1] - before[0]))


@pytest.mark.parametrize("name, params", [
    ("ucb", {}), ("discounted_ucb", {}), ("sliding_window_ucb", {}), ("epsilon_greedy", {}),
    ("thompson", {"likelihood": "gaussian"}), ("linucb", {}), ("sequential_halving", {}),
])
def test_unbounded_rewards_accepted_and_nonfinite_rejected(name, params):
    policy = make_policy(name, 3, seed=0, **params)
    for reward in (-3.5, 1e6, 42.0, 0.0):
        policy.update(policy.select(), reward)
    for bad in (math.nan, math.inf, "x"):
        with pytest.raises(ValueError, match=name):
            policy.update(0, bad)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_bad_arm_index_rejected(name):
    policy = make_policy(name, 3, seed=0)
    for bad in (3, -1, 1.5):
        with pytest.raises(ValueError, match="arm"):
            policy.update(bad, 0.5)


# --------------------------------------------------------------------------------------------------
# learning: regret on stationary bandits
# --------------------------------------------------------------------------------------------------

LEARNERS_BERNOULLI = [
    ("ucb", {}),
    ("discounted_ucb", {"gamma": 0.9995}),
    ("sliding_window_ucb", {"window": 2000}),
    ("thompson", {"likelihood": "bernoulli"}),
    ("thompson", {"likelihood": "gaussian"}),
    ("exp3", {"gamma": 0.1}),
    ("epsilon_greedy", {"epsilon": 0.1}),
    ("epsilon_greedy", {"epsilon": 1.0, "decay": 0.05}),
    ("sequential_halving", {"budget": 1000}),
    ("linucb", {}),
]


@pytest.fixture(scope="module")
def random_regret_bernoulli():
    return mean_regret("random", {}, 10_000, seeds=[0, 1])


@pytest.mark.parametrize("name, params", LEARNERS_BERNOULLI, ids=lambda v: str(v))
def test_regret_far_below_random_bernoulli(name, params, random_regret_bernoulli):
    regret = mean_regret(name, params, 10_000, seeds=[0, 1])
    assert regret < 0.25 * random_regret_bernoulli, (name, params, regret, random_regret_bernoulli)


LEARNERS_GAUSSIAN = [
    ("ucb", {"normalize": True}),
    ("sliding_window_ucb", {"window": 2000, "normalize": True}),
    ("thompson", {"likelihood": "gaussian"}),
    ("thompson", {"likelihood": "gaussian", "prior_mean": 25.0, "prior_std": 10.0, "noise_std": 5.0}),
    ("epsilon_greedy", {"epsilon": 0.1}),
    ("exp3", {"gamma": 0.1, "reward_scale": "running_max"}),
]


@pytest.mark.parametrize("name, params", LEARNERS_GAUSSIAN, ids=lambda v: str(v))
def test_regret_far_below_random_gaussian(name, params):
    kw = {"means": GAUSSIAN_MEANS, "gaussian_std": GAUSSIAN_STD}
    random = mean_regret("random", {}, 10_000, seeds=[0, 1], **kw)
    regret = mean_regret(name, params, 10_000, seeds=[0, 1], **kw)
    assert regret < 0.25 * random, (name, params, regret, random)


def test_ucb_normalize_puts_bonus_on_reward_scale():
    # The same Gaussian bandit on a [0, 1]-like scale and x100 (like tokens/s). With normalize=True the
    # bonus scales with the rewards, so both are played identically; without it, they are not (at x100
    # the bonus is negligible and UCB1 is nearly greedy).
    def play(normalize: bool, scale: float):
        policy, rng, picks = UCB1(3, normalize=normalize), np.random.default_rng(5), []
        for _ in range(2000):
            arm = policy.select()
            picks.append(arm)
            policy.update(arm, scale * (BERNOULLI_MEANS[arm] + rng.normal(0.0, 0.3)))
        return policy, picks

    unit, unit_picks = play(True, 1.0)
    big, big_picks = play(True, 100.0)
    assert unit_picks == big_picks
    assert big._scale() == pytest.approx(100 * unit._scale())
    assert play(False, 1.0)[1] != play(False, 100.0)[1]


def test_ucb1_regret_grows_logarithmically():
    seeds = [0, 1, 2, 3]
    ucb = [simulate(UCB1(3), BERNOULLI_MEANS, 10_000, s)[0].cumsum() for s in seeds]
    rnd = [simulate(RandomPolicy(3, seed=s), BERNOULLI_MEANS, 10_000, s)[0].cumsum() for s in seeds]
    ucb_ratio = np.mean([c[-1] for c in ucb]) / np.mean([c[999] for c in ucb])
    rnd_ratio = np.mean([c[-1] for c in rnd]) / np.mean([c[999] for c in rnd])
    assert rnd_ratio > 8.0  # linear
    assert ucb_ratio < 2.5  # ln(10000)/ln(1000) = 1.33
    # every arm keeps being explored (count of the worst arm still grows, like ln t)
    policy = UCB1(3)
    simulate(policy, BERNOULLI_MEANS, 10_000, 0)
    assert 10 < policy.counts[0] < 0.02 * 10_000


def test_ucb1_plays_each_arm_once_first_then_argmax_of_index():
    policy = UCB1(4, c=0.5)
    first = []
    for reward in (0.1, 0.9, 0.4, 0.2):
        arm = policy.select()
        first.append(arm)
        policy.update(arm, reward)
    assert first == [0, 1, 2, 3]
    for arm, reward in [(1, 0.8), (2, 0.5), (1, 0.7)]:
        policy.update(arm, reward)
    t = policy.counts.sum()
    index = policy.sums / policy.counts + 0.5 * np.sqrt(2 * np.log(t) / policy.counts)
    assert policy.select() == int(np.argmax(index))


# --------------------------------------------------------------------------------------------------
# non-stationary rewards
# --------------------------------------------------------------------------------------------------

def test_discounted_and_sliding_window_ucb_recover_after_change_point():
    # the best arm swaps at t = 5,000: arm 0 (0.9 -> 0.4) was played almost always, arm 1 (0.1 -> 0.6)
    # rarely, so UCB1's stale mean of arm 0 keeps it on the wrong arm for thousands of rounds.
    before, after, change, rounds, seeds = [0.9, 0.1], [0.4, 0.6], 5_000, 10_000, [0, 1, 2]

    def halves(make):
        runs = [simulate(make(s), before, rounds, s, means_after=after, change_at=change)[0] for s in seeds]
        return np.mean([r[:change].sum() for r in runs]), np.mean([r[change:].sum() for r in runs])

    ucb_first, ucb_second = halves(lambda s: UCB1(2))
    assert ucb_second > 3 * ucb_first  # the premise: UCB1 suffers after the change
    for make in (lambda s: DiscountedUCB(2, gamma=0.999), lambda s: SlidingWindowUCB(2, window=1000)):
        _, second = halves(make)
        assert second < 0.5 * ucb_second, (make(0).name, second, ucb_second)


def test_sliding_window_counts_only_the_window():
    policy = SlidingWindowUCB(3, window=10)
    for t in range(25):
        policy.update(t % 3, float(t))
    assert len(policy.history) == 10 and policy.counts.sum() == 10
    last = [(t % 3, float(t)) for t in range(15, 25)]
    for arm in range(3):
        assert policy.counts[arm] == sum(1 for a, _ in last if a == arm)
        assert policy.sums[arm] == pytest.approx(sum(r for a, r in last if a == arm))


def test_discounted_ucb_discounts():
    policy = DiscountedUCB(2, gamma=0.5)
    policy.update(0, 1.0)
    policy.update(1, 0.0)
    policy.update(1, 0.0)
    assert policy.counts.tolist() == pytest.approx([0.25, 1.5])
    assert policy.sums.tolist() == pytest.approx([0.25, 0.0])
    assert policy.total == pytest.approx(1.75)


# --------------------------------------------------------------------------------------------------
# sequential halving
# --------------------------------------------------------------------------------------------------

def test_sequential_halving_identifies_best_arm_with_few_switches():
    means = [0.45, 0.1, 0.55, 0.75, 0.2, 0.5, 0.3, 0.4]  # best arm 3, not first or last
    k, budget, rounds = len(means), 4_000, 6_000
    for seed in range(4):
        policy = SequentialHalving(k, budget=budget)
        _, picks = simulate(policy, means, rounds, seed)
        switches = int(np.sum(picks[1:] != picks[:-1]))
        assert policy.best == 3
        assert np.all(picks[budget:] == 3)  # exploration fits in the budget, then the best arm only
        assert switches <= 2 * k + math.ceil(math.log2(k))  # <= K log2 K as well
        assert len(set(picks[:budget].tolist())) == k  # every arm was tried
    # a fresh episode after reset explores again
    policy.reset()
    assert policy.best == -1 and policy.select() == 0


def test_sequential_halving_schedule_is_contiguous_and_continues_with_last_arm():
    # K = 4, T = 16: L = 2 phases; phase 1 plays each arm 16 // (4 * 2) = 2 times in a row, keeps arms 0
    # and 3; phase 2 (16 // (2 * 2) = 4 plays each) starts with arm 3, the arm already running.
    rewards = {0: 1.0, 1: 0.0, 2: 0.1, 3: 0.5}
    policy = SequentialHalving(4, budget=16)
    picks = []
    for _ in range(20):
        arm = policy.select()
        picks.append(arm)
        policy.update(arm, rewards[arm])
    assert picks == [0, 0, 1, 1, 2, 2, 3, 3] + [3, 3, 3, 3, 0, 0, 0, 0] + [0] * 4
    assert policy.best == 0 and policy.phase == 2


def test_sequential_halving_small_budget_and_single_arm():
    policy = SequentialHalving(5, budget=3)  # budget < K * ceil(log2 K): every survivor once per phase
    _, picks = simulate(policy, [0.1, 0.2, 0.3, 0.4, 0.5], 50, 0)
    assert policy.best >= 0 and np.all(picks[10:] == policy.best)
    single = SequentialHalving(1, budget=10)
    assert single.select() == 0


# --------------------------------------------------------------------------------------------------
# contextual: LinUCB
# --------------------------------------------------------------------------------------------------

def test_linucb_beats_every_fixed_arm_when_best_arm_depends_on_context():
    categories = ["chat", "code", "math"]
    rng = np.random.default_rng(123)
    contexts, cats = [], []
    for _ in range(4_000):
        c = int(rng.integers(3))
        prompt = rng.integers(0, 50, size=int(rng.integers(5, 400)))
        contexts.append(request_features(prompt, categories[c], categories))
        cats.append(c)
    means = np.full((3, 3), 0.3)
    np.fill_diagonal(means, 0.8)  # arm j is the specialist for category j

    policy = LinUCB(3, alpha=1.0)
    reward_rng = np.random.default_rng(7)
    got = 0.0
    for x, c in zip(contexts, cats):
        arm = policy.select(x)
        got += means[c, arm]  # expected reward, i.e. pseudo-reward
        policy.update(arm, float(reward_rng.random() < means[c, arm]), x)
    fixed = [sum(means[c, arm] for c in cats) for arm in range(3)]
    optimal = sum(means[c].max() for c in cats)
    assert got > max(fixed) + 0.5 * (optimal - max(fixed)), (got, fixed, optimal)
    assert policy.d == n_features(categories)


def test_linucb_context_handling():
    policy = LinUCB(3, alpha=0.5)
    assert policy.select(None) == 0  # bias-only context, d inferred as 1
    policy.update(0, 1.0, None)
    assert policy.d == 1
    with pytest.raises(ValueError, match="expected d=1"):
        policy.select([1.0, 0.0])
    wide = LinUCB(2, d=4)
    wide.update(1, 0.5, None)  # None -> [1, 0, 0, 0]
    assert wide.b[1].tolist() == [0.5, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="linucb"):
        wide.select([1.0, math.nan, 0.0, 0.0])


def test_linucb_sherman_morrison_matches_direct_solution():
    rng = np.random.default_rng(0)
    policy = LinUCB(2, d=3, reg=2.0)
    xs = rng.normal(size=(50, 3))
    rs = rng.normal(size=50)
    for x, r in zip(xs, rs):
        policy.update(0, r, x)
    a = 2.0 * np.eye(3) + xs.T @ xs
    np.testing.assert_allclose(policy.A_inv[0], np.linalg.inv(a), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(policy.theta[0], np.linalg.solve(a, xs.T @ rs), rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# state round-trip, determinism
# --------------------------------------------------------------------------------------------------

ROUNDTRIP = [
    ("ucb", {"normalize": True}),
    ("discounted_ucb", {"gamma": 0.95}),
    ("sliding_window_ucb", {"window": 50}),
    ("thompson", {"likelihood": "bernoulli"}),
    ("thompson", {"likelihood": "gaussian"}),
    ("exp3", {"reward_scale": "running_max"}),
    ("epsilon_greedy", {"epsilon": 0.3, "decay": 0.01}),
    ("sequential_halving", {"budget": 400}),
    ("linucb", {}),
    ("fixed", {"arm": 2}),
    ("round_robin", {}),
    ("random", {}),
]


@pytest.mark.parametrize("name, params", ROUNDTRIP, ids=lambda v: str(v))
def test_state_roundtrips_through_json_and_continues_identically(name, params):
    k, first, second = 4, 300, 300
    rng = np.random.default_rng(99)
    rewards = (rng.random((first + second, k)) < np.array([0.2, 0.4, 0.6, 0.5])).astype(float)
    contexts = np.concatenate([np.ones((first + second, 1)), rng.random((first + second, 2))], axis=1)
    ctx = (lambda t: contexts[t]) if name == "linucb" else (lambda t: None)

    def play(policy, start, stop):
        out = []
        for t in range(start, stop):
            arm = policy.select(ctx(t))
            policy.update(arm, rewards[t, arm], ctx(t))
            out.append(arm)
        return out

    original = make_policy(name, k, seed=1, **params)
    play(original, 0, first)
    blob = json.dumps(original.state_dict())
    restored = make_policy(name, k, seed=2, **params)  # another seed: the RNG state must come from the blob
    restored.load_state_dict(json.loads(blob))
    assert json.dumps(restored.state_dict()) == blob
    assert play(restored, first, first + second) == play(original, first, first + second)
    assert json.dumps(restored.state_dict()) == json.dumps(original.state_dict())


def test_load_state_dict_rejects_other_arm_count_and_missing_keys():
    state = UCB1(3).state_dict()
    with pytest.raises(ValueError, match="n_arms"):
        UCB1(4).load_state_dict(state)
    del state["sums"]
    with pytest.raises(KeyError, match="sums"):
        UCB1(3).load_state_dict(state)


@pytest.mark.parametrize("name, params", [
    ("random", {}), ("thompson", {}), ("exp3", {}), ("epsilon_greedy", {"epsilon": 0.5}),
])
def test_seed_reproduces_and_differs(name, params):
    def picks(seed):
        return simulate(make_policy(name, 5, seed=seed, **params), [0.5] * 5, 300, 0)[1].tolist()

    assert picks(11) == picks(11)
    assert picks(11) != picks(12)


def test_reset_forgets():
    for name, params in ROUNDTRIP:
        policy = make_policy(name, 3, seed=0, **params)
        fresh = {k: v for k, v in policy.state_dict().items() if k != "rng_state"}
        simulate(policy, [0.2, 0.5, 0.8], 100, 0)
        policy.reset()
        after = {k: v for k, v in policy.state_dict().items() if k != "rng_state"}
        assert after == fresh, name


# --------------------------------------------------------------------------------------------------
# baselines
# --------------------------------------------------------------------------------------------------

def test_baselines():
    fixed = Fixed(3, arm=2)
    _, picks = simulate(fixed, BERNOULLI_MEANS, 20, 0)
    assert set(picks.tolist()) == {2}
    _, picks = simulate(RoundRobin(3), BERNOULLI_MEANS, 9, 0)
    assert picks.tolist() == [0, 1, 2] * 3
    _, picks = simulate(RandomPolicy(3, seed=0), BERNOULLI_MEANS, 3000, 0)
    counts = np.bincount(picks, minlength=3)
    assert np.all(np.abs(counts - 1000) < 150)


def test_epsilon_greedy_decay_schedule():
    policy = EpsilonGreedy(2, epsilon=0.5, decay=0.1)
    assert policy.current_epsilon() == 0.5
    for _ in range(10):
        policy.update(0, 1.0)
    assert policy.current_epsilon() == pytest.approx(0.25)
    greedy = EpsilonGreedy(2, seed=0, epsilon=0.0)
    greedy.update(0, 0.2)
    greedy.update(1, 0.9)
    assert {greedy.select() for _ in range(50)} == {1}


# --------------------------------------------------------------------------------------------------
# features
# --------------------------------------------------------------------------------------------------

def test_request_features_layout():
    categories = ["chat", "code", "math"]
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # 7 trigrams, 3 distinct -> 4/7 seen earlier
    x = request_features(prompt, "code", categories)
    assert x.shape == (n_features(categories),) == (6,)
    assert x[0] == 1.0
    assert x[1] == pytest.approx(math.log1p(9) / 10)
    assert x[2] == pytest.approx(4 / 7)
    assert x[3:].tolist() == [0.0, 1.0, 0.0]
    assert request_features(prompt, None, categories)[3:].tolist() == [0.0, 0.0, 0.0]
    assert request_features(prompt, "poetry", categories)[3:].tolist() == [0.0, 0.0, 0.0]
    empty = request_features(np.array([], dtype=np.int64), None, [])
    assert empty.tolist() == [1.0, 0.0, 0.0]


def test_ngram_self_overlap_matches_definition():
    rng = np.random.default_rng(0)
    for _ in range(100):
        ids = rng.integers(0, 4, size=int(rng.integers(0, 40)))
        grams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
        expected = sum(g in set(grams[:i]) for i, g in enumerate(grams)) / len(grams) if grams else 0.0
        assert ngram_self_overlap(ids) == pytest.approx(expected)
        assert ngram_self_overlap(ids + (1 << 40)) == pytest.approx(expected)  # large ids take the slow path
    assert ngram_self_overlap(list(range(100))) == 0.0


# --------------------------------------------------------------------------------------------------
# cost
# --------------------------------------------------------------------------------------------------

TIMED = [
    ("ucb", {}), ("discounted_ucb", {}), ("sliding_window_ucb", {}), ("thompson", {}),
    ("thompson", {"likelihood": "gaussian"}), ("exp3", {}), ("epsilon_greedy", {}),
    ("sequential_halving", {}), ("linucb", {}), ("fixed", {}), ("round_robin", {}), ("random", {}),
]


@pytest.mark.parametrize("name, params", TIMED, ids=lambda v: str(v))
def test_select_update_cost_per_round(name, params):
    k, rounds = 10, 3000
    policy = make_policy(name, k, seed=0, **params)
    rewards = np.random.default_rng(0).random((rounds, k)).tolist()
    context = request_features(list(range(100)), "code", ["chat", "code", "math", "other"]) \
        if name == "linucb" else None
    start = time.perf_counter()
    for t in range(rounds):
        arm = policy.select(context)
        policy.update(arm, rewards[t][arm], context)
    per_round = (time.perf_counter() - start) / rounds
    assert per_round < 1e-3, f"{name}: {per_round * 1e6:.1f} us per select+update"


def test_every_policy_class_documents_its_parameters():
    for name in EXPECTED_NAMES:
        cls = POLICIES[name]
        for param in policy_params(cls):
            assert param in cls.__doc__, f"{cls.__name__} docstring does not mention {param!r}"
        assert set(inspect.signature(cls.__init__).parameters) >= {"n_arms", "seed"}
