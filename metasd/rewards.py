"""Rewards a policy learns from, computed from what one step already measured (docs/algorithms.md#rewards)."""
from __future__ import annotations

from typing import Callable, Literal, get_args

from .drafter import StepFeedback


def block_efficiency(o: StepFeedback) -> float:
    """r_BE = n_acc / k (k = draft depth; 0 for an empty draft). In [0, 1]."""
    k = o.draft.depth
    return o.n_accepted / k if k else 0.0


def block_divergence(o: StepFeedback) -> float:
    """r_BD = (1/n) sum_j (1 - TV(p_j, q_j)) over drafted nodes. In [0, 1].

    Drafts without probabilities (n-gram, greedy argmax) count q as one-hot on the drafted token, so
    1 - TV = p_j(x_j); under greedy p is one-hot too and the term is 1 when the draft token is the argmax.
    """
    n = len(o.draft)
    if n == 0:
        return 0.0
    rows = o.draft.parents + 1  # the verifier row scoring each node
    if o.target_probs is None:  # greedy: p is one-hot on the argmax, TV(onehot(a), q) = 1 - q(a)
        target = o.target_argmax[rows]  # [n]
        if o.draft.probs is None:
            return float((target == o.draft.tokens).float().mean())
        return float(o.draft.probs.float().gather(1, target[:, None]).mean())
    p = o.target_probs[rows].float()
    if o.draft.probs is None:
        return float(p.gather(1, o.draft.tokens[:, None]).mean())
    tv = 0.5 * (p - o.draft.probs.float()).abs().sum(-1)
    return float((1 - tv).mean())


def throughput(o: StepFeedback) -> float:
    """Committed tokens per modeled cost of the step (drafting, catch-up and verification, in verifier
    decode steps: plain decoding scores 1). Unbounded; deterministic - no clock is read (metasd.cost)."""
    return len(o.committed) / o.cost if o.cost > 0 else 0.0


def wall_throughput(o: StepFeedback) -> float:
    """Committed tokens per wall-clock second of the step. Unbounded; carries the machine's timing noise
    into the policy, so a multi-drafter pool's choices (and bf16 near-ties) differ from run to run."""
    return len(o.committed) / o.seconds if o.seconds > 0 else 0.0


REWARDS: dict[str, Callable[[StepFeedback], float]] = {
    "block_efficiency": block_efficiency,
    "block_divergence": block_divergence,
    "throughput": throughput,
    "wall_throughput": wall_throughput,
}
BOUNDED_REWARDS = {"block_efficiency", "block_divergence"}  # in [0, 1]
#: the reward names pool files, experiment files and the CLI accept: the one list of them
RewardName = Literal["throughput", "wall_throughput", "block_efficiency", "block_divergence"]
assert set(get_args(RewardName)) == set(REWARDS), "RewardName and REWARDS must list the same rewards"


def get_reward(name: str) -> Callable[[StepFeedback], float]:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARDS)}") from None
