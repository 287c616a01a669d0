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

from ..execution.tree import Draft
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
    """One request's penalties: the counts of what it committed, and each draft row penalised along its path."""

    def __init__(self, penalties: Penalties, prompt_ids: Sequence[int], device: torch.device | str):
        self.penalties = penalties
        self.device = torch.device(device)
        self.prompt_ids = list(prompt_ids)
        self.counts: torch.Tensor | None = None  # [vocab] float32: occurrences of each token in the output
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output (repetition)
        self._pending: list[int] = []  # committed before the vocabulary was known (the first ``apply``)

    def _start(self, vocab: int) -> None:
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        self.seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=self.device)] = True
        pending, self._pending = self._pending, []
        self.commit(pending)

    def commit(self, tokens: Sequence[int]) -> None:
        """Count the tokens a step committed."""
        if self.counts is None:
            self._pending += list(tokens)
            return
        if tokens:
            ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
            self.counts.index_add_(0, ids, torch.ones(len(ids), device=self.device))
            self.seen[ids] = True

    def apply(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """The penalised logits of every row of a draft (a new float32 tensor; ``logits`` is unchanged).

        logits: [n+1, vocab] the verifier's raw logits: row 0 after the pending token, row i+1 after node i."""
        vocab = logits.shape[-1]
        if self.counts is None:
            self._start(vocab)
        counts = self.counts.expand(len(draft) + 1, vocab)  # [n+1, vocab]
        if len(draft):
            on_path = draft.layout.mask[:, 1:].to(self.device, torch.float32)  # [n+1, n]: node j on row r's path
            tokens = torch.nn.functional.one_hot(draft.tokens.to(self.device), vocab).float()  # [n, vocab]
            counts = counts + on_path @ tokens
        p, out = self.penalties, logits.float().clone()
        if p.repetition != 1:
            seen = self.seen | (counts > 0)  # [n+1, vocab]
            out = torch.where(seen, torch.where(out > 0, out / p.repetition, out * p.repetition), out)
        if p.frequency:
            out -= p.frequency * counts
        if p.presence:
            out -= p.presence * (counts > 0).float()
        return out
