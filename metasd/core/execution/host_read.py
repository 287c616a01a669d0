"""A drafting loop's host read, joined with the other loops' reads of its round (docs/architecture.md#batched-drafting).

A drafter that must see device values to go on - a tree's top-k children per level, to choose where it grows - yields
a ``HostRead`` instead of calling ``tolist`` itself, and receives the values. Alone (``drive``) that is the same one
read; a scheduler's drafting round (``draft_batch.feed_groups``) joins the reads of one device and dtype into ONE
transfer, so a batch of trees reads the device once per level rather than once per request and level.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class HostRead:
    """``tensor.tolist()``, asked for by a drafting loop (it yields this and receives the nested list)."""

    tensor: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.tensor.numel())

    def batch_key(self) -> tuple[str, torch.device, torch.dtype]:
        return "host read", self.tensor.device, self.tensor.dtype

    def run(self) -> Any:
        return self.tensor.tolist()

    @staticmethod
    def run_together(reads: Sequence["HostRead"]) -> list[Any]:
        return read_together([r.tensor for r in reads])


def read_together(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Each tensor's ``tolist()``, from ONE host read: their values concatenated (one dtype, one device) and read
    once - what every joint read here is (a round's ``HostRead`` s, a draft with the verifier's choices, a batch's
    choices)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(_nested(flat[at: at + t.numel()], list(t.shape)))
        at += t.numel()
    return out


def _nested(values: list, shape: list[int]) -> Any:
    """A flat list as nested lists of ``shape`` (what ``tolist`` gives a tensor of that shape)."""
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nested(values[i * step: (i + 1) * step], shape[1:]) for i in range(shape[0])]
