"""Why the CPU reference run of ``gpu_overhead.py`` on the 1.5B shape stalled (a 3-token step took ~1.1 s against
~0.125 s for a one-token one): the experiment that tells the candidate causes apart, on the model as that version
built it (``init="hf"``: transformers' N(0, 0.02) init, tied head) and as it is built now (``init="decisive"``).

For each init: the greedy continuation by transformers' one-token decoding (the recording) with its top-2 margins;
then the same text teacher-forced through a KV cache in blocks of ``--block`` tokens (what a verify at
tokens/step ``block - 1`` forwards), counting the rows whose argmax differs from the recording (each one is where
the earlier replay drafter re-recorded ``depth + 64`` tokens inside the step, timed as verifier forwards); and the
time of a one-token and a ``block``-token forward over the same cache (is a multi-token forward itself slow?).

    python benchmarks/gpu_stall.py --shape 1.5b --new-tokens 48 --block 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout)
import torch
from transformers import DynamicCache

from gpu_overhead import SHAPES, build, record
from metasd.core.execution.kv_cache import cache_kwargs, crop_to


def run(shape: str, init: str, n: int, prompt_len: int, block: int, device, dtype) -> dict:
    t0 = time.perf_counter()
    model = build(shape, device, dtype, init=init)
    built = time.perf_counter() - t0
    prompt = torch.randint(1, SHAPES[shape]["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)
    t0 = time.perf_counter()
    reference, margins = record(model, prompt, n)
    per_token = (time.perf_counter() - t0) / n
    text = torch.cat([prompt[0], torch.tensor(reference, device=device)])
    cache = DynamicCache(config=model.config)
    model(input_ids=text[None, : prompt_len - 1], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    flips, rows, pos = [], 0, prompt_len - 1  # cache holds text[:pos]; a block forwards text[pos:pos+block]
    while pos + block <= len(text) - 1:
        logits = model(input_ids=text[None, pos: pos + block], **cache_kwargs(model, cache), use_cache=True).logits[0]
        got = logits.argmax(-1).tolist()
        for i, g in enumerate(got):  # row i predicts text[pos + i + 1]
            rows += 1
            if g != int(text[pos + i + 1]):
                flips.append(pos + i + 1 - prompt_len)
        pos += block
    crop_to(cache, prompt_len + 16)
    timings = {}
    for rows_fwd in (1, block):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            model(input_ids=text[None, prompt_len + 16: prompt_len + 16 + rows_fwd], **cache_kwargs(model, cache),
                  use_cache=True)
            ts.append(time.perf_counter() - t)
            crop_to(cache, prompt_len + 16)
        timings[f"forward_{rows_fwd}_rows_s"] = statistics.median(ts)
    return {"init": init, "build_s": built, "generate_s_per_token": per_token, "margins": margins,
            "block": block, "rows_checked": rows, "argmax_flips": len(flips), "flip_positions": flips[:20],
            **timings}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--inits", nargs="+", default=["hf", "decisive"])
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    out = {"shape": args.shape, "device": str(device), "threads": torch.get_num_threads(), "runs": []}
    with torch.inference_mode():
        for init in args.inits:
            r = run(args.shape, init, args.new_tokens, args.prompt_tokens, args.block, device, torch.bfloat16)
            print(json.dumps(r), file=sys.stderr, flush=True)
            out["runs"].append(r)
    text = json.dumps(out, indent=1)
    if args.out:
        open(args.out, "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
