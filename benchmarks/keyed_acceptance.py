"""What seeds that hold under load cost in acceptance: the same seeded sampled requests decoded with
``seeded_sampling="keyed"`` (every token from Gumbel noise keyed by (seed, position), sample-and-match; the drafter
drafts from the same noise) and with ``"stream"`` (the request's own generator; rejection sampling where the drafter's
probabilities are known), on the bundled pair (docs/architecture.md#random-streams).

For each pool drafter, prompt and seed, both modes decode ``--max-new-tokens`` tokens at ``--temperature``; the table
gives accepted draft tokens per step and tokens per step (bonus included) per mode, and keyed / stream. Acceptance is
counted, not timed, so the figures do not depend on the machine's load. The JSON is written after every request
pair (``"complete": false`` until the last), so a run stopped part-way keeps its rows and their summary.

    python benchmarks/keyed_acceptance.py --per-group 1 --seeds 3 --out benchmarks/results/keyed_acceptance.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

#: pools whose drafts carry probabilities (rejection sampling applies in "stream" mode) and one that does not
POOLS = {
    "chain": [{"name": "chain", "type": "pretrained", "model": "bundled:qwen2.5-coder-0.5b-instruct",
               "quantize": "int4", "params": {"k": 5}}],
    "tree": [{"name": "tree", "type": "pretrained_tree", "model": "bundled:qwen2.5-coder-0.5b-instruct",
              "quantize": "int4", "params": {"nodes": 16, "depth": 5, "width": 3}}],
}


def build(drafters: list[dict]):
    from metasd.config import build_engine, parse_pool_config

    return build_engine(parse_pool_config({"verifier": {"model": "bundled:qwen2.5-coder-1.5b-instruct"},
                                           "drafters": drafters}))


def summarize(rows: list[dict]) -> dict:
    """Per pool: acceptance of each mode over the rows so far, and keyed / stream tokens per step per request pair."""
    summary = {}
    for pool in dict.fromkeys(r["pool"] for r in rows):
        mine = [r for r in rows if r["pool"] == pool]
        per = {}
        for mode in ("stream", "keyed"):
            steps = sum(r[mode]["steps"] for r in mine)
            per[mode] = {"accepted_per_step": sum(r[mode]["accepted"] for r in mine) / steps,
                         "tokens_per_step": sum(r[mode]["new_tokens"] for r in mine) / steps,
                         "acceptance_rate": sum(r[mode]["accepted"] for r in mine) / max(sum(r[mode]["drafted"]
                                                                                              for r in mine), 1)}
        ratios = [(r["keyed"]["new_tokens"] / r["keyed"]["steps"]) / (r["stream"]["new_tokens"] / r["stream"]["steps"])
                  for r in mine]
        per["keyed_over_stream_tokens_per_step"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                    "max": max(ratios)}
        summary[pool] = per
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", nargs="+", default=list(POOLS), choices=list(POOLS))
    p.add_argument("--per-group", type=int, default=1, help="Spec-Bench questions per group")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from metasd.data import SPEC_BENCH_DEFAULT, load_questions

    torch.set_num_threads(args.threads)
    questions = load_questions(SPEC_BENCH_DEFAULT, per_group=args.per_group)
    rows, t0 = [], time.time()
    command = "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads"

    def write(complete: bool) -> None:  # after every request pair: a run cut short keeps what it measured
        out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine,
               "args": vars(args), "complete": complete, "wall_s": time.time() - t0,
               "summary": summarize(rows), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))

    for pool in args.pools:
        engine = build(POOLS[pool])
        for q in questions:
            for seed in range(args.seeds):
                row = {"pool": pool, "question": q.question_id, "category": q.category, "seed": seed}
                for mode in ("stream", "keyed"):
                    engine.seeded_sampling = mode
                    r = engine.generate([{"role": "user", "content": q.turns[0]}], args.max_new_tokens,
                                        temperature=args.temperature, seed=seed)
                    s = r.stats
                    row[mode] = {"steps": s.steps, "new_tokens": s.new_tokens, "accepted": s.accepted,
                                 "drafted": s.drafted}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                write(complete=False)
    write(complete=True)
    for pool, per in summarize(rows).items():
        r = per["keyed_over_stream_tokens_per_step"]
        print(f"{pool}: tokens/step stream {per['stream']['tokens_per_step']:.2f}, keyed "
              f"{per['keyed']['tokens_per_step']:.2f}; keyed/stream per request median "
              f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
