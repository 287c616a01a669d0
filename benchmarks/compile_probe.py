"""Would ``torch.compile`` make the drafter's step cheaper? One-token forward of the bundled 0.5B after a
200-token prompt: eager over transformers' DynamicCache (what the drafters use), eager over a StaticCache,
and ``torch.compile`` of the forward over the StaticCache (the shape a compiled step needs), for bf16 and
int4 weights (``metasd.models.quantize``). Median ms of --repeats calls; the compile time of the first call.

    python benchmarks/compile_probe.py --out benchmarks/results/compile_probe.json
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
def probe(ref: str, quantize: str, repeats: int) -> dict:
    model, _ = load_model(ref, dtype="bf16")
    quantize_model(model, quantize, name=ref)
    prompt = torch.randint(0, 1000, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    x = torch.tensor([[5]])
    dynamic = DynamicCache(config=model.config)
    model(prompt, **cache_kwargs(model, dynamic), use_cache=True)

    def eager_dynamic():
        model(x, **cache_kwargs(model, dynamic), use_cache=True, logits_to_keep=1)
        dynamic.crop(-1)  # back to the prompt, so every call sees the same cache

    static = StaticCache(config=model.config, max_cache_len=1024)
    model(prompt, **cache_kwargs(model, static), use_cache=True, cache_position=torch.arange(PROMPT_TOKENS))
    pos = torch.tensor([PROMPT_TOKENS])
    out = {"eager_dynamic_ms": median_ms(eager_dynamic, repeats),
           "eager_static_ms": median_ms(lambda: model(x, **cache_kwargs(model, static), use_cache=True, cache_position=pos,
                                                      logits_to_keep=1), repeats)}
    compiled = torch.compile(model.forward, dynamic=False)
    t = time.perf_counter()
    reference = model(x, **cache_kwargs(model, static), use_cache=True, cache_position=pos, logits_to_keep=1).logits
    got = compiled(x, **cache_kwargs(model, static), use_cache=True, cache_position=pos, logits_to_keep=1).logits
    out["compile_s"] = time.perf_counter() - t
    out["compiled_static_ms"] = median_ms(lambda: compiled(x, **cache_kwargs(model, static), use_cache=True,
                                                           cache_position=pos, logits_to_keep=1), repeats)
    out["same_argmax"] = bool(reference.argmax() == got.argmax())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", action="append", choices=["none", "int8", "int4"], help="default: none and int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {q: probe(args.model, q, args.repeats) for q in args.quantize or ["none", "int4"]}
    for q, r in rows.items():
        print(f"{q}: eager DynamicCache {r['eager_dynamic_ms']:.1f} ms, eager StaticCache {r['eager_static_ms']:.1f} ms, "
              f"compiled StaticCache {r['compiled_static_ms']:.1f} ms (compile {r['compile_s']:.0f} s, "
              f"same argmax {r['same_argmax']})")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "threads": args.threads, "repeats": args.repeats,
                                        "torch": torch.__version__, "machine": platform.machine(),
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
