"""Where a trainer computes: the ``device`` of every training config (``auto``: CUDA when available, else the CPU;
resolved by ``metasd.models.resolve_device``), bf16 autocast where that device computes bf16, and the moves.

The networks, the verifier pieces they read, their optimizer state and every batch live on the device. Feature
shards are read on the CPU, where the data order, the anchors and the targets are drawn (CPU generators: a run
reads the same data on every device), and each batch is moved as it is used. Files are written from host copies,
so a state saved on a GPU resumes on a CPU-only machine and the other way round.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
import copy

import torch

from metasd.models import cpu_has_native_bf16, resolve_device

DEVICE_HELP = "where training computes: auto (CUDA when available, else cpu), cpu, cuda or cuda:N"


def training_device(name: str | torch.device | None) -> torch.device:
    """A config's ``device`` as a ``torch.device`` (``ValueError`` for a name torch does not know, or CUDA absent)."""
    return resolve_device(name)


def check_device(value: str) -> str:
    """Pydantic check of a ``device`` field: resolvable here (so a config naming an absent device fails when read,
    naming the field); the name itself is kept, ``auto`` included."""
    resolve_device(value)
    return value


def computes_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast runs on ``device``: the CPU (as the trainers always did), CUDA with native bf16
    (Ampere or newer); no other backend (their autocast is not known here: such a device computes in fp32)."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return False


def bf16_autocast(device: torch.device, enabled: bool = True):
    """bf16 autocast on ``device`` where it computes bf16 (``computes_bf16``), else a null context (fp32). On the
    CPU exactly ``torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)``, what the trainers always used."""
    if device.type == "cpu":
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)
    if enabled and computes_bf16(device):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def autocast_note(device: torch.device, bf16: bool) -> str:
    """The log line's words for where and how a trainer computes."""
    if not bf16:
        return f"on {device}, fp32"
    return f"on {device}, bf16 autocast" if computes_bf16(device) else f"on {device}, fp32 (no bf16 autocast there)"


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """A compute dtype name (``auto``, ``bf16``, ``fp32``) on ``device``: ``auto`` is bf16 on CUDA with native bf16
    and on CPUs that compute it natively, else fp32."""
    if name == "fp32":
        return torch.float32
    if name == "bf16":
        return torch.bfloat16
    native = cpu_has_native_bf16() if device.type == "cpu" else computes_bf16(device)
    return torch.bfloat16 if native else torch.float32


def to_device(data, device: torch.device):
    """Tensors of ``data`` (a tensor, or dicts, lists and tuples of them) on ``device``; the CPU's own are returned
    as they are on the CPU."""
    if isinstance(data, torch.Tensor):
        return data.to(device)
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device) for v in data)
    return data


def host_copy(data):
    """``data`` with every tensor on the host: what is written. Whatever is on the host already comes back as the
    same object, containers included (so a CPU run pickles exactly what it did before: shared objects stay shared)."""
    if isinstance(data, torch.Tensor):
        return data.cpu()
    if isinstance(data, dict):
        out = {k: host_copy(v) for k, v in data.items()}
        return data if all(out[k] is v for k, v in data.items()) else out
    if isinstance(data, (list, tuple)):
        items = [host_copy(v) for v in data]
        return data if all(a is b for a, b in zip(items, data)) else type(data)(items)
    return data


def save_optimizer(opt: torch.optim.Optimizer, path) -> None:
    """``torch.save`` of the optimizer's state, every tensor on the host."""
    torch.save(host_copy(opt.state_dict()), path)


def load_optimizer(opt: torch.optim.Optimizer, path) -> None:
    """Load a state written by ``save_optimizer`` (or by a GPU run of an older version: ``map_location="cpu"``);
    ``load_state_dict`` moves the moments beside their parameters, on the configured device, and keeps ``step``
    on the host, as a fresh AdamW holds it."""
    opt.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))


def pieces_on(pieces, device: torch.device):
    """The verifier pieces (``VerifierPieces``: embeddings, final norm, reduced LM head) on ``device``; the same
    object when they are there already. The norm is copied before it moves: it may be the verifier's own module."""
    if pieces.embed_weight.device == device and pieces.head_weight.device == device:
        return pieces
    norm = copy.deepcopy(pieces.norm).to(device)
    return replace(pieces, embed_weight=pieces.embed_weight.to(device), norm=norm,
                   head_weight=pieces.head_weight.to(device),
                   head_bias=None if pieces.head_bias is None else pieces.head_bias.to(device),
                   token_ids=None if pieces.token_ids is None else pieces.token_ids.to(device))
