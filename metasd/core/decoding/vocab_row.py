"""``VocabRow``: a request's per-token values over the whole vocabulary - a mask of allowed or banned ids, a logit
bias - the same at every position, so built once (per vocabulary width and device) and applied to every row."""
from __future__ import annotations

from typing import Mapping

import torch


class VocabRow:
    """``values`` at their token ids and ``fill`` at every other id, as a [vocab] tensor of ``dtype`` built at the
    first ``like`` (on the logits' device, as wide as their rows) and kept while those stay the same."""

    def __init__(self, values: Mapping[int, float | bool], fill: float | bool = 0, dtype: torch.dtype = torch.float32):
        self.values, self.fill, self.dtype = dict(values), fill, dtype
        self._row: torch.Tensor | None = None

    def like(self, logits: torch.Tensor) -> torch.Tensor:
        """The row for ``logits`` [..., vocab]: [vocab] on their device."""
        width, row = logits.shape[-1], self._row
        if row is None or row.shape[-1] != width or row.device != logits.device:
            row = torch.full((width,), self.fill, dtype=self.dtype)
            row[torch.tensor(list(self.values))] = torch.tensor(list(self.values.values()), dtype=self.dtype)
            self._row = row = row.to(logits.device)
        return row
