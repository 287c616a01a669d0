"""Devices and dtypes: "auto" resolved per machine (CUDA when present; bf16 on CUDA and on CPUs that
compute it natively, else fp32), names checked with errors that list what is allowed."""
from __future__ import annotations

from pathlib import Path

import torch


_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_ALLOWED_DTYPES = "'auto', " + ", ".join(repr(k) for k in _DTYPE_ALIASES) + " or a floating torch.dtype"


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (x86 AVX512-BF16 / AMX-BF16, or Arm BF16)."""
    flags: set[str] = set()
    for line in _read_cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> ``cuda`` if available, else ``cpu``; other values go through ``torch.device``."""
    if isinstance(device, torch.device):
        return device
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not valid: use 'auto', 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """Turn a dtype name into a ``torch.dtype``.

    ``"auto"`` gives bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32. Names:
    ``bf16``/``bfloat16``, ``fp32``/``float32``, ``fp16``/``float16``. Anything else raises ``ValueError``.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating type; allowed: {_ALLOWED_DTYPES}")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype {dtype!r} is not valid; allowed: {_ALLOWED_DTYPES}")
    key = dtype.strip().lower()
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    if key != "auto":
        raise ValueError(f"dtype {dtype!r} is not valid; allowed: {_ALLOWED_DTYPES}")
    if isinstance(device, torch.device):
        dev_type = device.type
    elif device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        dev_type = torch.device(device).type
    if dev_type == "cuda":
        return torch.bfloat16
    if dev_type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32
