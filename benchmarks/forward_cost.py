"""Cost of one forward per model and weight quantization: decode 1 token, verify 4/8/16/24, over a cache.

Each (model, quantization) runs in a child process of its own, so its peak RSS is its own: the table gives
the ms of a one-token forward and of 4/8/16/24-token forwards over a 200- and a 700-token KV cache
(median of --repeats after a warm-up), the bytes of the weights as stored (parameters and buffers), the
process's peak RSS and the time quantizing took. A quantization written ``int4:drafter`` quantizes as a pool does a
drafter (``prefill_copy``: dense copies for inputs above the crossover ``dense_crossover`` times at load).

    python benchmarks/forward_cost.py --out benchmarks/results/forward_cost.json
    python benchmarks/forward_cost.py --models bundled:qwen2.5-coder-0.5b-instruct --quantize none int4 int4:drafter \
        --widths 1 4 8 16 32 64 128 --caches 100 --threads 1 --repeats 5 --out benchmarks/results/drafter_rows.json
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

MODELS = ["bundled:qwen2.5-coder-0.5b-instruct", "bundled:qwen2.5-coder-1.5b-instruct"]
WIDTHS = (1, 4, 8, 16, 24)
CACHES = (200, 700)


def measure(ref: str, quantize: str, dtype: str, threads: int, repeats: int, widths=WIDTHS, caches=CACHES) -> dict:
    """One (model, quantization) in this process: ms per forward of each width over each cache length."""
    from transformers import DynamicCache

    from metasd.models import load_model
    from metasd.models.quantize import quantize_model
    from metasd.core.execution.kv_cache import cache_kwargs

    torch.set_num_threads(threads)
    model, _ = load_model(ref, dtype=dtype)
    t0 = time.perf_counter()
    mode, _, role = quantize.partition(":")
    quantize_model(model, mode, name=ref, prefill_copy=role == "drafter")
    quantize_s = time.perf_counter() - t0
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    ms: dict[str, float] = {}
    with torch.inference_mode():
        for length in caches:
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.randint(0, vocab, (1, length), generator=gen), **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
            for width in widths:
                times = []
                for i in range(repeats + 2):  # two warm-up calls
                    ids = torch.randint(0, vocab, (1, width), generator=gen)
                    t = time.perf_counter()
                    model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)  # logits at every row, as a verify
                    if i >= 2:
                        times.append(time.perf_counter() - t)
                    cache.crop(-width)
                ms[f"{width}@{length}"] = 1e3 * statistics.median(times)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"model": ref, "quantize": quantize, "dtype": dtype, "ms": ms, "weight_bytes": weight_bytes,
            "peak_rss_bytes": peak_rss, "quantize_s": quantize_s}


def table(rows: list[dict]) -> str:
    cols = list(rows[0]["ms"])
    head = " | ".join(f"{c.split('@')[0]} tok @{c.split('@')[1]}" for c in cols)
    lines = [f"| model | quantize | {head} | weights | peak RSS | quantize time |", "|" + "---|" * (len(cols) + 5)]
    for r in rows:
        name = r["model"].removeprefix("bundled:qwen2.5-coder-").removesuffix("-instruct")
        cells = " | ".join(f"{r['ms'][c]:.0f}" for c in cols)
        lines.append(f"| {name} | {r['quantize']} | {cells} | {r['weight_bytes'] / 2**20:.0f} MiB | "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} MiB | {r['quantize_s']:.1f} s |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"])
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS), help="tokens per forward")
    p.add_argument("--caches", type=int, nargs="+", default=list(CACHES), help="KV cache lengths before them")
    p.add_argument("--out", default="benchmarks/results/forward_cost.json")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "QUANTIZE"), help=argparse.SUPPRESS)  # child process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one[0], args.one[1], args.dtype, args.threads, args.repeats, args.widths,
                                 args.caches)))
        return 0
    rows = []
    for ref in args.models:
        for q in args.quantize:
            cmd = [sys.executable, __file__, "--one", ref, q, "--dtype", args.dtype, "--threads", str(args.threads),
                   "--repeats", str(args.repeats), "--widths", *map(str, args.widths), "--caches",
                   *map(str, args.caches)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{ref} {q}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in rows[-1]["ms"].items()), flush=True)
    result = {"command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
