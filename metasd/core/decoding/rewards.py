"""Rewards a policy learns from, computed from what a step already measured (docs/algorithms.md#rewards).

A reward is one object with two values: ``step(feedback)`` scores one step (per-step policies learn from it)
and ``request(stats, step_rewards)`` scores a whole request (per-request policies, ``granularity: request``).
``bounded`` rewards lie in [0, 1], which some policies (Beta-Bernoulli Thompson sampling, EXP3) need.
"""
from __future__ import annotations

from typing import ClassVar, Literal, Sequence, get_args

from ..execution.staging import to_device
from .drafter import Counterfactual, StepFeedback
from .metrics import RequestStats
from .sampling import fit_vocab


class Reward:
    """A reward: a value per step, a value per request (default: the mean of its step values) and, where the reward
    can be had from a ``Counterfactual`` (what an arm that was not chosen would have accepted and cost), its value for
    that arm (full-information feedback)."""

    name: ClassVar[str] = ""
    bounded: ClassVar[bool] = False  # every value in [0, 1]
    #: whether ``counterfactual`` gives values (a reward that needs the arm's own distributions or its wall time
    #: cannot be had without running it)
    counterfactual_values: ClassVar[bool] = False

    def step(self, o: StepFeedback) -> float:
        raise NotImplementedError

    def counterfactual(self, c: Counterfactual, cost: float) -> float | None:
        """The value for an arm that would have had ``c`` accepted at modeled ``cost``; None when not available."""
        return None

    def request(self, stats: RequestStats, step_rewards: Sequence[float]) -> float:
        return sum(step_rewards) / len(step_rewards) if step_rewards else 0.0

    def __repr__(self) -> str:
        return f"Reward({self.name!r})"


class BlockEfficiency(Reward):
    """r_BE = n_acc / k (k = draft depth; 0 for an empty draft). In [0, 1]."""

    name, bounded, counterfactual_values = "block_efficiency", True, True

    def step(self, o: StepFeedback) -> float:
        k = o.draft.depth
        return o.n_accepted / k if k else 0.0

    def counterfactual(self, c: Counterfactual, cost: float) -> float | None:
        return min(c.n_accepted / c.depth, 1.0) if c.depth else 0.0


class BlockDivergence(Reward):
    """r_BD = (1/n) sum_j (1 - TV(p_j, q_j)) over drafted nodes. In [0, 1].

    Drafts without probabilities (n-gram, greedy argmax) count q as one-hot on the drafted token, so
    1 - TV = p_j(x_j); under greedy p is one-hot too and the term is 1 when the draft token is the argmax.
    """

    name, bounded = "block_divergence", True

    def step(self, o: StepFeedback) -> float:
        n = len(o.draft)
        if n == 0:
            return 0.0
        device = (o.target_probs if o.target_probs is not None else o.target_argmax).device
        rows = to_device(o.draft.parents, device) + 1  # [n] the verifier row scoring each node
        tokens = to_device(o.draft.tokens, device)  # [n]
        q = None if o.draft.probs is None else o.draft.probs.to(device).float()  # [n, vocab]
        if o.target_probs is None:  # greedy: p is one-hot on the argmax, TV(onehot(a), q) = 1 - q(a)
            target = o.target_argmax[rows]  # [n]
            if q is None:
                return float((target == tokens).float().mean())
            return float(q.gather(1, target[:, None]).mean())
        p = o.target_probs[rows].float()  # [n, vocab]
        if q is None:
            return float(p.gather(1, tokens[:, None]).mean())
        tv = 0.5 * (p - fit_vocab(q, p.shape[-1])).abs().sum(-1)  # [n]
        return float((1 - tv).mean())


class Throughput(Reward):
    """Committed tokens per modeled cost (drafting, catch-up and verification, in verifier decode steps: plain
    decoding scores 1). Unbounded; deterministic - no clock is read (``metasd.core.pricing.cost``). A request's value is
    its tokens over its whole modeled cost."""

    name, counterfactual_values = "throughput", True

    def step(self, o: StepFeedback) -> float:
        return len(o.committed) / o.cost if o.cost > 0 else 0.0

    def counterfactual(self, c: Counterfactual, cost: float) -> float | None:
        return (c.n_accepted + 1) / cost if cost > 0 else 0.0

    def request(self, stats: RequestStats, step_rewards: Sequence[float]) -> float:
        return sum(stats.tokens_per_step) / stats.modeled_cost if stats.modeled_cost > 0 else 0.0  # the steps' tokens


class WallThroughput(Reward):
    """Committed tokens per wall-clock second. Unbounded; carries the machine's timing noise into the policy, so a
    multi-drafter pool's choices (and bf16 near-ties) differ from run to run. A request's value is its tokens over
    its drafting and verification seconds."""

    name = "wall_throughput"
    reads_clock = True  # its seconds must time the device's work: the engine's step clock synchronises

    def step(self, o: StepFeedback) -> float:
        return len(o.committed) / o.seconds if o.seconds > 0 else 0.0

    def request(self, stats: RequestStats, step_rewards: Sequence[float]) -> float:
        busy = stats.draft_s + stats.verify_s
        return sum(stats.tokens_per_step) / busy if busy > 0 else 0.0


REWARDS: dict[str, Reward] = {r.name: r for r in (Throughput(), WallThroughput(), BlockEfficiency(), BlockDivergence())}
BOUNDED_REWARDS = {name for name, r in REWARDS.items() if r.bounded}  # in [0, 1]
#: the reward names pool files, experiment files and the CLI accept: the one list of them
RewardName = Literal["throughput", "wall_throughput", "block_efficiency", "block_divergence"]
assert set(get_args(RewardName)) == set(REWARDS), "RewardName and REWARDS must list the same rewards"


def get_reward(name: str) -> Reward:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}") from None
