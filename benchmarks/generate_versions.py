"""Greedy `metasd generate` under several installs (checkouts, versions, options): same tokens, same steps, how fast.

A change meant to leave batch-1 generation as it was ("behaviour unchanged", "keeps its speed") is checked here in
two ways. Exactly: under greedy decoding the same pool must commit the same tokens in the same steps, drafting the
same number of nodes - then speed can differ only by per-step overhead. And by time: each prompt is generated once
per side per repeat, the order of the sides rotated by prompt and repeat, and each side's tokens/s is compared with
the first side's per repeat (median [range], "faster"/"slower" only where ranges do not overlap; metasd.bench.stats).

A side is ``NAME=COMMAND``: the command that runs ``metasd generate`` for it, to which the script appends
``--json --max-new-tokens N --threads T [--pool P] PROMPT``. For two checkouts of the repository::

    python benchmarks/generate_versions.py --per-group 1 --copy-heavy 1 --max-new-tokens 64 --repeats 3 \\
      --side "before=/path/to/venv-a/bin/metasd generate" --side "after=/path/to/venv-b/bin/metasd generate" \\
      --out generate_versions.json

Each run is a fresh process (the pool loads every time; the wall time reported is generation's own, ``wall_s``).
One thread by default: run it alone on the machine (BENCHMARKS.md, "How we measure").
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import load_prompts  # noqa: E402


def parse_side(text: str) -> tuple[str, list[str]]:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise argparse.ArgumentTypeError(f"--side {text!r}: expected NAME=COMMAND")
    return name.strip(), shlex.split(command)


def run_once(command: list[str], prompt: str, args) -> dict:
    """One `metasd generate --json` run: tokens, steps and generation seconds, or ``{"error": ...}``."""
    cmd = command + ["--json", "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    cmd += ["--pool", args.pool] if args.pool else []
    try:
        done = subprocess.run(cmd + [prompt], capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    out = json.loads(done.stdout)
    stats = out["stats"]
    return {"tokens": len(out["token_ids"]), "seconds": stats["wall_s"], "token_ids": out["token_ids"],
            "tokens_per_step": stats.get("tokens_per_step"), "drafted": stats.get("drafted")}


def same_steps(a: dict, b: dict) -> dict[str, bool]:
    """Which of tokens, steps and drafted nodes two runs of one prompt share."""
    return {"tokens": a["token_ids"] == b["token_ids"], "steps": a["tokens_per_step"] == b["tokens_per_step"],
            "drafted": a["drafted"] == b["drafted"]}


def summarize(rows: list[dict], names: list[str]) -> list[str]:
    """Report lines: per side, its agreement with the first side on every prompt, and its speed ratio to it."""
    from metasd.bench.stats import fmt_median_range, ratios, verdict

    reference, lines = names[0], []
    first = {r["question_id"]: r["methods"][reference] for r in rows
             if r["repeat"] == 0 and "error" not in r["methods"][reference]}
    for name in names[1:]:
        agree = {"tokens": 0, "steps": 0, "drafted": 0}
        prompts, differ = 0, []
        for r in rows:
            e = r["methods"][name]
            if r["repeat"] != 0 or "error" in e or r["question_id"] not in first:
                continue
            prompts += 1
            same = same_steps(first[r["question_id"]], e)
            for k, v in same.items():
                agree[k] += v
            if not all(same.values()):
                differ.append(r["category"])
        ratio = ratios(rows, name, reference)
        noise = verdict(ratio, ratios(rows, reference, reference)) if ratio else "-"
        lines.append(f"{name} vs {reference}: same tokens {agree['tokens']}/{prompts}, same steps "
                     f"{agree['steps']}/{prompts}, same drafted nodes {agree['drafted']}/{prompts}"
                     + (f" (differ: {', '.join(differ)})" if differ else "")
                     + f"; tokens/s {fmt_median_range(ratio)} ({noise})")
    return lines


def main(argv: list[str] | None = None) -> int:
    from metasd.bench.stats import rotation

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=parse_side, action="append", required=True,
                   help="NAME=COMMAND running `metasd generate` (at least two; the first is the reference)")
    p.add_argument("--pool", help="pool file passed to every side (default: each side's embedded default)")
    p.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (repeatable; default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=1)
    p.add_argument("--groups", nargs="+")
    p.add_argument("--copy-heavy", type=int, default=0, help="also N prompts per copy-heavy category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one run")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sides = dict(args.side)
    if len(sides) < 2 or len(sides) != len(args.side):
        p.error("--side: at least two, with distinct names")
    names = list(sides)
    questions = load_prompts(args)
    rows, t0 = [], time.time()
    for rep in range(args.repeats):
        for i, q in enumerate(questions):
            row = {"question_id": q.question_id, "category": q.category, "group": q.category, "repeat": rep,
                   "methods": {}}
            for name in rotation(names, i + rep):
                row["methods"][name] = run_once(sides[name], q.turns[0], args)
            rows.append(row)
            print(f"[repeat {rep + 1}/{args.repeats}] {q.category}: " + ", ".join(
                f"{n} {row['methods'][n].get('seconds', float('nan')):.1f}s" for n in names), flush=True)
    lines = summarize(rows, names)
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0]] + (argv if argv is not None
                                                                                 else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": time.time() - t0,
        "sides": {n: shlex.join(c) for n, c in sides.items()}, "summary": lines, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
