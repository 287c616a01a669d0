"""Which static tree to draft with: every shape within a recorded static tree, scored on real acceptance.

    python benchmarks/static_depth.py --trace benchmarks/results/trace_static_depth.json --arm qwen0.5b_static8 \
        --lookup suffix --enough 6 --out benchmarks/results/static_depth.json

The trace (``benchmarks/trace_replay.py record``, real models, greedy) holds, at every position of each prompt's
recorded continuation, the static tree's whole draft - every node at level d has the recorded ``widths[d]`` children,
its drafter's best first - and which nodes lie on the verifier's path; and the lookup's draft beside it. A smaller
shape W' (``W'[d] <= widths[d]``, fewer levels) drafts exactly the recorded nodes whose rank among their siblings is
below ``W'[d]`` at every level (the drafter's top-k of fewer is the top of its top-k). So each shape's greedy steps are
walked on the trace as the engine takes them: at position p the draft accepts its deepest node on the path, the step
commits that many tokens + 1, the next step starts there. ``alone``: the static tree alone; ``cascade``: as the GPU
default's fused arm drafts (``configs/gpu_default.yaml``): the lookup's draft alone where it is at least ``--enough``
deep, else both (the longer accepted path; their nodes summed, shared prefixes not merged: an upper bound).

Per shape and prompt set: tokens a step (the engine's unit of speed where a forward is flat in tokens: a GPU), the
verify forward's tokens a step (1 + nodes) and the drafter forwards a step (a catch-up, then one per level after the
first; 0 where the lookup drafts alone). Acceptance only: what each costs is the device's (``benchmarks/gpu_check.py``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout)

from metasd.data.copy_heavy import CATEGORIES


def levels_and_ranks(parents: list[int]) -> tuple[list[int], list[int]]:
    """Each node's depth (0: a child of the root) and its rank among its siblings (in the draft's order)."""
    depth, rank, seen = [], [], {}
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
        rank.append(seen.get(p, 0))
        seen[p] = rank[-1] + 1
    return depth, rank


def within(parents: list[int], shape: tuple[int, ...]) -> list[bool]:
    """Which nodes a static tree of ``shape`` drafts of the recorded one (rank below its level's width, its parent
    kept, its level among the shape's)."""
    depth, rank = levels_and_ranks(parents)
    kept: list[bool] = []
    for i, p in enumerate(parents):
        kept.append(depth[i] < len(shape) and rank[i] < shape[depth[i]] and (p < 0 or kept[p]))
    return kept


def accepted(step: dict, kept: list[bool] | None = None) -> int:
    """Tokens the draft's kept nodes accept: the depth of its deepest node on the verifier's path."""
    depth, _ = levels_and_ranks(step["parents"])
    on = step["on_path"]
    return max((depth[i] + 1 for i in range(len(depth)) if on[i] == "1" and (kept is None or kept[i])), default=0)


def walk(static: list[dict], lookup: list[dict] | None, shape: tuple[int, ...], enough: int) -> dict:
    """One prompt's greedy steps with a static tree of ``shape`` (and the lookup first, where given)."""
    p = steps = verify = forwards = 0
    while p < len(static):
        step, kept = static[p], within(static[p]["parents"], shape)
        a, nodes, fwd = accepted(step, kept), sum(kept), len(shape)
        if lookup is not None:
            look = lookup[p]
            deep = max(levels_and_ranks(look["parents"])[0], default=-1) + 1
            if deep >= enough:
                a, nodes, fwd = accepted(look), len(look["parents"]), 0
            else:
                a, nodes = max(a, accepted(look)), nodes + len(look["parents"])
        p += a + 1
        steps += 1
        verify += 1 + nodes
        forwards += fwd
    return {"tokens": len(static), "steps": steps, "verify_tokens": verify, "drafter_forwards": forwards}


def candidate_shapes(widths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every shape within ``widths``: each level's width 1..widths[d], non-increasing, any depth."""
    out = []
    for depth in range(1, len(widths) + 1):
        for shape in itertools.product(*(range(1, w + 1) for w in widths[:depth])):
            if all(a >= b for a, b in zip(shape, shape[1:])):
                out.append(shape)
    return out


def score(trace: dict, arm: str, lookup: str | None, enough: int, shapes: list[tuple[int, ...]]) -> dict:
    sets = {"all": lambda name: True, "spec_bench": lambda name: name.split("/")[0] not in CATEGORIES,
            "copy_heavy": lambda name: name.split("/")[0] in CATEGORIES}
    modes = ["alone"] + (["cascade"] if lookup else [])
    rows = []
    for shape in shapes:
        row = {"shape": list(shape), "nodes": sum(itertools.accumulate(shape, lambda a, b: a * b))}
        for mode in modes:
            per = {p["name"]: walk(p["arms"][arm], p["arms"][lookup] if mode == "cascade" else None, shape, enough)
                   for p in trace["prompts"]}
            for name, keep in sets.items():
                chosen = [w for n, w in per.items() if keep(n)]
                steps = sum(w["steps"] for w in chosen)
                row[f"{mode}_{name}"] = {
                    "tokens_per_step": round(sum(w["tokens"] for w in chosen) / steps, 3),
                    "verify_tokens_per_step": round(sum(w["verify_tokens"] for w in chosen) / steps, 2),
                    "drafter_forwards_per_step": round(sum(w["drafter_forwards"] for w in chosen) / steps, 2),
                    "per_prompt_tokens_per_step": {n: round(w["tokens"] / w["steps"], 2) for n, w in per.items()
                                                   if keep(n)}}
        rows.append(row)
    return {"modes": modes, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--arm", required=True, help="the recorded static tree arm")
    p.add_argument("--lookup", help="the recorded lookup arm the cascade drafts first (none: the static tree alone)")
    p.add_argument("--enough", type=int, default=6, help="the cascade's lookup depth verified alone")
    p.add_argument("--shapes", nargs="*", help="shapes to score, as 4,2,2,1 (default: every shape within the arm's)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    trace = json.loads(Path(args.trace).read_text())
    full = max((s["parents"] for pr in trace["prompts"] for s in pr["arms"][args.arm]), key=len)
    depth, rank = levels_and_ranks(full)
    widths = tuple(max(r for d, r in zip(depth, rank) if d == level) + 1 for level in range(max(depth) + 1))
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else candidate_shapes(widths))
    result = {"trace": args.trace, "arm": args.arm, "widths": list(widths), "lookup": args.lookup,
              "enough": args.enough, "command": " ".join(sys.argv), **score(trace, args.arm, args.lookup,
                                                                             args.enough, shapes)}
    for mode in result["modes"]:
        best = max(result["rows"], key=lambda r: r[f"{mode}_all"]["tokens_per_step"])
        print(f"{mode}: most tokens a step {best[f'{mode}_all']['tokens_per_step']} with {best['shape']}",
              file=sys.stderr)
    for row in result["rows"]:
        print(row["shape"], row["nodes"], *(f"{m}: {row[f'{m}_spec_bench']['tokens_per_step']} / "
                                            f"{row[f'{m}_copy_heavy']['tokens_per_step']}" for m in result["modes"]),
              file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
