"""What batched drafting buys (docs/architecture.md#batched-drafting): the same concurrent requests through the
scheduler with each round's drafter forwards shared by the requests (``Scheduler(batch_drafting=True)``, the default)
and with every request's forwards run one by one (``False``, as before batched drafting), in one process on one
engine per pool.

For each pool and repeat, both settings serve all prompts (greedy, ``--max-new-tokens``) with ``--concurrency``
requests in flight, in an order rotated per repeat. Reported per setting: output tokens per second (all requests'
new tokens over the wall time from the first submit to the last answer, in-process: no HTTP), drafter forwards and
their mean rows; the paired ratio on / off per repeat, its median and range. The two settings' answers are compared
token for token: drafts never change greedy output in exact arithmetic, but other drafts give the verifier forwards of
other shapes, whose bf16 rounding can flip a near-tie; each divergence is reported with plain decoding's top-two logit
margin at its first differing position and whether that margin is within two bf16 steps of the top logit (a tie).

    python benchmarks/batched_drafting.py --out benchmarks/results/batched_drafting.json
    python benchmarks/batched_drafting.py --pools configs/pools/serve_tree8.yaml --concurrency 4 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
POOLS = [str(ROOT / "configs/pools/serve_chain4.yaml"), str(ROOT / "configs/pools/serve_tree8.yaml")]


def drafter_models(engine) -> list:
    """The torch modules the pool's model drafters run (forwards counted by a hook on each)."""
    from metasd.core.decoding.drafter import with_components

    seen, out = set(), []
    for d in with_components(engine.drafters):
        model = getattr(d, "model", None)
        if model is not None and id(model) not in seen:
            seen.add(id(model))
            out.append(model)
    return out


def serve(engine, prompts, max_new_tokens: int, concurrency: int, batched: bool) -> dict:
    """All prompts through a fresh scheduler; wall time, tokens, drafter forwards and rows, the answers."""
    from metasd.core.batching.scheduler import Scheduler

    counts = {"forwards": 0, "rows": 0}

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        counts["forwards"] += 1
        counts["rows"] += int(ids.shape[0]) if ids is not None else 1
    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in drafter_models(engine)]
    try:
        with Scheduler(engine, max_batch=concurrency, max_queue=len(prompts), batch_drafting=batched) as s:
            t0 = time.perf_counter()
            handles = [s.submit(p, max_new_tokens, chat=True) for p in prompts]
            results = [h.result(timeout=3600) for h in handles]
            wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    tokens = sum(len(r.token_ids) for r in results)
    return {"wall_s": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall, "drafter_forwards": counts["forwards"],
            "mean_rows": counts["rows"] / max(counts["forwards"], 1), "answers": [r.token_ids for r in results],
            "prompt_ids": [r.prompt_ids for r in results]}


def divergences(engine, on: dict, off: dict, max_new_tokens: int) -> list[dict]:
    """For each prompt whose two answers differ: the first differing position, plain decoding's top-two logit margin
    there (transformers ``generate`` on the verifier, batch 1), the top logit, whether the margin is within two bf16
    steps of it (a tie), and which answer plain decoding itself gives there."""
    import math

    from metasd.bench.baselines import first_divergence, plain_with_margins

    out = []
    for i, (a, b) in enumerate(zip(on["answers"], off["answers"])):
        if a == b:
            continue
        at = first_divergence(a, b)
        at = min(len(a), len(b)) if at is None else at
        prompt = on["prompt_ids"][i]
        plain, _, margins = plain_with_margins(engine.verifier.model, prompt, max_new_tokens)
        margin = margins[at] if at < len(margins) else None
        with torch.inference_mode():
            top = float(engine.verifier.model(input_ids=torch.tensor([prompt + a[:at]])).logits[0, -1].float().max())
        step = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else 0.0
        same = {name: plain[: at + 1] == ans[: at + 1] for name, ans in (("on", a), ("off", b))}
        out.append({"prompt": i, "position": at, "margin": margin, "top_logit": top,
                    "bf16_tie": margin is not None and margin <= 2 * step,
                    "plain_gives": next((k for k, v in same.items() if v), "neither")})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", nargs="+", default=POOLS)
    p.add_argument("--per-group", type=int, default=1, help="Spec-Bench questions per group")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from metasd.config import load_pool
    from metasd.data import SPEC_BENCH_DEFAULT, load_questions

    torch.set_num_threads(args.threads)
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in load_questions(SPEC_BENCH_DEFAULT,
                                                                                per_group=args.per_group)]
    command = "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads", "args": vars(args),
           "pools": {}}
    for pool in args.pools:
        engine = load_pool(pool)
        serve(engine, prompts[:1], 8, 1, True)  # warm-up (first forwards, int4 kernels): not measured
        rows = []
        for r in range(args.repeats):
            order = [True, False] if r % 2 == 0 else [False, True]
            run = {str(b): serve(engine, prompts, args.max_new_tokens, args.concurrency, b) for b in order}
            on, off = run["True"], run["False"]
            diverged = divergences(engine, on, off, args.max_new_tokens) if on["answers"] != off["answers"] else []
            rows.append({"repeat": r, "order": ["on" if b else "off" for b in order],
                         "on": {k: v for k, v in on.items() if k not in ("answers", "prompt_ids")},
                         "off": {k: v for k, v in off.items() if k not in ("answers", "prompt_ids")},
                         "divergences": diverged,
                         "ratio": on["tokens_per_s"] / off["tokens_per_s"],
                         "identical": on["answers"] == off["answers"]})
            print(json.dumps({"pool": Path(pool).name, **rows[-1]}), file=sys.stderr, flush=True)
        ratios = [row["ratio"] for row in rows]
        out["pools"][Path(pool).name] = {
            "rows": rows, "ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "identical": all(row["identical"] for row in rows)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        del engine
    for name, res in out["pools"].items():
        on = statistics.median(row["on"]["tokens_per_s"] for row in res["rows"])
        off = statistics.median(row["off"]["tokens_per_s"] for row in res["rows"])
        print(f"{name}: batched {on:.2f} tok/s, one by one {off:.2f} tok/s; on/off median {res['ratio_median']:.3f} "
              f"[{res['ratio_range'][0]:.3f}, {res['ratio_range'][1]:.3f}]; identical answers: {res['identical']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
