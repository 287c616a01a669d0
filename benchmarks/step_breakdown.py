"""Where a serving scheduler's time goes: prefill, drafting, verification - in-process, per concurrency level.

``serve_load.py`` measures what a client sees over HTTP; this script says why. It builds the scheduler exactly as
``metasd serve`` does (the pool file's engine, its ``serving`` section - adaptive speculation, the profiled forward
cost - through ``SchedulerSettings``), keeps one scheduler for every level (as one server does), submits ``c``
requests at once at each level and times the scheduler's three phases by wrapping them:

- ``prefill``: ``Scheduler._prefill`` (joining requests' prompt chunks),
- ``draft``: ``Scheduler._draft`` (arm selection, the allocator, every request's ``propose``),
- ``verify``: ``BatchVerifier.verify`` (the one batched forward),

the rest of the level's wall time being commits, acceptance, events and idle waits (``other``). It also reports the
steps, the mean padded forward tokens, the adaptive widths chosen, each arm's share of the request-steps and the
request-steps drafted with lookups alone (``serving.defer_catch_up``), and, for an adaptive pool, the learnt drafting
prices at the end of the level.

    python benchmarks/step_breakdown.py --pool configs/pools/serve_adaptive.yaml --concurrency 1 2 4 8 16 \\
        --groups MT QA math translation --copy-heavy 1 --max-tokens 16 --threads 1 --out step_breakdown.json
    python benchmarks/step_breakdown.py --pool configs/pools/serve_adaptive.yaml --off ...   # speculation off
    python benchmarks/step_breakdown.py ... --warmup 1 --trace steps.jsonl   # as a server sees it; every step's choice

One process, one thread by default: run it alone on the machine (docs: BENCHMARKS.md, "How we measure").
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import load_prompts, percentile, requests_for  # noqa: E402

PHASES = ("prefill", "draft", "verify")


class PhaseTimer:
    """Seconds spent in each phase of a scheduler (wraps ``_prefill``, ``_draft`` and its verifier's ``verify`` on
    the instance) and the ``SchedulerStep`` records it sends its listeners; ``take()`` returns both and clears them."""

    def __init__(self, scheduler):
        from metasd.core.batching.request_handle import SchedulerStep

        self.totals: dict[str, float] = collections.defaultdict(float)
        self.steps: list[SchedulerStep] = []
        for phase, owner, name in (("prefill", scheduler, "_prefill"), ("draft", scheduler, "_draft"),
                                   ("verify", scheduler.verifier, "verify")):
            setattr(owner, name, self._timed(getattr(owner, name), phase))
        scheduler.add_listener(lambda r: self.steps.append(r) if isinstance(r, SchedulerStep) else None)

    def _timed(self, fn, phase: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0
        return timed

    def take(self) -> tuple[dict[str, float], list]:
        """(seconds per phase, the steps) since the last ``take``."""
        out, steps = {p: self.totals.get(p, 0.0) for p in PHASES}, self.steps
        self.totals.clear()
        self.steps = []
        return out, steps


def run_level(scheduler, timer: PhaseTimer, prompts: list[str], c: int, max_tokens: int, speculate: bool,
              first: int = 0, n: int | None = None) -> dict:
    """Submit ``c`` requests at once (prompts in turn from index ``first``), wait for all; the level's breakdown as
    a dict. With ``n`` (> c): ``n`` requests with exactly ``c`` in flight, a request sent when one finishes - the shape
    of a ``serve_load.py`` level (prompts from index ``first``) - and each request's send and end times in the row."""
    from concurrent.futures import ThreadPoolExecutor

    from metasd.core.batching.request_handle import RequestOptions

    n = c if n is None else n
    timer.take()
    t0 = time.perf_counter()
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def send(i: int):
        return time.perf_counter() - t0, scheduler.submit(prompts[(first + i) % len(prompts)], max_tokens, chat=True,
                                                          options=RequestOptions(speculate=speculate))

    def wait(i: int, sent_handle=None):
        sent, handle = sent_handle or send(i)
        result = handle.result(timeout=3600)
        spans[i] = (sent, time.perf_counter() - t0)
        return result

    if n == c:  # all at once: submitted under the scheduler's lock (older checkouts: none), so one step meets all c
        with getattr(scheduler, "_lock", contextlib.nullcontext()):
            sent = [send(i) for i in range(c)]
        with ThreadPoolExecutor(max_workers=c) as pool:
            results = list(pool.map(wait, range(c), sent))
    else:
        with ThreadPoolExecutor(max_workers=c) as pool:  # c workers: exactly c requests in flight until n are sent
            results = list(pool.map(wait, range(n)))
    wall = time.perf_counter() - t0
    phases, steps = timer.take()
    decode = [s for s in steps if s.batch_size > 0]
    tokens = sum(len(r.token_ids) for r in results)
    arms = collections.Counter(r.drafter for s in decode for r in s.requests)
    widths = collections.Counter(s.adaptive.width for s in decode if s.adaptive is not None)
    adaptive = scheduler.adaptive
    return {
        "concurrency": c, "requests": n, "tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
        "steps": len(decode), "prefill_only_steps": len(steps) - len(decode),
        **{f"{p}_s": phases[p] for p in PHASES}, "other_s": max(wall - sum(phases.values()), 0.0),
        "mean_forward_tokens": statistics.fmean(s.forward_tokens for s in decode) if decode else 0.0,
        "arm_steps": dict(arms), "widths": {str(w): n for w, n in sorted(widths.items())},
        # request-steps drafted with the arm's lookups alone (serving.defer_catch_up; older checkouts: no options)
        "lookup_only_steps": sum(o > 0 for s in decode if s.adaptive is not None
                                 for o in getattr(s.adaptive, "options", [])),
        "draft_costs": dict(adaptive.draft_costs) if adaptive is not None else None,
        # per load level and node budget: what the allocator charges (older checkouts: none)
        "draft_prices": adaptive.draft_prices.to_dict() if getattr(adaptive, "draft_prices", None) else None,
        # getattr: the script also times older checkouts (METASD_ROOT), whose scheduler had no catch-up rates
        "catch_up_rates": dict(getattr(adaptive, "catch_up_rates", {})) if adaptive is not None else None,
        "calibration": calibration(decode, getattr(adaptive, "unit_seconds", None)),
        # inter-token latency per token, as serve_load.py counts it (in-process: the steps' seconds), and its tail
        **latency(steps),
        # per request, in send order: its prompt's index, seconds from the level's start to its send and its end,
        # tokens and steps (the level's wall time is its last end)
        "request_spans": [{"prompt": (first + i) % len(prompts), "sent_s": a, "end_s": b,
                           "tokens": len(r.token_ids), "steps": r.stats.steps}
                          for i, ((a, b), r) in enumerate(zip(spans, results))],
    }


