"""Sanity run of the block drafter on the bundled verifier: tokens per step and identity with plain decoding.

nice -n 19 python experiments/block/sanity.py [--ckpt checkpoints/block/qwen1.5b] [--max-new-tokens 48]
Greedy, bf16, 2 threads. Mean tokens per step includes the bonus token (plain decoding = 1.00).
Where an output differs from plain decoding, prints the first divergence and plain decoding's top-two
logit margin there (bf16 near-ties flip; see docs/models.md#bf16-and-greedy-identity).
"""
import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from metasd.drafters.block import BlockDrafter, BlockHeads
from metasd.core.engine import Engine
from metasd.models import load_model
from metasd.core.execution.verifier import Verifier

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain the difference between a list and a tuple in Python, with a short example of each.",
]


def margin_at(model, ids):
    with torch.inference_mode():
        top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="checkpoints/block/qwen1.5b")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--arms", default="none-chain,none-p4,ngram-p4")
    ap.add_argument("--refs", default=None, help="json file caching plain decoding's outputs (read if present)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model, tok = load_model("bundled:qwen2.5-coder-1.5b-instruct", dtype="bf16")
    verifier = Verifier(model, tok, name="qwen2.5-coder-1.5b")
    heads = BlockHeads.load(args.ckpt, model.get_output_embeddings().weight, dtype=model.dtype)
    arms = {
        "none-chain": BlockDrafter(heads, refine="none", paths=1),
        "none-p4": BlockDrafter(heads, refine="none", paths=4),
        "ngram-p4": BlockDrafter(heads, refine="ngram", paths=4, verifier_tokenizer=tok),
    }
    arms = {k: v for k, v in arms.items() if k in args.arms.split(",")}
    prompts = PROMPTS[:args.prompts]
    print(f"loaded in {time.perf_counter() - t0:.0f}s", flush=True)
    plain = Engine(verifier, [])
    report = {}
    refs = []
    cached = {}
    if args.refs and Path(args.refs).is_file():
        cached = json.loads(Path(args.refs).read_text())
    t = time.perf_counter()
    for p in prompts:
        key = f"{args.max_new_tokens}:{p}"
        if key in cached:
            refs.append(SimpleNamespace(**cached[key]))
            continue
        r = plain.generate([{"role": "user", "content": p}], max_new_tokens=args.max_new_tokens)
        refs.append(r)
        cached[key] = {"prompt_ids": r.prompt_ids, "token_ids": r.token_ids}
    plain_s = time.perf_counter() - t
    if args.refs:
        Path(args.refs).write_text(json.dumps(cached))
    n_plain = sum(len(r.token_ids) for r in refs)
    all_cached = all(isinstance(r, SimpleNamespace) for r in refs)
    report["plain"] = {"tok_per_s": None if all_cached else n_plain / plain_s, "tokens_per_step": 1.0}
    print("plain: outputs from " + ("the cache" if all_cached else f"this run, {n_plain / plain_s:.2f} tok/s"), flush=True)
    for name, drafter in arms.items():
        eng = Engine(verifier, drafter)
        taus, identical, notes = [], [], []
        t = time.perf_counter()
        n = 0
        for p, ref in zip(prompts, refs):
            res = eng.generate([{"role": "user", "content": p}], max_new_tokens=args.max_new_tokens)
            taus.extend(res.stats.tokens_per_step)
            n += len(res.token_ids)
            same = res.token_ids == ref.token_ids
            identical.append(same)
            if not same:
                i = next(j for j, (a, b) in enumerate(zip(res.token_ids, ref.token_ids)) if a != b)
                notes.append(f"diverges at new token {i}; plain top-2 margin {margin_at(model, ref.prompt_ids + ref.token_ids[:i]):.4f}")
        s = time.perf_counter() - t
        report[name] = {"steps": len(taus), "tokens_per_step": sum(taus) / len(taus), "tok_per_s": n / s, "identical": identical, "notes": notes}
        print(f"{name}: mean tokens per step {sum(taus) / len(taus):.3f} (bonus included), {n / s:.2f} tok/s, "
              f"identical to plain {identical} {notes}", flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
