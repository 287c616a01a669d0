"""Timing helper shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so this
folder is on ``sys.path``)."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int, warmup: int = 0) -> float:
    """Median wall milliseconds of ``repeats`` calls of ``fn()``, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
