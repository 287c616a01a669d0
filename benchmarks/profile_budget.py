"""What a start-up profile times within its budget: `metasd serve`'s verifier profile (`profile_forward`), taken in
a fresh process per run as the server takes it, with the counts it timed, skipped or timed once.

    taskset -c 1 python benchmarks/profile_budget.py --budget 5 --runs 3 --threads 1 \\
        --out benchmarks/results/profile_budget.json

Each run is a new Python process (the first forward of a process pays its one-off set-up); ``--cold`` drops the
page cache before each run (root only: ``/proc/sys/vm/drop_caches``), as a server's first start after its weights
left memory. Prints one line per run (the profile as the server logs it, its wall seconds and ``meta``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_ONE_RUN = """
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[4]))
from metasd.config.build import ModelCache
from metasd.core.pricing.forward_profile import profile_forward
model, _ = ModelCache("cpu").load(sys.argv[1], sys.argv[2])  # (model, tokenizer), as the server loads its verifier
t = time.perf_counter()
p = profile_forward(model, json.loads(sys.argv[5]), context=int(sys.argv[6]), max_seconds=float(sys.argv[3]))
print(json.dumps({"wall_s": round(time.perf_counter() - t, 3), "describe": p.describe(), "profile": p.to_dict()}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget", type=float, default=5.0, help="the profile's max_seconds")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--counts", type=int, nargs="+", default=[1, 4, 16, 64, 256], help="token counts (the server's)")
    p.add_argument("--context", type=int, default=256, help="cached positions before each forward (the server's)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each run (root only)")
    p.add_argument("--out", help="write the runs as JSON here")
    args = p.parse_args(argv)
    if args.runs < 1 or args.budget <= 0:
        p.error("--runs must be >= 1 and --budget > 0")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    runs = []
    for i in range(args.runs):
        if args.cold:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        started = time.time()
        command = [sys.executable, "-c", _ONE_RUN, args.model, args.dtype, str(args.budget), str(args.threads),
                   json.dumps(args.counts), str(args.context)]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"error: run {i + 1} failed:\n{out.stderr[-2000:]}")
        run = json.loads(out.stdout.strip().splitlines()[-1]) | {"started": started}
        runs.append(run)
        print(f"run {i + 1}: {run['wall_s']:.1f} s, {run['describe']}; meta {run['profile']['meta']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "args": vars(args),
                                              "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
