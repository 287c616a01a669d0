"""Which torch CPU path makes a forward cheaper? A ``--width``-token forward (1: a decode step; 8: a verify) of
``--model`` after a 200-token prompt: eager over transformers' DynamicCache (what the drafters use), eager over a
StaticCache, ``torch.compile`` of the forward over the StaticCache (the shape a compiled step needs), with
``--variants frozen``: the same compiled with inductor's freezing (weights folded as constants and prepacked for
oneDNN), with ``--variants packed``: eager with every Linear's weight prepacked for oneDNN
(``torch.utils.mkldnn.to_mkldnn``); for ``--dtype`` bf16 or fp32, and bf16 and int4 weights (``metasd.models.quantize``). Median ms of --repeats
calls; the compile time of the first call; whether each path's argmax (every row) equals eager's.

    python benchmarks/compile_probe.py --out benchmarks/results/compile_probe.json
    python benchmarks/compile_probe.py --model bundled:qwen2.5-coder-1.5b-instruct --quantize none --width 1 \\
      --width 8 --variants frozen --variants packed --repeats 10 --out benchmarks/results/cpu_forward_probe.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from timing import median_ms  # benchmarks/timing.py (this folder is on sys.path)
from transformers import DynamicCache, StaticCache

from metasd.models import load_model
from metasd.models.quantize import quantize_model
from metasd.core.execution.kv_cache import cache_kwargs

PROMPT_TOKENS = 200


@torch.inference_mode()
def probe(ref: str, quantize: str, repeats: int, width: int = 1, variants=(), dtype: str = "bf16") -> dict:
    model, _ = load_model(ref, dtype=dtype)
    quantize_model(model, quantize, name=ref)
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    x = torch.arange(5, 5 + width).unsqueeze(0)
    dynamic = DynamicCache(config=model.config)
    model(prompt, **cache_kwargs(model, dynamic), use_cache=True)

    def eager_dynamic():
        model(x, **cache_kwargs(model, dynamic), use_cache=True, logits_to_keep=width)
        dynamic.crop(-width)  # back to the prompt, so every call sees the same cache

    static = StaticCache(config=model.config, max_cache_len=1024)
    model(prompt, **cache_kwargs(model, static), use_cache=True, cache_position=torch.arange(PROMPT_TOKENS))
    pos = torch.arange(PROMPT_TOKENS, PROMPT_TOKENS + width)

    def static_call(forward):
        return lambda: forward(x, **cache_kwargs(model, static), use_cache=True, cache_position=pos,
                               logits_to_keep=width)

    out = {"width": width, "eager_dynamic_ms": median_ms(eager_dynamic, repeats),
           "eager_static_ms": median_ms(static_call(model), repeats)}
    reference = static_call(model)().logits.argmax(-1)
    paths = {"compiled_static": lambda: torch.compile(model.forward, dynamic=False)}
    if "frozen" in variants:
        def frozen():
            torch._dynamo.reset()
            return torch.compile(model.forward, dynamic=False, options={"freezing": True})
        paths["compiled_frozen"] = frozen
    for name, make in paths.items():
        compiled = make()
        t = time.perf_counter()
        got = static_call(compiled)().logits.argmax(-1)
        out[f"{name}_compile_s"] = time.perf_counter() - t
        out[f"{name}_ms"] = median_ms(static_call(compiled), repeats)
        out[f"{name}_same_argmax"] = bool((reference == got).all())
    if "packed" in variants:  # last: it replaces the model's Linear modules
        from torch.utils import mkldnn

        model.model = mkldnn.to_mkldnn(model.model, dtype=model.dtype)
        got = static_call(model)().logits.argmax(-1)
        out["packed_ms"] = median_ms(static_call(model), repeats)
        out["packed_same_argmax"] = bool((reference == got).all())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", action="append", choices=["none", "int8", "int4"], help="default: none and int4")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--width", type=int, action="append", help="tokens per forward (repeatable; default 1)")
    p.add_argument("--variants", action="append", choices=["frozen", "packed"], default=[],
                   help="also time inductor with freezing / eager with oneDNN-prepacked Linear weights")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {f"{q} width {w}": probe(args.model, q, args.repeats, w, args.variants, args.dtype)
            for q in args.quantize or ["none", "int4"] for w in args.width or [1]}
    for key, r in rows.items():
        print(f"{key}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
              flush=True)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
                                        "torch": torch.__version__, "machine": platform.machine(),
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
