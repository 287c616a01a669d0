"""Per-request statistics (vLLM's per-request spec-decode schema, plus wall-clock breakdown).

Words (docs/algorithms.md#steps-and-metrics): a *step* is one draft + one verifier forward + commit; ``n_acc`` are
accepted draft tokens (bonus excluded); *tokens per step* ``tau = n_acc + 1`` includes the bonus, so plain
decoding scores 1.00 ("mean acceptance length" in the vLLM / Spec-Bench convention).
"""
from __future__ import annotations

import numbers
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..execution.logprobs import TokenLogprob


@dataclass
class RequestStats:
    """Counters and timings of one request: what ``metasd generate --json``, ``metasd bench`` (its
    ``requests.jsonl`` and MLflow metrics) and the benchmarks report, through ``to_record()``. A transformers
    baseline fills the counters it has (tokens, steps = forwards, wall time) and leaves the rest empty."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt positions reused from the prefix cache instead of prefilled
    new_tokens: int = 0
    #: the first new token where the prefill drew it (from its logits after the whole prompt, before any step): 1, else
    #: 0 (a backend that leaves the prompt's last token pending for the first step). Steps count the forwards after it
    prefill_committed: int = 0
    steps: int = 0
    drafted: int = 0  # draft tokens scored by the verifier (tree nodes for trees)
    accepted: int = 0  # accepted draft tokens, bonus excluded
    tokens_per_step: list[int] = field(default_factory=list)  # tau of each step (bonus included)
    position_drafted: list[int] = field(default_factory=list)  # [depth] steps whose draft reached this depth
    position_accepted: list[int] = field(default_factory=list)  # [depth] steps that accepted this depth
    drafter_per_step: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    catch_up_tokens: int = 0  # committed tokens drafters had to feed beyond the pending one (switching cost)
    modeled_cost: float = 0.0  # modeled cost of the steps in verifier decode steps (metasd.core.pricing.cost; plain = steps)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""
    policy_state: dict[str, Any] | None = None
    #: drafter name -> "steps" it drafted and its own figures summed over them (``Draft.meta``: numbers summed, a
    #: flag counted when true, any other value counted as "key=value"), e.g. {"tree": {"steps": 9, "drafter_forwards": 52}}
    drafter_counts: dict[str, dict[str, float]] = field(default_factory=dict)

    def drop_uncommitted(self, n: int) -> None:
        """The last step's last ``n`` committed tokens were cut (they came after the request's end): they leave its
        tokens per step and, as far as they were accepted draft tokens, the accepted count."""
        tau = self.tokens_per_step[-1]  # the step's accepted draft tokens, then its bonus token
        kept = tau - n
        self.accepted -= max(0, (tau - 1) - kept)  # accepted draft tokens among the kept: min(kept, tau - 1)
        self.tokens_per_step[-1] = kept

    def record_step(self, drafter: str, draft_depth: int, draft_nodes: int, n_accepted: int, committed: int,
                    meta: Mapping[str, Any] | None = None) -> None:
        counts = self.drafter_counts.setdefault(drafter, {})
        counts["steps"] = counts.get("steps", 0) + 1
        if meta:
            for key, value in meta.items():
                if isinstance(value, bool):
                    counts[key] = counts.get(key, 0) + int(value)
                elif isinstance(value, numbers.Real):
                    counts[key] = counts.get(key, 0) + value
                else:
                    counts[f"{key}={value}"] = counts.get(f"{key}={value}", 0) + 1
        self.steps += 1
        self.drafted += draft_nodes
        self.accepted += n_accepted
        self.tokens_per_step.append(committed)
        self.drafter_per_step.append(drafter)
        while len(self.position_drafted) < draft_depth:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(draft_depth):
            self.position_drafted[i] += 1
            if i < n_accepted:
                self.position_accepted[i] += 1

    # ---- derived figures -------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        """Tokens the prefill and the steps committed (bonus tokens included; may exceed ``new_tokens`` when an EOS
        or a stop string ends the request inside a step)."""
        return self.prefill_committed + sum(self.tokens_per_step)

    @property
    def mean_tokens_per_step(self) -> float:
        """Mean tau (bonus included; plain decoding = 1.00)."""
        return sum(self.tokens_per_step) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens (every node of a tree counts as drafted; 0.0 when nothing
        was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def acceptance_histogram(self) -> dict[int, int]:
        """Steps by accepted draft tokens n_acc."""
        return dict(sorted(Counter(t - 1 for t in self.tokens_per_step).items()))

    @property
    def selection_counts(self) -> dict[str, int]:
        return dict(Counter(self.drafter_per_step))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def modeled_speedup(self) -> float:
        """Committed tokens per modeled cost: the cost model's estimate of the speedup over plain decoding."""
        return sum(self.tokens_per_step) / self.modeled_cost if self.modeled_cost else 0.0

    @property
    def overhead_s(self) -> float:
        """Wall time outside drafter and verifier forwards (acceptance, bookkeeping, policy, detokenising)."""
        return max(self.wall_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    #: figures derived from the counters, in every record
    DERIVED = ("committed", "mean_tokens_per_step", "acceptance_rate", "per_position_acceptance", "acceptance_histogram",
               "selection_counts", "tokens_per_second", "modeled_speedup", "overhead_s")

    def to_record(self) -> dict[str, Any]:
        """Every counter and derived figure as JSON-serialisable values: the one per-request record. The acceptance
        rate is None when nothing was drafted (plain decoding, a transformers baseline)."""
        record = {f.name: _plain(getattr(self, f.name)) for f in fields(self)}
        record.update({name: _plain(getattr(self, name)) for name in self.DERIVED})
        if not self.drafted:
            record["acceptance_rate"] = None
        return record

    def summary(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_second:.2f} tok/s), "
            f"{self.steps} steps, mean tokens/step {self.mean_tokens_per_step:.2f} (bonus included), "
            f"acceptance rate {self.acceptance_rate:.2f} (accepted / drafted tokens, every tree node counted), "
            f"drafters {self.selection_counts}"
        )


