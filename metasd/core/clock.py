"""Wall-clock readings that mean the same on every device: CUDA (and other accelerators) run kernels asynchronously,
so a clock read right after launching them times the launch, not the work. ``now(device)`` drains the device's
queue first. In a decoding step this costs almost nothing: each phase ends with a host read anyway (the drafter
reads its draft, acceptance reads the verifier's choice), which waits for the same work."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def now(device: torch.device | None = None) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished."""
    if device is not None:
        synchronize(device)
    return time.perf_counter()
