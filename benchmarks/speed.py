"""Speed of metasd against plain decoding and transformers' assisted generation, in one process.

Every method decodes the same prompts (first turn of Spec-Bench questions, chat template), greedy, same
dtype, threads and max_new_tokens; the order of methods rotates from prompt to prompt so that drift of
the machine does not favour one method. Wall time includes the prefill.

transformers is timed twice where it matters: "as shipped", and "+fix" with metasd's LM-head stride fix
(``metasd.core.hooks.contiguous_lm_head_input``) applied to its models, because the slow path that fix avoids
also hits transformers' assistant and prefill forwards.

    python benchmarks/speed.py --per-group 2 --max-new-tokens 64 --out benchmarks/results/speed.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from metasd import Engine, Verifier
from metasd.bench import baselines
from metasd.config import resolve_drafter_class  # noqa: F401  (registers drafters)
from metasd.data import GROUP_ORDER, SPEC_BENCH_DEFAULT, load_questions
from metasd.drafters import NGramDrafter, PretrainedDrafter
from metasd.core.hooks import contiguous_lm_head_input, remove_lm_head_hook
from metasd.models import load_model


@contextmanager
def shipped(*models):
    """transformers as shipped: no metasd hook on the models inside the block."""
    for m in models:
        remove_lm_head_hook(m)
    try:
        yield
    finally:
        for m in models:
            contiguous_lm_head_input(m)


def sampling(args) -> dict:
    """Engine sampling arguments: greedy, or temperature T with a fixed seed (the same for every method)."""
    return {"temperature": args.temperature, "seed": args.seed} if args.temperature > 0 else {}


ENGINE_FIGURES = ("steps", "drafted", "accepted", "prefill_s", "draft_s", "verify_s", "drafter_counts")


def engine_figures(stats) -> dict:
    """What a metasd run adds to a row, from its request record: steps, drafted/accepted tokens, where the time went
    and each drafter's own counts (e.g. the hidden-state drafter's reused states)."""
    record = stats.to_record()
    return {key: record[key] for key in ENGINE_FIGURES}


def build_methods(args, vm, vt, dm, dt):
    """name -> callable(prompt_ids) -> (new_ids, seconds, mean_tokens_per_step or None, engine figures or None)."""
    verifier = Verifier(vm, vt, name=args.verifier)

    def engine_method(drafter):
        engine = Engine(verifier, drafter)

        def run(ids):
            r = engine.generate(ids, max_new_tokens=args.max_new_tokens, **sampling(args))
            return r.token_ids, r.stats.wall_s, r.stats.mean_tokens_per_step, engine_figures(r.stats)
        return run

    def hf(fn, *models, fix=True):
        def run(ids):
            if fix:
                out, s = fn(ids)
            else:
                with shipped(*models):
                    out, s = fn(ids)
            return out, s, None, None
        return run

    n = args.max_new_tokens
    if args.temperature > 0:  # sampled outputs differ by design: only metasd methods, compared by speed
        methods = {f"metasd 0.5B chain k={args.k}": engine_method(PretrainedDrafter(dm, dt, k=args.k, name="qwen0.5b"))}
    else:
        methods = {
            "plain (transformers)": hf(lambda ids: baselines.plain(vm, ids, n), vm, fix=False),
            "assisted 0.5B (transformers)": hf(lambda ids: baselines.assisted(vm, dm, ids, n), vm, dm, fix=False),
            "assisted 0.5B (transformers +fix)": hf(lambda ids: baselines.assisted(vm, dm, ids, n), vm, dm),
            "prompt lookup (transformers)": hf(lambda ids: baselines.prompt_lookup(vm, ids, n, 10), vm, fix=False),
            f"metasd 0.5B chain k={args.k}": engine_method(PretrainedDrafter(dm, dt, k=args.k, name="qwen0.5b")),
            "metasd n-gram": engine_method(NGramDrafter(k=10, n_max=3)),
        }
    from metasd.config import ModelCache, build_engine, read_pool_config

    cache = ModelCache(None)  # one cache for every extra pool: a quantized drafter is loaded once
    cache.put(args.verifier, args.dtype, (vm, vt), args.verifier_quantize)
    cache.put(args.drafter, args.dtype, (dm, dt))
    for q in args.plain_quantize or []:  # plain decoding of a quantized copy of the verifier (its own reference)
        qv, _ = cache.load(args.verifier, args.dtype, q)
        methods[f"plain {q} verifier (transformers +fix)"] = hf(lambda ids, qv=qv: baselines.plain(qv, ids, n), qv)
    if args.temperature == 0:
        for q in args.assistant_quantize or []:  # transformers' assisted generation with the same quantized assistant
            qm, _ = cache.load(args.drafter, args.dtype, q, drafter=True)  # the very model the pools' drafters use
            methods[f"assisted 0.5B {q} (transformers +fix)"] = hf(lambda ids, qm=qm: baselines.assisted(vm, qm, ids, n), vm, qm)
    for spec in args.extra_pool or []:
        name, path = spec.rsplit("=", 1)  # the name may hold "=" (k=5), a path rarely does
        cfg = read_pool_config(path)
        engine = build_engine(cfg, Path(path).resolve().parent, cache)

        def run(ids, engine=engine):
            r = engine.generate(ids, max_new_tokens=n, **sampling(args))
            return r.token_ids, r.stats.wall_s, r.stats.mean_tokens_per_step, engine_figures(r.stats)
        methods[name] = run
        if cfg.verifier.quantize != args.verifier_quantize:  # outputs are that quantized verifier's
            plain_q = f"plain {cfg.verifier.quantize} verifier (transformers +fix)"
            if plain_q not in methods:
                raise SystemExit(f"--extra-pool {name!r}: its verifier is {cfg.verifier.quantize}; add "
                                 f"--plain-quantize {cfg.verifier.quantize} for its reference")
            REFERENCE_OF[name] = plain_q
    return methods


#: method -> the method whose output it must reproduce (pools over a quantized verifier); others: plain bf16
REFERENCE_OF: dict[str, str] = {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (repeatable; default: Spec-Bench)")
    p.add_argument("--per-group", type=int, default=2)
    p.add_argument("--copy-heavy", type=int, default=0, metavar="N",
                   help="also N prompts per copy-heavy category (metasd.data.copy_heavy; generated from this Python)")
    p.add_argument("--oracle", action="append", metavar="PREFIX",
                   help="methods whose name starts with this are arms: report the per-group best of them (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--verifier", default="bundled:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="bundled:qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--verifier-quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the verifier: plain decoding and every method then run the "
                        "quantized verifier (extra pools must name the same verifier quantize)")
    p.add_argument("--plain-quantize", action="append", choices=["int8", "int4"],
                   help="also time plain decoding of the verifier quantized this way (pools over that verifier "
                        "load the same copy; their outputs are that model's, not the bf16 reference's)")
    p.add_argument("--assistant-quantize", action="append", choices=["int8", "int4"],
                   help="also time transformers' assisted generation with the 0.5B assistant quantized this way")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: metasd methods sample at this temperature (transformers methods are left out; the "
                        "plain greedy reference still gives the speedup denominator)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument("--only", action="append", help="run only methods whose name contains this")
    add_run_options(p, "benchmarks/results/speed.json")
    args = p.parse_args(argv)
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        rows = saved["rows"]
        oracle = args.oracle or saved["args"].get("oracle")
        print(summary_table(rows, oracle))
        if oracle and regret_table(rows, oracle):
            print()
            print(regret_table(rows, oracle))
        if any("steps" in e for r in rows for e in r["methods"].values()):
            print()
            print(steps_table(rows))
        if reuse_table(rows):
            print()
            print(reuse_table(rows))
        return 0
    torch.set_num_threads(args.threads)
    questions = [q for path in (args.questions or [str(SPEC_BENCH_DEFAULT)])
                 for q in load_questions(path, per_group=args.per_group)]
    if args.copy_heavy:
        from metasd.data.copy_heavy import build_copy_heavy

        questions += build_copy_heavy(args.copy_heavy)
    vm, vt = load_model(args.verifier, dtype=args.dtype, quantize=args.verifier_quantize)
    dm, dt = load_model(args.drafter, dtype=args.dtype)
    methods = build_methods(args, vm, vt, dm, dt)
    if args.only:
        methods = {k: v for k, v in methods.items() if any(o in k for o in args.only)}
    probe = Engine(Verifier(vm, vt), [])
    rows = resumed_rows(args, argv) if args.resume else []
    done_ids = {r["question_id"] for r in rows}
    warm = probe.encode([{"role": "user", "content": "Say hi."}])
    for fn in methods.values():  # warm-up: first calls allocate and tune kernels
        fn(warm[:])
    t_start = time.time()
    for qi, q in enumerate(questions):
        if q.question_id in done_ids:
            continue
        ids = probe.encode([{"role": "user", "content": q.turns[0]}])
        ref_ids, ref_s, margins = baselines.plain_with_margins(vm, ids, args.max_new_tokens)  # plain (+fix): reference
        row = {"question_id": q.question_id, "category": q.category, "group": q.group, "prompt_tokens": len(ids),
               "methods": {"plain (transformers +fix)": {"tokens": len(ref_ids), "seconds": ref_s, "identical": True}}}
        names = list(methods)
        names = names[qi % len(names):] + names[:qi % len(names)]  # rotate the order
        outs = {"plain (transformers +fix)": ref_ids}
        for name in names:
            out, seconds, tps, figures = methods[name](ids)
            outs[name] = out
            row["methods"][name] = {"tokens": len(out), "seconds": seconds, "mean_tokens_per_step": tps, **(figures or {})}
        for name in names:  # identity against each method's reference (known once every method has run)
            entry, reference = row["methods"][name], REFERENCE_OF.get(name, "plain (transformers +fix)")
            div = baselines.first_divergence(outs[name], outs[reference])
            entry["identical"] = div is None and len(outs[name]) == len(outs[reference]) if args.temperature == 0 else None
            if reference != "plain (transformers +fix)":
                entry["reference"] = reference  # no margins recorded for quantized references
            elif div is not None and args.temperature == 0:
                entry["first_divergence"] = div
                entry["plain_top2_margin_at_divergence"] = margins[div] if div < len(margins) else None
        rows.append(row)
        write_result(args, argv, rows, t_start)  # after every prompt: an interrupted run keeps what finished
        done = ", ".join(f"{k.split(' (')[0][:18]} {v['tokens'] / v['seconds']:.2f}" for k, v in row["methods"].items())
        print(f"[{qi + 1}/{len(questions)} {q.group}] tok/s: {done}", flush=True)
    print(summary_table(rows, args.oracle))
    if args.oracle and regret_table(rows, args.oracle):
        print()
        print(regret_table(rows, args.oracle))
    print()
    print(steps_table(rows))
    if reuse_table(rows):
        print()
        print(reuse_table(rows))
    return 0


def add_run_options(p: argparse.ArgumentParser, out: str) -> None:
    """The options the benchmark scripts share: extra pools, the results file, printing an earlier run, resuming."""
    p.add_argument("--extra-pool", action="append", help="NAME=pool.yaml: also time this pool (shares loaded models)")
    p.add_argument("--out", default=out, help="the results file (JSON, rewritten after every prompt)")
    p.add_argument("--table", metavar="RESULT_JSON", help="only print the tables of an earlier run")
    p.add_argument("--resume", action="store_true",
                   help="keep the prompts an interrupted run with the same command already wrote to --out")


def resumed_rows(args, argv) -> list[dict]:
    """Rows an interrupted run of the same command wrote to --out (none when the file is missing)."""
    out = Path(args.out)
    if not out.exists():
        return []
    saved = json.loads(out.read_text())
    ours = {k: v for k, v in vars(args).items() if k != "resume"}
    theirs = {k: v for k, v in saved["args"].items() if k != "resume"}
    if ours != theirs:
        changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise SystemExit(f"error: --resume: {out} was written with other arguments ({', '.join(changed)})")
    print(f"resuming: {len(saved['rows'])} prompts already in {out}", flush=True)
    return saved["rows"]


def write_result(args, argv, rows, t_start) -> None:
    result = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "args": vars(args), "wall_s": time.time() - t_start, "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


def summary_table(rows, oracle: list[str] | None = None) -> str:
    """Markdown: tokens/s (total tokens / total seconds) per group, speedup over plain (+fix), identity (with
    the method's own reference: plain bf16, or plain decoding of the same quantized verifier)."""
    methods = list(rows[0]["methods"])
    groups = [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)]

    def rate(name, rs):
        toks = sum(r["methods"][name]["tokens"] for r in rs)
        secs = sum(r["methods"][name]["seconds"] for r in rs)
        return toks / secs

    ref = "plain (transformers +fix)"
    assisted = "assisted 0.5B (transformers)"  # absent under --temperature
    lines = ["| method | tok/s overall | speedup | vs assisted | " + " | ".join(groups) +
             " | mean tokens/step | identical to plain | plain's top-2 logit margin at each first divergence |",
             "|" + "---|" * (7 + len(groups))]
    for m in methods:
        overall = rate(m, rows)
        cells = [f"{rate(m, [r for r in rows if r['group'] == g]) / rate(ref, [r for r in rows if r['group'] == g]):.2f}"
                 for g in groups]
        tps = [r["methods"][m].get("mean_tokens_per_step") for r in rows]
        tps = f"{statistics.mean(tps):.2f}" if all(t is not None for t in tps) else "-"
        flags = [r["methods"][m]["identical"] for r in rows]
        same = "-" if None in flags else f"{sum(flags)}/{len(rows)}"
        margins = [r["methods"][m].get("plain_top2_margin_at_divergence") for r in rows if r["methods"][m]["identical"] is False]
        margins = ", ".join("?" if x is None else f"{x:g}" for x in margins) or "-"
        vs_assisted = f"{overall / rate(assisted, rows):.2f}" if assisted in methods else "-"
        lines.append(f"| {m} | {overall:.2f} | {overall / rate(ref, rows):.2f}x | {vs_assisted} | " + " | ".join(cells) +
                     f" | {tps} | {same} | {margins} |")
    arms = [m for m in methods if any(m.startswith(p) for p in oracle or [])]
    if arms:  # per group, the arm that was fastest there, in hindsight: the mix a perfect per-category choice gets
        best = {g: max(arms, key=lambda m: rate(m, [r for r in rows if r["group"] == g])) for g in groups}
        tokens = {g: sum(r["methods"][best[g]]["tokens"] for r in rows if r["group"] == g) for g in groups}
        seconds = {g: sum(r["methods"][best[g]]["seconds"] for r in rows if r["group"] == g) for g in groups}
        overall = sum(tokens.values()) / sum(seconds.values())
        cells = [f"{tokens[g] / seconds[g] / rate(ref, [r for r in rows if r['group'] == g]):.2f} ({best[g]})" for g in groups]
        lines.append(f"| oracle: best arm per group | {overall:.2f} | {overall / rate(ref, rows):.2f}x | - | "
                     + " | ".join(cells) + " | - | - | - |")
    return "\n".join(lines)


