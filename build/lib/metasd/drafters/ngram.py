"""Prompt lookup: draft the continuation of the latest earlier occurrence of the current suffix."""
from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, model_validator

from metasd.core.decoding.drafter import (Bool, Counterfactual, Drafter, DrafterParams, Int, StepContext, StepFeedback,
                                          check_params, counterfactual_of, register_drafter)
from metasd.core.execution.tree import Draft


def _longest_suffix_hits(tokens: torch.Tensor, n_min: int, n_max: int) -> tuple[int, torch.Tensor]:
    """(n, hits) for the largest n in n_min..n_max whose suffix n-gram of ``tokens`` [T] occurred earlier with a token
    after it: hits [h] are the start positions of those earlier occurrences. (0, empty) when none does."""
    T = len(tokens)
    for n in range(min(n_max, T - 1), n_min - 1, -1):
        windows = tokens[: T - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram that has a continuation
        hits = (windows == tokens[T - n:]).all(dim=1).nonzero().squeeze(-1)
        if len(hits):
            return n, hits
    return 0, tokens[:0]


def longest_suffix_match(tokens: torch.Tensor, n_min: int, n_max: int) -> int:
    """The largest n in n_min..n_max whose suffix n-gram of ``tokens`` [T] occurred earlier with a token after it;
    0 when none does."""
    return _longest_suffix_hits(tokens, n_min, n_max)[0]


def lookup(tokens: torch.Tensor, n_min: int, n_max: int, k: int, latest: bool = True) -> torch.Tensor:
    """Continuation (up to k tokens) of an earlier occurrence of the longest matching suffix n-gram.

    tokens: [T] int64. Tries n = n_max .. n_min; returns [<=k] int64 (empty when nothing matches).
    """
    n, hits = _longest_suffix_hits(tokens, n_min, n_max)
    if not n:
        return tokens[:0]
    start = int(hits[-1] if latest else hits[0]) + n
    return tokens[start:start + k]


class NGramParams(DrafterParams):
    """Pool-config ``params`` of the n-gram drafter."""

    k: Int = Field(10, ge=1, description="draft tokens per step")
    n_min: Int = Field(1, ge=1, description="shortest suffix n-gram tried")
    n_max: Int = Field(3, ge=1, description="longest suffix n-gram tried (>= n_min)")
    latest: Bool = Field(True, description="continue the most recent earlier match (else the first)")

    @model_validator(mode="after")
    def _order(self) -> "NGramParams":
        if self.n_min > self.n_max:
            raise ValueError(f"need n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")
        return self


@register_drafter
class NGramDrafter(Drafter):
    """N-gram prompt lookup over prompt + generated tokens (no model, no probabilities).

    Drafts are verified by sample-and-match, exact under sampling too. ``latest`` picks the most recent
    earlier match (else the first one, as transformers' prompt lookup does).
    """

    kind = "ngram"
    model_field, checkpoint_field = "never", "never"
    lookup = True
    Params = NGramParams

    def __init__(self, k: int = 10, n_min: int = 1, n_max: int = 3, latest: bool = True, name: str | None = None):
        super().__init__(name)
        check_params(NGramParams, dict(k=k, n_min=n_min, n_max=n_max, latest=latest), self.name)
        self.k, self.n_min, self.n_max, self.latest = k, n_min, n_max, latest

    def propose(self, ctx: StepContext) -> Draft:
        depth = min(self.k, ctx.max_depth)
        if depth <= 0:
            return Draft.empty()
        return Draft.chain(lookup(ctx.tokens, self.n_min, self.n_max, depth, self.latest))

    def longest_match(self, tokens: torch.Tensor) -> int:
        return longest_suffix_match(tokens, self.n_min, self.n_max)

    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual:
        """Lookup costs no model: propose for the step's context and follow the committed tokens through the draft."""
        return counterfactual_of(self.propose(ctx), feedback)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "k": self.k, "n_min": self.n_min, "n_max": self.n_max, "latest": self.latest}
