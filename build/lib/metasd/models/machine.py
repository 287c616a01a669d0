"""Is this machine oversubscribed? Torch threads of this process plus the cores other busy metasd processes
use, against the cores there are.

Two metasd processes with 2 torch threads each on a 2-core machine slow each other down ~20x (BENCHMARKS.md
runs 11 and 13 were skewed that way): every command that runs models warns once, on stderr, naming the
``--threads`` option. Busy = using at least ``min_busy`` of a core over a short sample (Linux ``/proc``;
elsewhere the check is skipped).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_warned = False


@dataclass
class BusyProcess:
    pid: int
    cores: float  # CPU seconds per second over the sample
    command: str


def _cpu_ticks(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of the file)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def busy_metasd_processes(interval: float = 0.25, min_busy: float = 0.5) -> list[BusyProcess]:
    """Other processes whose command line runs metasd and that used >= ``min_busy`` cores over ``interval`` s."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    me = os.getpid()
    candidates = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        cmd = _command(int(entry.name))
        if "metasd" in cmd:
            ticks = _cpu_ticks(int(entry.name))
            if ticks is not None:
                candidates[int(entry.name)] = (cmd, ticks)
    if not candidates:
        return []
    t0 = time.monotonic()
    time.sleep(interval)
    dt = time.monotonic() - t0
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = []
    for pid, (cmd, before) in candidates.items():
        after = _cpu_ticks(pid)
        if after is None:
            continue
        cores = (after - before) / hz / dt
        if cores >= min_busy:
            busy.append(BusyProcess(pid, cores, cmd))
    return busy


def oversubscription_warning(threads: int, others: list[BusyProcess], cores: int) -> str | None:
    """The warning text when ``threads`` plus the cores ``others`` use exceed ``cores``; else None."""
    used = sum(p.cores for p in others)
    if not others or threads + used <= cores + 0.25:
        return None
    names = "; ".join(f"pid {p.pid} ({p.cores:.1f} cores): {p.command[:60]}" for p in others[:3])
    fair = max(1, int(cores - used))
    return (f"metasd: warning: {len(others)} other busy metasd process(es) use {used:.1f} of this machine's {cores} "
            f"cores and this one runs {threads} torch threads; processes that oversubscribe the cores slow each "
            f"other down many times over (timings taken now are not comparable). Run one at a time, or pass "
            f"--threads {fair}. [{names}]")


def warn_if_oversubscribed(threads: int | None = None, cores: int | None = None, stream=None) -> str | None:
    """Print the oversubscription warning once per process (stderr); returns it (None when all is well)."""
    global _warned
    if _warned:
        return None
    import torch

    threads = threads or torch.get_num_threads()
    if cores is None:
        cores = cores_available()
    message = oversubscription_warning(threads, busy_metasd_processes(), cores)
    if message:
        _warned = True
        print(message, file=stream or sys.stderr)
    return message


def cores_available() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_per_core() -> float | None:
    """The 1-minute load average over the cores (> 1: more runnable threads than cores, so timings taken
    now are slowed by other work); None where the platform has no load average."""
    try:
        return os.getloadavg()[0] / cores_available()
    except (AttributeError, OSError):
        return None
