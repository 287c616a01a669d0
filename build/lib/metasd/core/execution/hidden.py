"""The verifier's hidden states of the layers drafters read, kept for every committed position."""
from __future__ import annotations

from typing import Sequence

import torch


class HiddenStore:
    """Verifier hidden states of requested layers at every cached position (for steering / context).

    Row j holds the hidden state computed from committed token j, i.e. the state that predicts token
    j+1. Appends are cheap (chunks), ``get`` concatenates lazily.
    """

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(sorted(set(layers)))
        self._chunks: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def append(self, hidden: dict[int, torch.Tensor], rows: torch.Tensor | None = None) -> None:
        n = None
        for layer in self.layers:
            h = hidden[layer] if rows is None else hidden[layer].index_select(0, rows)
            self._chunks[layer].append(h)
            n = len(h)
        self._length += n or 0

    def get(self, layer: int) -> torch.Tensor:
        """[length, d] states of ``layer`` at every cached position."""
        chunks = self._chunks[layer]
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        return chunks[0]

    def last(self, layer: int) -> torch.Tensor:
        """[d] state at the last cached position (the one that produced the pending token)."""
        return self._chunks[layer][-1][-1]
