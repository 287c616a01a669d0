"""Peak RSS of a pool: load it, decode one short request, print the process's peak resident memory.

    python benchmarks/pool_memory.py configs/pools/default_int4.yaml
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

from metasd.config import load_pool


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("pool", nargs="?", help="pool YAML (default: the embedded default pool)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = load_pool(args.pool)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    r = engine.generate("Write a Python function that merges two sorted lists.", max_new_tokens=args.max_new_tokens,
                        chat=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(f"{args.pool or 'embedded default'}: peak RSS after loading {loaded:.0f} MiB, after one request {peak:.0f} MiB "
          f"(load {time.perf_counter() - t0 - r.stats.wall_s:.1f} s, {r.stats.tokens_per_second:.2f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
