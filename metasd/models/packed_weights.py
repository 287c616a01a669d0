"""Checkpoint weights stored as 4-bit groups: about a quarter of bf16's bytes on disk, dequantized on load.

A drafter only has to propose well - the verifier decides every token - so a trained drafter network can
be *stored* in int4 without touching losslessness (what changes is its acceptance, which the model card of
a packed checkpoint must report as measured on the packed weights). In memory the weights are float again
(the drafter's ``quantize:`` setting decides how it computes).

Format, inside an ordinary safetensors file: a packed tensor ``name`` becomes

- ``name.int4``         [rows, in / 2] uint8 - two 4-bit codes per byte (low nibble first);
- ``name.int4_scales``  [in / group, rows, 2] bf16 - ``metasd.models.quantize.quantize_int4``'s asymmetric groups;
- ``name.int4_shape``   [ndim] int64 - the original shape (absent: 2-D [rows, in]);

with rows = the product of all but the last dimension. The group size follows from the shapes (it may
differ per tensor: see ``group_for``). Every
other tensor is stored as it was. ``load_weights`` reads both packed and plain files, so every family's
loader calls it instead of ``safetensors.torch.load_file``; ``metasd pack-weights`` packs a checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .quantize import dequantize_int4, quantize_int4

INT4_SUFFIX, SCALES_SUFFIX, SHAPE_SUFFIX = ".int4", ".int4_scales", ".int4_shape"
PACKED_META = "metasd_packed"  # safetensors metadata key: "int4-g<group size>"
MIN_PACKED_NUMEL = 1 << 16  # smaller tensors (norms, biases, statistics) cost nothing worth packing


def group_for(t: torch.Tensor, group_size: int, min_numel: int = MIN_PACKED_NUMEL) -> int | None:
    """The group size ``t`` is packed with: ``group_size``, halved until it divides the last dimension (down
    to 16); None when ``t`` stays as it is (not float, fewer than 2 dims or ``min_numel`` elements, or no
    group fits)."""
    if not (t.is_floating_point() and t.dim() >= 2 and t.numel() >= min_numel):
        return None
    g = group_size
    while g >= 16 and t.shape[-1] % g:
        g //= 2
    return g if g >= 16 else None


def pack_int4(tensors: dict[str, torch.Tensor], group_size: int = 32, rest_dtype: torch.dtype | None = None,
              min_numel: int = MIN_PACKED_NUMEL) -> dict[str, torch.Tensor]:
    """Every tensor ``group_for`` packs -> its three int4 entries (quantized from the values as given);
    the other float tensors cast to ``rest_dtype`` (None: unchanged)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        g = group_for(t, group_size, min_numel)
        if g is None:
            cast = rest_dtype is not None and t.is_floating_point()
            out[name] = (t.to(rest_dtype) if cast else t).contiguous()
            continue
        q, sz = quantize_int4(t.detach().float().reshape(-1, t.shape[-1]), g)  # q [rows, in] in 0..15
        q = q.to(torch.uint8)
        out[name + INT4_SUFFIX] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        out[name + SCALES_SUFFIX] = sz.to(torch.bfloat16)
        out[name + SHAPE_SUFFIX] = torch.tensor(list(t.shape), dtype=torch.int64)
    return out


def unpack_int4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``pack_int4``: packed entries -> float32 tensors of their original shape; the rest as stored."""
    out = dict(tensors)
    for key in [k for k in tensors if k.endswith(INT4_SUFFIX)]:
        name = key[:-len(INT4_SUFFIX)]
        packed, sz = out.pop(key), out.pop(name + SCALES_SUFFIX)  # [rows, in/2] uint8, [groups, rows, 2]
        shape = out.pop(name + SHAPE_SUFFIX, None)
        q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int32)  # [rows, in]
        w = dequantize_int4(q, sz.float(), q.shape[1] // sz.shape[0])
        out[name] = w.reshape(shape.tolist()) if shape is not None else w
    return out


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file -> its tensors, packed ones dequantized (float32)."""
    return unpack_int4(load_file(str(path)))


def is_packed(path: str | Path) -> bool:
    with safe_open(str(path), "pt") as f:
        return PACKED_META in (f.metadata() or {}) or any(k.endswith(INT4_SUFFIX) for k in f.keys())


#: safetensors' dtype codes -> torch dtypes, for the float ones (any other code reads as a non-float tensor)
_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _shapes_of(path: Path) -> list[torch.Tensor]:
    """The tensors of a safetensors file as shape-and-dtype-only ("meta") tensors, read from its header: what
    ``group_for`` needs, without reading the weights."""
    with safe_open(str(path), "pt") as f:
        return [torch.empty(f.get_slice(k).get_shape(), device="meta",
                            dtype=_FLOAT_CODES.get(f.get_slice(k).get_dtype(), torch.int8)) for k in f.keys()]


def pack_file(path: str | Path, group_size: int = 32, min_numel: int = MIN_PACKED_NUMEL) -> tuple[int, int]:
    """Pack one safetensors file in place (written beside, then renamed: a kill leaves the old file whole).
    Returns (bytes before, bytes after). Its metadata is kept, with ``metasd_packed`` added."""
    path = Path(path)
    if is_packed(path):
        raise ValueError(f"{path} is already packed")
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata() or {})
    before = path.stat().st_size
    tmp = path.with_name(path.name + ".packing")
    save_file(pack_int4(load_file(str(path)), group_size, min_numel=min_numel), str(tmp),
              metadata={**metadata, PACKED_META: f"int4-g{group_size}"})
    os.replace(tmp, path)
    return before, path.stat().st_size


def pack_checkpoint(folder: str | Path, group_size: int = 32,
                    min_numel: int = MIN_PACKED_NUMEL) -> list[tuple[Path, int, int]]:
    """Pack every weights file of a drafter checkpoint folder (draft vocabularies are token ids, left alone)
    and record it in the folder's config.json (``weights_dtype: int4``, ``int4_group_size``)."""
    folder = Path(folder)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16 or \
            group_size & (group_size - 1):
        raise ValueError(f"--group-size must be a power of two >= 16 (input columns per scale), got {group_size!r}")
    files = [p for p in sorted(folder.glob("*.safetensors")) if "vocab" not in p.name]
    if not files:
        raise FileNotFoundError(f"{folder}: no weights (*.safetensors) to pack")
    for p in files:  # all checked before any is rewritten
        if is_packed(p):
            raise ValueError(f"{p} is already packed")
        if not any(group_for(t, group_size, min_numel) for t in _shapes_of(p)):
            raise ValueError(f"{p}: no tensor can be packed with --group-size {group_size} (none is a float matrix "
                             f"of at least {min_numel} elements whose width a group of 16 or more divides)")
    done = [(p, *pack_file(p, group_size, min_numel)) for p in files]
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text())
        cfg.update(weights_dtype="int4", int4_group_size=group_size)
        cfg_path.write_text(json.dumps(cfg, indent=1))
    return done



def add_pack_weights_parser(subparsers) -> None:
    """Register ``metasd pack-weights FOLDER``."""
    p = subparsers.add_parser("pack-weights", help="store a drafter checkpoint's weights as 4-bit groups (~1/4 of bf16)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a checkpoint folder (TreeFlash, block heads, steering, hidden-state)")
    p.add_argument("--group-size", type=int, default=32, help="input columns per scale/zero pair (default 32)")
    p.set_defaults(func=_pack_weights_main)


def _pack_weights_main(args) -> int:
    for path, before, after in pack_checkpoint(args.folder, args.group_size):
        print(f"{path}: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
    print("re-measure the drafter's acceptance on the packed weights before publishing them (model card)")
    return 0
