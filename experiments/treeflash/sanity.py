"""Sanity run of the TreeFlash drafter on the bundled verifier: every mode vs plain decoding, greedy.

    nice -n 19 python experiments/treeflash/sanity.py [CHECKPOINT] [--max-new 48] [--prompts 2]

Prints, per mode, tokens per step (mean of tau = accepted drafts + 1; plain decoding = 1.00), tokens/s
and whether the output equals plain decoding. In bf16 a divergence is reported with the top-2 logit
margin of plain decoding at the first differing position (near-ties flip in bf16: docs/models.md#bf16-and-greedy-identity).
"""
from __future__ import annotations

import argparse
import json

import torch

from metasd.drafters import TreeFlashDrafter
from metasd.core.engine import Engine
from metasd.models import load_model
from metasd.core.execution.verifier import Verifier

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain the difference between a list and a tuple in Python, with a short example.",
]


@torch.no_grad()
def top2_margin(model, ids: list[int]) -> float:
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint", nargs="?", default="checkpoints/treeflash/qwen1.5b")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--modes", default="chain,marginal,treeflash")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("bundled:qwen2.5-coder-1.5b-instruct", dtype="bf16")
    verifier = Verifier(model, tok, name="qwen2.5-coder-1.5b")
    plain = Engine(verifier, None)
    modes = args.modes.split(",")
    drafters = {m: TreeFlashDrafter.from_checkpoint(args.checkpoint, model, mode=m, name=f"treeflash-{m}") for m in modes}
    rows: dict[str, dict] = {"plain": {"tokens": 0, "steps": 0, "wall": 0.0}}
    rows.update({m: {"tokens": 0, "steps": 0, "wall": 0.0, "identical": 0, "draft_s": 0.0, "verify_s": 0.0,
                     "divergences": []} for m in modes})
    for i, text in enumerate(PROMPTS[: args.prompts]):
        prompt = [{"role": "user", "content": text}]
        ref = plain.generate(prompt, max_new_tokens=args.max_new)
        r = rows["plain"]
        r["tokens"] += ref.stats.new_tokens
        r["steps"] += ref.stats.steps
        r["wall"] += ref.stats.wall_s
        print(f"[prompt {i}] plain: {ref.stats.new_tokens / ref.stats.wall_s:.2f} tok/s  {ref.text[:80]!r}", flush=True)
        for m in modes:
            res = Engine(verifier, drafters[m]).generate(prompt, max_new_tokens=args.max_new)
            r = rows[m]
            r["tokens"] += res.stats.new_tokens
            r["steps"] += res.stats.steps
            r["wall"] += res.stats.wall_s
            r["draft_s"] += res.stats.draft_s
            r["verify_s"] += res.stats.verify_s
            same = res.token_ids == ref.token_ids
            r["identical"] += same
            if not same:
                j = next((k for k, (a, b) in enumerate(zip(res.token_ids, ref.token_ids)) if a != b),
                         min(len(res.token_ids), len(ref.token_ids)))
                margin = top2_margin(model, ref.prompt_ids + ref.token_ids[:j])
                r["divergences"].append({"prompt": i, "position": j, "plain_top2_margin": margin})
            print(f"[prompt {i}] {m}: tau {res.stats.new_tokens / res.stats.steps:.2f}, "
                  f"{res.stats.new_tokens / res.stats.wall_s:.2f} tok/s, identical={same}", flush=True)
    print("\nmode       tokens/step (mean tau, plain = 1.00)   tok/s   speedup   identical   draft ms/step")
    base = rows["plain"]["tokens"] / rows["plain"]["wall"]
    for name, r in rows.items():
        tps = r["tokens"] / r["wall"]
        ident = f"{r['identical']}/{args.prompts}" if name != "plain" else "-"
        dms = 1000 * r["draft_s"] / r["steps"] if name != "plain" else 0.0
        print(f"{name:<10} {r['tokens'] / r['steps']:>8.2f} {tps:>28.2f} {tps / base:>8.2f}x {ident:>10} {dms:>12.1f}")
        for d in r.get("divergences", []):
            print(f"    divergence: {d}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
