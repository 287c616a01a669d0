"""Which activation dtype do torch's weight-only CPU kernels want? Median ms of ``_weight_int8pack_mm`` and
``_weight_int4pack_mm_for_cpu`` on one of the bundled 0.5B's MLP shapes (896 -> 4864) for fp32, fp16 and
bf16 activations, and of a ``metasd.models.quantize.QuantizedLinear`` built from a layer of each dtype (which runs
the kernel on bf16 activations on CPU). Random weights: the kernels' cost does not depend on the values.

    python benchmarks/kernel_dtype.py --out benchmarks/results/kernel_dtype.json
"""
from __future__ import annotations

import argparse
import json
import platform
from functools import partial
from pathlib import Path

import torch
from timing import median_ms  # benchmarks/timing.py (this folder is on sys.path)
from torch import nn

from metasd.models.quantize import QuantizedLinear

IN, OUT = 896, 4864


def raw_kernel(layer: QuantizedLinear, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The layer's kernel called on ``x`` as it is, with ``scales`` in ``x``'s dtype (what metasd did before
    it cast CPU activations to bf16)."""
    if layer.mode == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, layer.group_size, scales)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    for mode in ("int8", "int4"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            layer = QuantizedLinear(nn.Linear(IN, OUT, bias=False).to(dtype), mode)
            scales = (layer.scales if mode == "int8" else layer.scales_and_zeros).to(dtype)
            for rows in args.rows:
                x = torch.randn(rows, IN, dtype=dtype)
                row = {"mode": mode, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                       "raw_kernel_ms": median_ms(partial(raw_kernel, layer, scales, x), args.repeats, warmup=3),
                       "quantized_linear_ms": median_ms(partial(layer, x), args.repeats, warmup=3)}
                results.append(row)
                print(f"{mode} {row['dtype']:>8} {rows:>3} rows: kernel on {row['dtype']} activations "
                      f"{row['raw_kernel_ms']:.2f} ms, QuantizedLinear {row['quantized_linear_ms']:.2f} ms", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": platform.machine(), "torch": torch.__version__,
                                        "threads": args.threads, "shape": [IN, OUT], "results": results}, indent=1))


if __name__ == "__main__":
    main()
