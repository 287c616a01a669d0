"""What a drafter forward costs on each CPU backend: the bundled 0.5B drafter's forward of 1 and 4 tokens after a
200-token prefix, through llama.cpp (llama-cpp-python's low-level API, the bf16 GGUF converted from metasd's cache,
optionally GGUFs quantized from it) and through torch (metasd's int4 drafter weights, and bf16). Written to decide
whether a drafter on llama.cpp would draft cheaper than metasd's int4 drafter on torch (BENCHMARKS.md, "llama.cpp on
the same weights, on a CPU with AMX").

    python benchmarks/draft_forward_backends.py --threads 2
    python benchmarks/draft_forward_backends.py --threads 2 --quantized q8_0 q4_0   # each in a child process

Each quantized GGUF runs in a child process, so a crash of llama.cpp (seen on a CPU with AMX) is reported, not fatal.
Medians of ``--steps`` forwards, each cropped back to the prefix. One process at a time: run it alone.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time

DRAFTER = "bundled:qwen2.5-coder-0.5b-instruct"
#: llama.cpp's file types (``LLAMA_FTYPE_MOSTLY_*``) for ``llama_model_quantize``
FTYPES = {"q8_0": 7, "q4_0": 2}


def llama_cpp_ms(path, threads: int, prefix: int, steps: int, sizes=(1, 4)) -> dict[int, float]:
    """Median milliseconds of a llama.cpp forward of each size in ``sizes`` after ``prefix`` cached tokens."""
    from metasd.core.execution.llama_cpp_verifier import llama_cpp_module

    lib = llama_cpp_module()
    model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
    params = lib.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 2048, 512, 512
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    batch = lib.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> None:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, start + i, 1, i == len(tokens) - 1
            batch.seq_id[i][0] = 0
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed for {len(tokens)} tokens")

    decode(list(range(100, 100 + prefix)), 0)
    out = {}
    for q in sizes:
        times = []
        for s in range(steps):
            t0 = time.perf_counter()
            decode([500 + s] * q, prefix)
            times.append(time.perf_counter() - t0)
            lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, prefix, -1)
        out[q] = 1000 * statistics.median(times)
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
    return out


def torch_ms(quantize: str, threads: int, prefix: int, steps: int, sizes=(1, 4)) -> dict[int, float]:
    """Median milliseconds of metasd's drafter forward (``quantize``: int4 or none, bf16 activations) of each size
    after ``prefix`` cached tokens, through the static cache metasd's drafters use."""
    import torch

    from metasd.config import ModelCache
    from metasd.core.execution.kv_cache import cache_kwargs, crop_to
    from metasd.core.execution.static_cache import new_cache

    torch.set_num_threads(threads)
    model, _ = ModelCache(None).load(DRAFTER, "bfloat16", quantize=quantize, drafter=True)
    cache = new_cache(model)
    out = {}
    with torch.inference_mode():
        model(input_ids=torch.arange(100, 100 + prefix)[None], **cache_kwargs(model, cache), use_cache=True,
              logits_to_keep=1)
        for q in sizes:
            times = []
            for s in range(steps):
                t0 = time.perf_counter()
                model(input_ids=torch.full((1, q), 500 + s), **cache_kwargs(model, cache), use_cache=True,
                      logits_to_keep=1)
                times.append(time.perf_counter() - t0)
                crop_to(cache, prefix)
            out[q] = 1000 * statistics.median(times)
    return out


def quantized_gguf(bf16, kind: str, threads: int):
    """``bf16``'s GGUF quantized to ``kind`` next to it (made once)."""
    from metasd.core.execution.llama_cpp_verifier import llama_cpp_module

    out = bf16.with_name(f"{bf16.stem}.{kind}.gguf")
    if not out.exists():
        lib = llama_cpp_module()
        params = lib.llama_model_quantize_default_params()
        params.ftype, params.nthread = FTYPES[kind], threads
        if lib.llama_model_quantize(str(bf16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix", type=int, default=200, help="cached tokens before the timed forwards")
    p.add_argument("--steps", type=int, default=30, help="timed forwards per size (median)")
    p.add_argument("--quantized", nargs="*", choices=sorted(FTYPES), default=[],
                   help="also GGUFs quantized to these types, each in a child process")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a GGUF path: time it alone and print JSON
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(llama_cpp_ms(args.child, args.threads, args.prefix, args.steps)))
        return 0
    from metasd.models.llama_cpp_source import converted_gguf

    bf16 = converted_gguf(DRAFTER, "bf16")
    rows = {"llama.cpp bf16": llama_cpp_ms(bf16, args.threads, args.prefix, args.steps)}
    for kind in args.quantized:
        path = quantized_gguf(bf16, kind, args.threads)
        child = [sys.executable, __file__, "--child", str(path), "--threads", str(args.threads),
                 "--prefix", str(args.prefix), "--steps", str(args.steps)]
        done = subprocess.run(child, capture_output=True, text=True)
        rows[f"llama.cpp {kind}"] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                     else f"crashed (exit {done.returncode})")
    for quantize in ("int4", "none"):
        name = f"torch {'int4' if quantize == 'int4' else 'bf16'}"
        rows[name] = torch_ms(quantize, args.threads, args.prefix, args.steps)
    for name, value in rows.items():
        cells = value if isinstance(value, str) else ", ".join(f"{q} tokens {ms:.1f} ms" for q, ms in value.items())
        print(f"{name}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
