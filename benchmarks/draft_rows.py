"""What one batched drafter forward costs by rows and tokens (docs/architecture.md#batched-drafting): the bundled
0.5B drafter's ``run_group`` over B rows of q tokens each, every row after its own cache of ~``--prefix`` tokens (rows
of different lengths, as running requests have), against the same feeds one row at a time. It says what a drafting
level of B requests costs against B levels alone, and what the batched path pays for keeping each row's cache apart
(a forward of B rows of one token concatenates their caches; one row of B tokens reads one cache).

    python benchmarks/draft_rows.py --quantize int4 --threads 2
    python benchmarks/draft_rows.py --quantize none --dtype bfloat16 --threads 2

Medians [min, max] of ``--repeats`` forwards after two warm-ups, each cropped back to its prefix. Run it alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPES = [(1, 1), (1, 4), (1, 16), (2, 1), (4, 1), (4, 4), (8, 1), (8, 2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled:qwen2.5-coder-0.5b-instruct")
    p.add_argument("--quantize", default="int4")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix", type=int, default=150)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)

    import torch

    from metasd.core.execution.draft_batch import Feed, run_group
    from metasd.core.execution.static_cache import new_cache
    from metasd.models import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
    vocab = model.config.vocab_size

    def caches(B: int) -> list:
        out = []
        for b in range(B):
            c = new_cache(model)
            with torch.inference_mode():
                model(input_ids=torch.randint(0, min(vocab, 1000), (1, args.prefix + 7 * b)), past_key_values=c,
                      use_cache=True)
            out.append(c)
        return out

    def timed(B: int, q: int, together: bool) -> list[float]:
        cs = caches(B)
        lengths = [c.get_seq_length() for c in cs]
        times = []
        for _ in range(args.repeats + 2):
            for c, n in zip(cs, lengths):
                c.set_length(n)
            feeds = [Feed(model, None, c, [(200 + i) % vocab for i in range(q)]) for c in cs]
            t0 = time.perf_counter()
            with torch.inference_mode():
                if together and B > 1:
                    run_group(feeds)
                else:
                    for f in feeds:
                        f.run()
            times.append(time.perf_counter() - t0)
        return times[2:]

    rows = []
    for B, q in SHAPES:
        row = {"rows": B, "tokens_per_row": q}
        for key, together in (("together_ms", True), ("one_by_one_ms", False)):
            ts = [t * 1e3 for t in timed(B, q, together)]
            row[key] = [statistics.median(ts), min(ts), max(ts)]
            if B == 1:
                break
        rows.append(row)
        print(json.dumps({k: ([round(x, 1) for x in v] if isinstance(v, list) else v) for k, v in row.items()}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "model": args.model, "quantize": args.quantize,
                       "dtype": str(model.dtype), "threads": args.threads, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