def itl_samples(steps: list) -> list[float]:
    """Per-token inter-token latencies of the requests in ``steps`` (``SchedulerStep`` records in order, prefill-only
    steps included), as ``serve_load.py`` counts them from a stream: for every commit of a request after its first,
    the seconds of the steps since its previous commit over the tokens committed, once per token."""
    gap: dict[str, float] = {}  # request id -> seconds since its last commit
    out: list[float] = []
    for s in steps:
        for rid in gap:
            gap[rid] += s.seconds
        for r in s.requests:
            if r.committed > 0:
                if r.id in gap:
                    out += [gap[r.id] / r.committed] * r.committed
                gap[r.id] = 0.0
    return out


def latency(steps: list) -> dict:
    """The level's ITL p50 / p99 (``itl_samples``), its longest step and, with adaptive speculation, its probes: how
    many, their seconds and batch sizes (a probe is a gap in every running request's stream)."""
    itl = itl_samples(steps)
    probes = [s for s in steps if s.adaptive is not None and getattr(s.adaptive, "probe", False)]
    return {"itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "step_s_max": max((s.seconds for s in steps), default=0.0),
            "probes": [{"batch": s.batch_size, "seconds": s.seconds, "width": s.adaptive.width} for s in probes]}


def trace_steps(scheduler, path: Path, timer: "PhaseTimer | None" = None) -> None:
    """Append one JSON line per decode step to ``path`` (emptied first): the step's batch, seconds and forward tokens,
    its ``AdaptiveRecord`` (width, nodes, expected goodput per width, whether a probe made it), each request's drafter,
    drafted, accepted and committed tokens and, for an adaptive pool, the learnt acceptance curves and drafting prices
    as they stand after the step - what the allocator reads next. For finding why a run chose the widths it did."""
    import dataclasses

    from metasd.core.batching.request_handle import SchedulerStep

    path.write_text("")
    adaptive = scheduler.adaptive
    seen = dict.fromkeys(PHASES, 0.0)  # the timer's totals at the last step: each step's own seconds per phase

    def write(event) -> None:
        if not isinstance(event, SchedulerStep):
            return
        own = {}  # the step's seconds in prefill, drafting (a first draft reads its prompt) and verification
        if timer is not None:
            totals = {k: timer.totals.get(k, 0.0) for k in PHASES}
            own = {f"{k}_s": totals[k] - seen[k] if totals[k] >= seen[k] else totals[k] for k in PHASES}  # take()
            seen.update(totals)  # clears the totals between levels
        if event.batch_size == 0:
            return
        line = {"batch": event.batch_size, "seconds": event.seconds, "forward_tokens": event.forward_tokens,
                "prefill_tokens": event.prefill_tokens, **own,
                "requests": [{"id": r.id, "drafter": r.drafter, "drafted": r.drafted, "accepted": r.accepted,
                              "committed": r.committed} for r in event.requests],
                "adaptive": dataclasses.asdict(event.adaptive) if event.adaptive is not None else None}
        if adaptive is not None:
            line["curves"] = {k: c.values().round(3).tolist() for k, c in adaptive.curves.items()}
            line["draft_prices"] = adaptive.draft_prices.to_dict()
            line["forward_ratios"] = dict(adaptive.forward_ratios)
            ratios = getattr(adaptive, "ratios", None)  # per level and token bucket (older checkouts: none)
            if ratios is not None:
                line["forward_ratios_by_tokens"] = {lv: dict(b) for lv, b in ratios.by_level.items()}
        with path.open("a") as f:
            f.write(json.dumps(line, default=float) + "\n")

    scheduler.add_listener(write)


