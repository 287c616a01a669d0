"""What the drafters' own processing buys: the speed of a pool on requests with processing (penalties, a logit bias,
bad words) when its model drafters process their rows as the verifier's are processed (``DraftProcessing``), against
the same pool with that off (``Engine.mask_drafts = False``) and plain decoding with the same processing.

Three methods per prompt and setting - ``plain`` (metasd's engine with no drafter), ``processed`` and ``unprocessed``
(the pool with its drafters' processing on and off) - in an order rotated per prompt, setting and repeat, greedy
(or seeded sampling at ``--temperature``), ``--max-new-tokens`` each, the Spec-Bench subset (``--per-group`` prompts
a group, the first turn, chat template).
Per repeat and setting: R = tokens/s(processed) / tokens/s(unprocessed), and each over plain, geometric means over the
prompts; the figures are medians over repeats with their ranges. The processed and unprocessed runs read the same
processed verifier rows, so their tokens must be the same; plain's may differ at bf16 ties only.

    python benchmarks/processing.py --per-group 1 --repeats 3 --out benchmarks/results/processing.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

METHODS = ("plain", "processed", "unprocessed")


def settings(tokenizer) -> dict[str, dict]:
    """The processing each prompt is run under: penalties users set, and a ban of two of the commonest tokens (a bias
    of -100 on "," and " the") and of three common words (vLLM's ``bad_words``)."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in (",", " the")]
    if any(len(i) != 1 for i in ids):
        raise ValueError(f"the tokenizer spells ',' or ' the' as several tokens ({ids}): pick other tokens to ban")
    return {"repetition 1.1": {"repetition_penalty": 1.1},
            "presence 0.5 + frequency 0.5": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
            "bias: ban ',' and ' the'": {"logit_bias": {ids[0][0]: -100.0, ids[1][0]: -100.0}},
            "bad words: the, is, and": {"bad_words": ["the", "is", "and"]}}


def run_one(engines: dict, method: str, ids: list[int], processing: dict, max_new_tokens: int,
            sampling: dict | None = None) -> dict:
    engine = engines["plain" if method == "plain" else "pool"]
    engine.mask_drafts = method != "unprocessed"
    try:
        t0 = time.perf_counter()
        r = engine.generate(ids, max_new_tokens, **processing, **(sampling or {}))
        seconds = time.perf_counter() - t0
    finally:
        engine.mask_drafts = True
    return {"method": method, "tokens": len(r.token_ids), "seconds": seconds,
            "tokens_per_s": len(r.token_ids) / seconds, "tokens_per_step": r.stats.mean_tokens_per_step,
            "accepted": r.stats.accepted, "steps": r.stats.steps, "token_ids": r.token_ids}


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per setting: per repeat the geometric means over prompts of processed/unprocessed, processed/plain and
    unprocessed/plain tokens/s; medians and ranges over the complete repeats; identical outputs counted."""
    out = {}
    for name in names:
        mine = [r for r in rows if r["setting"] == name]
        per = []
        for rep in sorted({r["repeat"] for r in mine}):
            tps = {(r["prompt"], r["method"]): r for r in mine if r["repeat"] == rep}
            prompts = sorted({p for p, _ in tps})
            if any((p, m) not in tps for p in prompts for m in METHODS):
                continue  # an incomplete repeat (a run still going)
            def ratio(a: str, b: str) -> float:
                return statistics.geometric_mean([tps[p, a]["tokens_per_s"] / tps[p, b]["tokens_per_s"]
                                                  for p in prompts])
            per.append({"repeat": rep, "processed/unprocessed": ratio("processed", "unprocessed"),
                        "processed/plain": ratio("processed", "plain"),
                        "unprocessed/plain": ratio("unprocessed", "plain"),
                        "tokens_per_step": {m: statistics.mean(tps[p, m]["tokens_per_step"] for p in prompts)
                                            for m in ("processed", "unprocessed")}})
        if not per:
            continue
        entry = {"per_repeat": per}
        for key in ("processed/unprocessed", "processed/plain", "unprocessed/plain"):
            vals = [p[key] for p in per]
            entry[key] = {"median": statistics.median(vals), "range": [min(vals), max(vals)]}
        complete = {p["repeat"] for p in per}
        by = {(r["repeat"], r["prompt"], r["method"]): r["token_ids"] for r in mine if r["repeat"] in complete}
        runs = [(k[0], k[1]) for k in by if k[2] == "processed"]
        for other in ("unprocessed", "plain"):  # outputs compared over the complete repeats
            same = sum(by[(*k, "processed")] == by[(*k, other)] for k in runs)
            entry[f"processed == {other}"] = f"{same}/{len(runs)}"
        out[name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool)")
    p.add_argument("--questions", help="Spec-Bench-format JSONL (default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: every method samples at this temperature, seeded (--seed), so the three give the same "
                        "text but for bf16 ties")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", help="run only the settings whose name contains this (repeatable)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", help="write the rows and the summary here (JSON), after every prompt")
    args = p.parse_args(argv)

    import torch

    import metasd
    from metasd.core.engine import Engine
    from metasd.data import SPEC_BENCH_DEFAULT, load_questions

    if args.threads:
        torch.set_num_threads(args.threads)
    questions = load_questions(args.questions or SPEC_BENCH_DEFAULT, per_group=args.per_group)
    pool = metasd.load_pool(args.pool) if args.pool else metasd.load_pool()
    engines = {"pool": pool, "plain": Engine(pool.verifier, None)}
    chosen = {k: v for k, v in settings(pool.tokenizer).items() if not args.only or any(o in k for o in args.only)}
    if not chosen:
        raise SystemExit(f"--only matches no setting of {list(settings(pool.tokenizer))}")
    report = {"command": " ".join(["python benchmarks/processing.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "seed": args.seed if args.temperature > 0 else None,
              "settings": {k: {f: (v if f != "logit_bias" else {str(t): b for t, b in v.items()})
                               for f, v in s.items()} for k, s in chosen.items()},
              "rows": [], "complete": False}
    prompts = [pool.encode([{"role": "user", "content": q.turns[0]}]) for q in questions]
    sampling = {"temperature": args.temperature, "seed": args.seed} if args.temperature > 0 else {}
    step = 0
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name, processing in chosen.items():
                shift, step = step % len(METHODS), step + 1
                for method in METHODS[shift:] + METHODS[:shift]:
                    row = run_one(engines, method, ids, processing, args.max_new_tokens, sampling)
                    report["rows"].append({"repeat": rep, "prompt": i, "category": questions[i].category,
                                           "setting": name, **row})
                    print(f"repeat {rep + 1} prompt {i + 1} {name:>28} {method:>11}: {row['tokens_per_s']:.2f} "
                          f"tok/s, {row['tokens_per_step']:.2f} tokens/step", flush=True)
            report["summary"] = summarize(report["rows"], list(chosen))
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    report["complete"] = True
    report["summary"] = summarize(report["rows"], list(chosen))
    print(json.dumps({k: {f: v for f, v in s.items() if f != "per_repeat"} for k, s in report["summary"].items()},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
