"""A reduced draft vocabulary: the N most frequent tokens of a training corpus (EAGLE-3 / FR-Spec).

One-shot and head drafters score many positions with the verifier's LM head; on CPU that head
(vocab x d) dominates their cost. Drafting over the N most frequent tokens cuts it by vocab/N.
Verification is unchanged (the verifier scores the full vocabulary), so output stays exact; a draft
simply cannot propose a token outside the reduced set.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from metasd.core.execution.staging import to_device


class DraftVocab:
    """Maps reduced indices 0..N-1 to full-vocabulary token ids (most frequent first)."""

    def __init__(self, token_ids: torch.Tensor, full_size: int):
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long)  # [N]
        self.full_size = int(full_size)
        if len(self.token_ids) and int(self.token_ids.max()) >= self.full_size:
            raise ValueError(f"DraftVocab: token id {int(self.token_ids.max())} >= vocabulary size {self.full_size}")
        if len(torch.unique(self.token_ids)) != len(self.token_ids):
            raise ValueError("DraftVocab: repeated token ids")
        self._to_reduced: torch.Tensor | None = None
        self._on_device: dict[tuple[str, torch.device], torch.Tensor] = {}  # copies made for devices, by table

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> "DraftVocab":
        """Top ``size`` tokens by ``counts`` [vocab]; ``always`` (e.g. EOS) are included first."""
        counts = counts.clone().double()
        for t in always:
            counts[t] = float("inf")
        size = min(size, len(counts))
        return cls(torch.topk(counts, size).indices, len(counts))

    @classmethod
    def full(cls, vocab_size: int) -> "DraftVocab":
        return cls(torch.arange(vocab_size), vocab_size)

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """``token_ids`` on ``device``, copied there once (staged: no synchronisation) and kept."""
        return self._table_on("token_ids", self.token_ids, device)

    def _table_on(self, name: str, table: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = to_device(table, device)
        return self._on_device[key]

    def to_full(self, reduced: torch.Tensor) -> torch.Tensor:
        """Reduced indices (any shape) -> full token ids."""
        return self.ids_on(reduced.device)[reduced]

    def to_reduced(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Full token ids -> reduced indices, -1 where a token is outside the reduced vocabulary."""
        if self._to_reduced is None:
            table = torch.full((self.full_size,), -1, dtype=torch.long)
            table[self.token_ids] = torch.arange(len(self.token_ids))
            self._to_reduced = table
        return self._table_on("to_reduced", self._to_reduced, full_ids.device)[full_ids]

    def head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Rows of a full LM-head weight [vocab, d] for the reduced vocabulary -> [N, d] (a copy)."""
        return lm_head_weight.index_select(0, self.token_ids.to(lm_head_weight.device)).contiguous()

    def coverage(self, counts: torch.Tensor) -> float:
        """Fraction of the counted tokens inside the reduced vocabulary."""
        counts = counts.double()
        return float(counts[self.token_ids].sum() / counts.sum())

    def save(self, path: str | Path) -> None:
        """Token ids as int32 (half of int64's bytes; vocabularies stay far below 2^31), read back as int64."""
        save_file({"token_ids": self.token_ids.to(torch.int32).contiguous(), "full_size": torch.tensor([self.full_size])},
                  str(path))

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        d = load_file(str(path))
        return cls(d["token_ids"].long(), int(d["full_size"][0]))
