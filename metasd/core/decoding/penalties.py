"""Presence, frequency and repetition penalties, applied exactly along each draft node's own path
(docs/algorithms.md#lossless-acceptance).

A penalty makes the verifier's distribution at a position depend on the tokens before it: row r of a draft's logits
(the root, or a node) is penalised with the counts of the committed tokens plus the draft tokens on the path from the
root to that node - the tokens plain decoding would have committed before it had the path been accepted. Acceptance
then compares each node with exactly the distribution plain decoding with the same penalties would have sampled, so
the output is plain penalised decoding's (greedy: token for token; sampling: in distribution).

The formulas are vLLM's (and OpenAI's for the first two), applied in this order to the raw logits, before temperature,
top-k and top-p:
  repetition r: a token seen in the prompt or the output has its logit divided by r when positive, multiplied by r
                when not (r > 1 discourages repeats);
  frequency f:  logit -= f * (times the token occurs in the output);
  presence p:   logit -= p * (1 if it occurs in the output at all).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import _is_real


@dataclass(frozen=True)
class Penalties:
    """A request's penalties (the defaults are off). ``ValueError`` naming the field for a value out of range:
    presence and frequency in [-2, 2] (OpenAI's range), repetition > 0 (1 = off)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self):
        for name, value, ok, allowed in (
                ("presence_penalty", self.presence, lambda v: -2 <= v <= 2, "in [-2, 2]"),
                ("frequency_penalty", self.frequency, lambda v: -2 <= v <= 2, "in [-2, 2]"),
                ("repetition_penalty", self.repetition, lambda v: v > 0, "> 0 (1 = off)")):
            if not _is_real(value) or not ok(value):
                raise ValueError(f"{name} must be {allowed}, got {value!r}")

    @property
    def off(self) -> bool:
        return self.presence == 0 and self.frequency == 0 and self.repetition == 1


class PathPenalizer:
    """One request's penalties: the counts of what it committed, and each row of the verifier's logits penalised along
    its path."""

    def __init__(self, penalties: Penalties, prompt_ids: Sequence[int]):
        self.penalties = penalties
        self.prompt_ids = list(prompt_ids)
        self.counts: torch.Tensor | None = None  # [vocab] float32: occurrences of each token in the output
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (repetition)
        self._pending: list[int] = []  # committed before the vocabulary and device were known (the first ``apply``)

    def _start(self, vocab: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
        pending, self._pending = self._pending, []
        self.commit(pending)

    def commit(self, tokens: Sequence[int]) -> None:
        """Count the tokens a step committed."""
        if self.counts is None:
            self._pending += [int(t) for t in tokens]
            return
        if tokens:
            ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(ids), device=self.counts.device))
            self.seen[ids] = True

    def apply(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """The penalised logits of every row (a new float32 tensor; ``logits`` is unchanged).

        logits: [rows, vocab] the verifier's raw logits, row r after the committed tokens then ``paths[r]`` (a
        draft's rows: ``Draft.paths``)."""
        vocab, device = logits.shape[-1], logits.device
        if self.counts is None:
            self._start(vocab, device)
        counts = self.counts.expand(len(paths), vocab)  # [rows, vocab]
        drafted = [(r, t) for r, path in enumerate(paths) for t in path]
        if drafted:  # each row's counts: the committed ones plus its path's tokens
            rows, ids = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*drafted))
            counts = counts.clone().index_put_((rows, ids), torch.ones(len(drafted), device=device), accumulate=True)
        p, out = self.penalties, logits.float().clone()
        if p.repetition != 1:
            seen = self.seen | (counts > 0)  # [rows, vocab]
            out = torch.where(seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out)
        if p.frequency:
            out -= p.frequency * counts
        if p.presence:
            out -= p.presence * (counts > 0).float()
        return out
