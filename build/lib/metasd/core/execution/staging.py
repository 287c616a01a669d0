"""Host data onto the device without a host-device synchronisation.

``torch.tensor(data, device=dev)`` and ``host_tensor.to(dev)`` are blocking copies on CUDA: the host waits until the
copy is done, and a copy from pageable memory cannot start before the work queued ahead of it on the stream - every
kernel of the step so far. Staged here, the data is put in page-locked (pinned) host memory and copied with
``non_blocking=True``: the copy is queued behind that work and the host goes on. torch's pinned-memory allocator
keeps the pinned block alive until the copy has run, so the source may be dropped at once.

Pinning needs CUDA: on the CPU nothing is copied, and on another device (the fake device of the tests) the copy is
queued ``non_blocking`` from ordinary memory.
"""
from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (host numbers, nested lists, or a tensor) as a tensor on ``device``, copied without blocking the host.

    dtype: of the result (default: the tensor's own, or what ``torch.tensor`` infers from the numbers)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = torch.device(device)
    if t.device.type == device.type and (device.index is None or t.device == device):
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
