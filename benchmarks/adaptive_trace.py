"""Why the adaptive allocator drafts what it drafts: requests served one at a time through ``metasd serve``'s scheduler
(built from a pool file as the server builds it), each step's decision printed - the width chosen, the arm, the nodes
drafted and accepted, the expected goodput per candidate width (``AdaptiveRecord.table``, in plain steps' units) - and
after each request the arm's acceptance curve on its grid and the drafting prices learnt per load level and budget.

    python benchmarks/adaptive_trace.py --pool configs/pools/serve_adaptive.yaml --categories coding math \\
        --per-group 6 --requests 2 --warmup --threads 2

``--warmup`` first sends ``serve_load.py``'s warm-up request (``Say hi.``, 8 tokens), as the load benchmark does.
In-process, one thread set by ``--threads``: run it alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import WARMUP, load_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", default="configs/pools/serve_adaptive.yaml")
    p.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--groups", nargs="+")
    p.add_argument("--categories", nargs="+")
    p.add_argument("--requests", type=int, default=2, help="prompts served, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", action="store_true", help="first the load benchmark's 8-token warm-up request")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from metasd.core.batching.request_handle import SchedulerStep
    from metasd.serve.cli import PoolEngine, SchedulerSettings

    torch.set_num_threads(args.threads)
    questions = load_prompts(SimpleNamespace(questions=args.questions, groups=args.groups, per_group=args.per_group,
                                             categories=args.categories, copy_heavy=0))
    recipe = PoolEngine.from_file(args.pool, args.threads)
    config = recipe.check()
    if not config.serving.adaptive:
        p.error(f"{args.pool} does not set serving.adaptive")
    scheduler = SchedulerSettings(8, 64, False, config.serving.model_dump(), None).make(recipe())
    adaptive = scheduler.adaptive
    steps: list[SchedulerStep] = []
    scheduler.add_listener(lambda r: steps.append(r) if isinstance(r, SchedulerStep) else None)

    def learnt() -> str:
        curves = {k: [round(v, 2) for v in c.values().tolist()] for k, c in adaptive.curves.items()}
        grid = next(iter(adaptive.curves.values())).grid.tolist() if adaptive.curves else []
        prices = {k: {b: round(c, 3) for b, c in row.items()} for k, row in adaptive.draft_prices.to_dict().items()}
        return (f"  curves on grid {grid}: {json.dumps(curves)}\n  prices (one-token forwards): {json.dumps(prices)}\n"
                f"  catch-up per token: {json.dumps({k: round(v, 4) for k, v in adaptive.catch_up_rates.items()})}")

    try:
        if args.warmup:
            scheduler.submit(WARMUP.turns[0], 8, chat=True).result(timeout=600)
            print(f"after the warm-up:\n{learnt()}")
        for i, q in enumerate(questions[: args.requests]):
            steps.clear()
            result = scheduler.submit(q.turns[0], args.max_tokens, chat=True).result(timeout=3600)
            print(f"request {i} ({q.category} {q.question_id}): {len(result.token_ids)} tokens")
            for s in steps:
                if s.batch_size == 0 or s.adaptive is None:
                    continue
                r = s.requests[0]
                table = {w: round(g, 2) for w, g in sorted(s.adaptive.table.items())}
                print(f"  width {s.adaptive.width:2d} {r.drafter:11s} drafted {r.drafted:2d} accepted {r.accepted:2d} "
                      f"expected goodput by width {table}")
            print(learnt())
    finally:
        scheduler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
