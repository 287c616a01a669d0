"""Wall-clock readings that mean the same on every device: CUDA (and other accelerators) run kernels asynchronously,
so a clock read right after launching them times the launch, not the work. ``now(device)`` drains the device's
queue first - a host-device synchronisation, which stalls the host until every queued kernel has run and leaves
the device idle until the host queues more. A step reads the clock three times, so its clock reads synchronise
only when asked (``Engine(profile=True)``, or a reward that reads seconds: ``wall_throughput``); otherwise
``now(None)`` reads it as it is. A request synchronises once when its prefill ends and once at its end, so that
``prefill_s`` and ``wall_s`` time the work."""
from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU; another device type through its torch module, e.g.
    ``torch.mps``, or the fake device of the tests, which counts it)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    sync = getattr(getattr(torch, device.type, None), "synchronize", None)
    if sync is not None:
        sync(device) if device.type != "mps" else sync()


def now(device: torch.device | None = None) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished."""
    if device is not None:
        synchronize(device)
    return time.perf_counter()
