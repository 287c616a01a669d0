"""Log-probabilities under speculation against plain decoding's, on the real bundled pair in the dtype users run.

For each prompt: plain decoding (metasd's engine with no drafter: one token per forward) and the embedded default pool
(drafts verified as trees), both greedy with ``logprobs``; where the two outputs agree, the largest absolute
difference of the committed tokens' log-probabilities (and of the top-5 alternatives' values). In bf16 the tree verify
forward is not bit-identical to one-token forwards, so the numbers differ in the last bits; the target of issue "Serve
like the tools users already run" is 1e-2. Where the outputs diverge (a bf16 tie), only the common prefix is compared.

    python benchmarks/logprobs_check.py --threads 2 --out benchmarks/results/logprobs_check.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number iteratively.",
           "Explain what a KV cache is in two sentences.",
           "Translate to English: 'Der schnelle braune Fuchs springt über den faulen Hund.'",
           "List three prime numbers greater than 100 and say why each is prime."]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtype", help="the verifier's dtype instead of the pool's (e.g. bf16; 'auto' is fp32 on a CPU "
                                   "without native bf16)")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import torch

    import metasd
    from metasd.core.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    from metasd.config import default_pool_path, read_yaml_mapping

    overrides = None
    if args.dtype:
        raw = read_yaml_mapping(args.pool or default_pool_path(), "pool config")
        overrides = {"verifier": {**raw["verifier"], "dtype": args.dtype}}
    speculative = metasd.load_pool(args.pool, overrides)
    plain = Engine(speculative.verifier, None)
    rows = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        a = plain.generate(messages, args.max_new_tokens, logprobs=5)
        b = speculative.generate(messages, args.max_new_tokens, logprobs=5)
        common = 0
        while common < min(len(a.token_ids), len(b.token_ids)) and a.token_ids[common] == b.token_ids[common]:
            common += 1
        chosen = max((abs(x.logprob - y.logprob) for x, y in zip(a.logprobs[:common], b.logprobs[:common])),
                     default=0.0)
        top = max((abs(u - v) for x, y in zip(a.logprobs[:common], b.logprobs[:common])
                   for (_, u), (_, v) in zip(x.top, y.top)), default=0.0)
        rows.append({"prompt": prompt, "tokens": len(a.token_ids), "common_prefix": common,
                     "identical": a.token_ids == b.token_ids, "accepted": b.stats.accepted,
                     "max_abs_diff_chosen": chosen, "max_abs_diff_top5": top})
        print(f"{prompt[:50]!r}: identical {a.token_ids == b.token_ids} (common {common}/{len(a.token_ids)}), "
              f"max |diff| chosen {chosen:.2e}, top-5 {top:.2e}", flush=True)
    report = {"command": " ".join(["python benchmarks/logprobs_check.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "dtype": str(speculative.verifier.dtype), "threads": torch.get_num_threads(), "rows": rows,
              "max_abs_diff": max(max(r["max_abs_diff_chosen"], r["max_abs_diff_top5"]) for r in rows)}
    print(f"dtype {report['dtype']}: max |diff| {report['max_abs_diff']:.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