def _plain(value: Any) -> Any:
    """``value`` as JSON-serialisable data (dict keys as strings, tuples as lists)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class GenerationResult:
    """Output of one request: the new text and tokens, and how they were produced."""

    text: str
    token_ids: list[int]  # new tokens only (EOS included when generation stopped on it)
    prompt_ids: list[int]
    stats: RequestStats
    extra: dict[str, Any] = field(default_factory=dict)
    #: with ``logprobs``: one per new token, the verifier's raw log-probability (``metasd.core.decoding.logprobs``)
    logprobs: list[TokenLogprob] | None = None
    #: with ``prompt_logprobs``: one per prompt token (None for the first, which nothing predicts)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_record(self) -> dict[str, Any]:
        """The request's record (``RequestStats.to_record``) with its text and token ids."""
        return {**self.stats.to_record(), "text": self.text, "token_ids": list(self.token_ids)}


@dataclass
class StepRecord:
    """What one step of a request did (``Request.last_step``): the drafter, its draft's nodes and depth as verified,
    the accepted draft tokens (a root-to-node path: positions 1..accepted of the draft) and the committed tokens."""

    drafter: str
    drafted: int
    depth: int
    accepted: int
    committed: int
    path: tuple[int, ...] = ()  # the accepted node indices, root to leaf
    #: the draft was cut below its node budget by the request itself (its remaining tokens, its own draft_budget): it
    #: says nothing of what the budget buys, so shared acceptance curves do not learn from it
    cut: bool = False

    @property
    def accepted_per_position(self) -> list[bool]:
        """Per draft depth 1..depth: whether the step accepted a token there."""
        return [i < self.accepted for i in range(self.depth)]
