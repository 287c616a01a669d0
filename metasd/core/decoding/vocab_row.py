"""``VocabRow``: a request's per-token values over the whole vocabulary - a mask of allowed or banned ids, a logit
bias - the same at every position, so built once (per vocabulary width and device) and applied to every row."""
from __future__ import annotations

from typing import Mapping

import torch


class VocabRow:
    """``values`` at their token ids and ``fill`` at every other id, as a [vocab] tensor of ``dtype`` built at the
    first ``like`` for each width and device (the verifier's rows, a drafter's) and kept. Ids past a width (a
    drafter's narrower vocabulary) are left out of its row."""

    def __init__(self, values: Mapping[int, float | bool], fill: float | bool = 0, dtype: torch.dtype = torch.float32):
        self.values, self.fill, self.dtype = dict(values), fill, dtype
        self._rows: dict[tuple[int, torch.device], torch.Tensor] = {}

    def like(self, logits: torch.Tensor) -> torch.Tensor:
        """The row for ``logits`` [..., vocab]: [vocab] on their device."""
        key = (logits.shape[-1], logits.device)
        if key not in self._rows:
            row = torch.full((key[0],), self.fill, dtype=self.dtype)
            inside = {t: v for t, v in self.values.items() if t < key[0]}
            if inside:
                row[torch.tensor(list(inside))] = torch.tensor(list(inside.values()), dtype=self.dtype)
            self._rows[key] = row.to(logits.device)
        return self._rows[key]