def calibration(steps: list, unit_seconds: float | None) -> dict | None:
    """How the allocator's model of a step compares with the step it ran: per step with an adaptive record, the
    goodput it expected of its allocation (``AdaptiveRecord.goodput``: committed tokens per one-token forward of the
    profile) against the goodput the step realized (tokens committed over its wall seconds in the same units), split
    by steps that drafted nothing (width 0: the model is the profile's forward cost alone) and steps that drafted
    (acceptance curves and drafting prices too). A realized / expected ratio lower for plain steps than for drafting
    ones means the model underrates drafting. Each side apart where the record has the expected tokens: the tokens
    committed over those expected (the acceptance curves' error) and the step's seconds over its modeled cost (the
    forward profile's and the drafting prices' error, and the work outside them). None without an adaptive pool or a
    unit."""
    if not unit_seconds:
        return None
    out: dict[str, dict] = {}
    for kind in ("plain", "drafting"):
        rows = [s for s in steps if s.adaptive is not None and (s.adaptive.width > 0) == (kind == "drafting")]
        if not rows:
            continue
        ratios = [sum(r.committed for r in s.requests) / (s.seconds / unit_seconds) / s.adaptive.goodput
                  for s in rows if s.seconds > 0 and s.adaptive.goodput > 0]
        # the goodput's two sides apart (older checkouts record no expected tokens): tokens committed over expected,
        # and the step's seconds (in one-token forwards) over its modeled cost, tokens / goodput
        known = [s for s in rows if getattr(s.adaptive, "tokens", 0) > 0 and s.adaptive.goodput > 0]
        tokens = [sum(r.committed for r in s.requests) / s.adaptive.tokens for s in known]
        costs = [(s.seconds / unit_seconds) / (s.adaptive.tokens / s.adaptive.goodput) for s in known]
        out[kind] = {"steps": len(rows), "realized_over_expected_p50": statistics.median(ratios) if ratios else None,
                     "tokens_realized_over_expected_p50": statistics.median(tokens) if tokens else None,
                     "cost_realized_over_expected_p50": statistics.median(costs) if costs else None,
                     "expected_goodput_mean": statistics.fmean(s.adaptive.goodput for s in rows),
                     "seconds_mean": statistics.fmean(s.seconds for s in rows),
                     "committed_mean": statistics.fmean(sum(r.committed for r in s.requests) for s in rows),
                     "batch_mean": statistics.fmean(s.batch_size for s in rows)}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| c | tok/s | steps | prefill s | draft s | verify s | other s | forward tokens | widths |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        widths = ", ".join(f"{w}: {n}" for w, n in r["widths"].items()) or "-"
        lines.append(f"| {r['concurrency']} | {r['output_tok_s']:.2f} | {r['steps']} | {r['prefill_s']:.1f} | "
                     f"{r['draft_s']:.1f} | {r['verify_s']:.1f} | {r['other_s']:.1f} | "
                     f"{r['mean_forward_tokens']:.1f} | {widths} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", help="pool file (default: the embedded default pool)")
    p.add_argument("--off", action="store_true", help="every request with speculation off")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (repeatable; default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=1)
    p.add_argument("--groups", nargs="+", help="only these Spec-Bench groups (default: all)")
    p.add_argument("--categories", nargs="+", help="only these Spec-Bench categories (e.g. coding math)")
    p.add_argument("--copy-heavy", type=int, default=0, metavar="N", help="also N prompts per copy-heavy category")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--cost-profile", help="a saved ForwardProfile JSON instead of profiling (as metasd serve's)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--requests-per-c", type=int, metavar="K",
                   help="serve_load.py's level shape: whole passes over the prompts making at least K x c requests, "
                        "c in flight, every level from the first prompt (default: c requests at once, the prompts "
                        "going round across levels)")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="N requests of 8 tokens ('Say hi.', serve_load.py's warm-up) before the first level, untimed")
    p.add_argument("--trace", help="write one JSON line per step here: the allocation (width, nodes, expected "
                   "goodput per width), what each request drafted, accepted and committed, and for an adaptive pool "
                   "the acceptance curves and drafting prices after the step")
    args = p.parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.max_tokens < 1 or (args.requests_per_c or 1) < 1:
        p.error("--concurrency, --max-tokens and --requests-per-c must be >= 1")

    from metasd.serve.cli import PoolEngine, SchedulerSettings, read_cost_profile

    questions = load_prompts(SimpleNamespace(questions=args.questions, groups=args.groups, per_group=args.per_group,
                                             categories=args.categories, copy_heavy=args.copy_heavy))
    prompts = [q.turns[0] for q in questions]
    recipe = PoolEngine.from_file(args.pool, args.threads)
    config = recipe.check()  # a bad pool file fails here, before any model loads
    serving = config.serving.model_dump() if config.serving.adaptive else None
    settings = SchedulerSettings(max(args.concurrency), 64, False, serving,
                                 read_cost_profile(args.cost_profile, config))
    scheduler = settings.make(recipe())
    timer = PhaseTimer(scheduler)
    if args.trace:
        trace_steps(scheduler, Path(args.trace), timer)
    rows = []
    try:
        for _ in range(args.warmup):  # what serve_load.py sends each server first: the scheduler learns from it too
            scheduler.submit("Say hi.", 8, chat=True).result(timeout=3600)
        timer.take()
        sent = 0  # the prompts go round across levels: level after level, every prompt gets its turn
        for c in args.concurrency:
            if args.requests_per_c:  # as serve_load.py: n requests through c slots, from the first prompt
                n = requests_for(c, len(prompts), None, args.requests_per_c)
                rows.append(run_level(scheduler, timer, prompts, c, args.max_tokens, not args.off, first=0, n=n))
            else:
                rows.append(run_level(scheduler, timer, prompts, c, args.max_tokens, not args.off, first=sent))
            sent += c
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}),
                  flush=True)
    finally:
        scheduler.close()
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "pool": args.pool,
                                              "off": args.off, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