def regret_table(rows, oracle: list[str]) -> str:
    """Markdown, MetaSD-style: for every method that is not an arm (pools, fused drafters), per group its speedup over
    plain decoding and its regret against the per-group best arm: 1 - its tok/s / the best arm's (negative: it beat
    every arm there)."""
    methods = list(rows[0]["methods"])
    arms = [m for m in methods if any(m.startswith(p) for p in oracle)]
    others = [m for m in methods if m not in arms and "steps" in rows[0]["methods"][m]]
    groups = [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)]
    if not arms or not others:
        return ""

    def rate(name, rs):
        return sum(r["methods"][name]["tokens"] for r in rs) / sum(r["methods"][name]["seconds"] for r in rs)

    ref = "plain (transformers +fix)"
    by_group = {g: [r for r in rows if r["group"] == g] for g in groups}
    best = {g: max(rate(a, by_group[g]) for a in arms) for g in groups}
    tokens = {g: sum(r["methods"][ref]["tokens"] for r in by_group[g]) for g in groups}
    oracle_overall = sum(tokens.values()) / sum(tokens[g] / best[g] for g in groups)  # the oracle's mix
    best_arm_overall = max(rate(a, rows) for a in arms)
    lines = ["| method | overall: speedup, regret vs oracle, vs best single arm | " + " | ".join(groups) + " |",
             "|" + "---|" * (2 + len(groups))]
    for m in others:
        cells = [f"{rate(m, by_group[g]) / rate(ref, by_group[g]):.2f}x, {1 - rate(m, by_group[g]) / best[g]:+.0%}"
                 for g in groups]
        overall = rate(m, rows)
        lines.append(f"| {m} | {overall / rate(ref, rows):.2f}x, {1 - overall / oracle_overall:+.0%}, "
                     f"{overall / best_arm_overall - 1:+.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steps_table(rows) -> str:
    """Markdown, metasd methods only: tokens per step (all tokens / all steps) overall and per group,
    accepted drafts per step and the drafter's share of the decoding time (prefill excluded)."""
    methods = [m for m in rows[0]["methods"] if "steps" in rows[0]["methods"][m]]
    groups = [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)]

    def tau(name, rs):
        return sum(r["methods"][name]["tokens"] for r in rs) / max(sum(r["methods"][name]["steps"] for r in rs), 1)

    lines = ["| method | tokens/step | accepted drafts/step | " + " | ".join(groups) + " | draft time share |",
             "|" + "---|" * (4 + len(groups))]
    for m in methods:
        e = [r["methods"][m] for r in rows]
        steps = sum(x["steps"] for x in e)
        decode = sum(x["seconds"] - x["prefill_s"] for x in e)
        cells = [f"{tau(m, [r for r in rows if r['group'] == g]):.2f}" for g in groups]
        lines.append(f"| {m} | {tau(m, rows):.2f} | {sum(x['accepted'] for x in e) / max(steps, 1):.2f} | "
                     + " | ".join(cells) + f" | {sum(x['draft_s'] for x in e) / decode:.0%} |")
    return "\n".join(lines)


def reuse_table(rows) -> str:
    """Markdown, drafters that count reused states (hidden-state drafter): per drafted step, the depth states
    taken from an earlier draft, the drafter's layer forwards, and the share of steps that refreshed."""
    lines = []
    for m in rows[0]["methods"]:
        per = [r["methods"][m].get("drafter_counts") or {} for r in rows]
        for d in sorted({name for c in per for name, v in c.items() if "reused_states" in v}):
            tot = {k: sum(c.get(d, {}).get(k, 0) for c in per) for k in ("steps", "reused_states", "drafter_forwards", "refreshed")}
            steps = max(tot["steps"], 1)
            lines.append(f"| {m} | {d} | {tot['steps']} | {tot['reused_states'] / steps:.2f} | "
                         f"{tot['drafter_forwards'] / steps:.2f} | {tot['refreshed'] / steps:.0%} |")
    if not lines:
        return ""
    return "\n".join(["| method | drafter | drafted steps | reused states/step | layer forwards/step | steps refreshed |",
                      "|---|---|---|---|---|---|"] + lines)


if __name__ == "__main__":
    sys.exit(main())
