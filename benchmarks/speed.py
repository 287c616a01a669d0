"""Speed of metasd against the strongest transformers baselines, in one process, repeated.

Every method decodes the same prompts (first turn of Spec-Bench questions, chat template), greedy, same dtype,
threads and max_new_tokens; wall time includes the prefill. The baselines every ratio is computed against are
transformers with metasd's LM-head stride fix (``metasd.core.execution.hooks.contiguous_lm_head_input``) on all its
models, the assistant included - as shipped, its assistant and prefill forwards take a slow path that copies the LM
head's weight (benchmarks/history.md: assisted generation 0.50x plain as shipped, 1.01x with the fix):

- ``plain (transformers +fix)``: ``model.generate`` of the verifier, the denominator of every speedup;
- ``assisted 0.5B (transformers +fix)``: transformers' assisted generation with the bf16 0.5B assistant;
- ``assisted 0.5B int4 (transformers +fix)`` (``--assistant-quantize int4``): the same with the very int4 0.5B
  model metasd's int4 pools draft with (``ModelCache.load(..., quantize="int4", drafter=True)``); transformers'
  assisted generation runs it as it is (its forwards only call the model; checked on Spec-Bench prompt 81, 8 new
  tokens: it runs and gives plain decoding's tokens);
- ``prompt lookup (transformers +fix)``: transformers' prompt lookup decoding, 10 tokens.

``--as-shipped`` adds plain, assisted and prompt lookup without the fix, labelled "(as shipped)"; no ratio is
computed against them.

Order and repeats. ``--repeats N`` (default 3) runs the whole prompt set N times, interleaved: repeat r times every
prompt before repeat r + 1 starts. Within one (prompt, repeat) every method, the plain reference included, is timed
in an order rotated by prompt index + repeat (``metasd.bench.stats.rotation``), so no method always runs first or
right after another. The reference output and plain decoding's top-two logit margins ("identical to plain", the
margin at a first divergence) come from a separate, untimed plain pass with ``output_logits=True``, once per prompt.

Statistics (``metasd.bench.stats``). Per repeat, a method's overall tokens/s (sum of tokens / sum of seconds over the
prompts) and its ratio to plain's in the same repeat; the tables give the median over repeats and the [min, max]
of those per-repeat ratios, per category the median ratio. "faster"/"slower" only where two methods' ranges of
per-repeat ratios do not overlap, else "within noise". Runs slower than 1.5x the median of the same (method,
prompt) over repeats with the same token count are listed by prompt.

    python benchmarks/speed.py --per-group 2 --max-new-tokens 64 --repeats 3 --out benchmarks/results/speed.json
    python benchmarks/speed.py --per-group 2 --copy-heavy 4 --max-new-tokens 64 --repeats 3 --assistant-quantize int4 \\
      --only plain --only assisted --only "prompt lookup" --only "pool " \\
      --extra-pool "pool default (cascade)=configs/default.yaml" \\
      --extra-pool "pool int4 tree=configs/pools/tree_int4_deep.yaml" \\
      --extra-pool "pool suffix=configs/pools/study_suffix.yaml" --out benchmarks/results/speed.json
    python benchmarks/speed.py --table benchmarks/results/speed.json   # the tables of an earlier run

(``--only`` filters extra pools too: name them so that an ``--only`` matches, as "pool " does here; plain
(transformers +fix) always runs.)

The JSON keeps one row per (prompt, repeat) (``repeat``, ``order``: the timing order, and per method tokens,
seconds, steps, accepted...) and ``references``: per prompt the untimed plain pass's token ids and margins.
``--resume`` keeps the (prompt, repeat) rows an interrupted run of the same command wrote; a larger ``--repeats``
with ``--resume`` adds repeats to a finished run.
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
from metasd.bench import stats
from metasd.config import resolve_drafter_class  # noqa: F401  (registers drafters)
from metasd.data import GROUP_ORDER, SPEC_BENCH_DEFAULT, load_questions
from metasd.drafters import NGramDrafter, PretrainedDrafter
from metasd.core.execution.hooks import contiguous_lm_head_input, remove_lm_head_hook
from metasd.models import load_model
from metasd.models.devices import cpu_has_native_bf16

PLAIN = "plain (transformers +fix)"
ASSISTED = "assisted 0.5B (transformers +fix)"
LOOKUP = "prompt lookup (transformers +fix)"
#: the baselines every table compares each method with, besides plain: (method name, short label)
COMPARE = ((ASSISTED, "assisted(+fix)"), (LOOKUP, "prompt lookup(+fix)"))
ORACLE = "oracle: best arm per group"


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


def hf(fn, *models, fix=True):
    """A transformers baseline as a method: ``fn(ids) -> (new ids, seconds)`` with the LM-head fix applied to
    ``models`` just before the call (idempotent; also reaches a head transformers replaced in place), or with
    ``fix=False`` as shipped."""
    def run(ids):
        if fix:
            for m in models:
                contiguous_lm_head_input(m)
            out, s = fn(ids)
        else:
            with shipped(*models):
                out, s = fn(ids)
        return out, s, None, None
    return run


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

    n = args.max_new_tokens
    # greedy plain decoding is the denominator in every case (under --temperature too: sampled metasd methods are
    # then compared by speed only)
    methods = {PLAIN: hf(lambda ids: baselines.plain(vm, ids, n), vm)}
    if args.temperature > 0:  # sampled outputs differ by design: only metasd methods besides the reference
        methods[f"metasd 0.5B chain k={args.k}"] = engine_method(PretrainedDrafter(dm, dt, k=args.k, name="qwen0.5b"))
    else:
        methods.update({
            ASSISTED: hf(lambda ids: baselines.assisted(vm, dm, ids, n), vm, dm),
            LOOKUP: hf(lambda ids: baselines.prompt_lookup(vm, ids, n, 10), vm),
            f"metasd 0.5B chain k={args.k}": engine_method(PretrainedDrafter(dm, dt, k=args.k, name="qwen0.5b")),
            "metasd n-gram": engine_method(NGramDrafter(k=10, n_max=3)),
        })
        if args.as_shipped:  # opt-in, never a denominator
            methods.update({
                "plain (as shipped)": hf(lambda ids: baselines.plain(vm, ids, n), vm, fix=False),
                "assisted 0.5B (as shipped)": hf(lambda ids: baselines.assisted(vm, dm, ids, n), vm, dm, fix=False),
                "prompt lookup (as shipped)": hf(lambda ids: baselines.prompt_lookup(vm, ids, n, 10), vm, fix=False),
            })
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
            methods[f"assisted 0.5B {q} (transformers +fix)"] = hf(lambda ids, qm=qm: baselines.assisted(vm, qm, ids, n),
                                                                   vm, qm)
    if args.no_drafter:  # metasd's engine around the verifier alone: its overhead over plain decoding
        methods["metasd engine, no drafter"] = engine_method([])
    if args.llama_cpp:
        methods.update(llama_cpp_methods(args, vt))
    for spec in args.extra_pool or []:
        name, path = spec.rsplit("=", 1)  # the name may hold "=" (k=5), a path rarely does
        cfg = read_pool_config(path)
        engine = build_engine(cfg, Path(path).resolve().parent, cache)

        def run(ids, engine=engine):
            r = engine.generate(ids, max_new_tokens=n, **sampling(args))
            return r.token_ids, r.stats.wall_s, r.stats.mean_tokens_per_step, engine_figures(r.stats)
        methods[name] = run
        if cfg.verifier.backend == "llama.cpp":  # outputs are llama.cpp's computation of the verifier
            if not args.llama_cpp:
                raise SystemExit(f"--extra-pool {name!r}: its verifier runs on llama.cpp; add --llama-cpp for its "
                                 "reference (llama.cpp's own plain decoding)")
            REFERENCE_OF[name] = LLAMA_PLAIN
        elif cfg.verifier.quantize != args.verifier_quantize:  # outputs are that quantized verifier's
            plain_q = f"plain {cfg.verifier.quantize} verifier (transformers +fix)"
            if plain_q not in methods:
                raise SystemExit(f"--extra-pool {name!r}: its verifier is {cfg.verifier.quantize}; add "
                                 f"--plain-quantize {cfg.verifier.quantize} for its reference")
            REFERENCE_OF[name] = plain_q
    return methods


#: method -> the method whose output it must reproduce (pools over a quantized verifier, llama.cpp's speculative
#: tools), None where no output is comparable (other weights); others: plain bf16
REFERENCE_OF: dict[str, str | None] = {}

LLAMA_PLAIN = "llama.cpp plain bf16"


def llama_cpp_methods(args, vt) -> dict:
    """llama.cpp's plain, speculative (0.5B bf16 draft, each ``--llama-cpp-n-max``) and lookup decoding on the same
    bf16 weights (converted from metasd's cache), and its plain decoding on the Q4_K_M GGUF as shipped (other weights:
    no identity check). Timed by llama.cpp's own clock (prefill + decode, model load excluded); tokens: those the
    tool delivered, up to its end token and at most ``--max-new-tokens`` (``tool_tokens``: what the tool counted, its
    surplus included; ``metasd.bench.llama_cpp``). The speculative tools must reproduce llama.cpp's plain output."""
    from metasd.bench.llama_cpp import LlamaCpp, build_tools, converted_gguf, shipped_gguf

    print("llama.cpp: building its tools and converting the bf16 weights (once; cached under "
          "<metasd cache>/llama.cpp) ...", flush=True)
    lc = LlamaCpp(build_tools(), vt, threads=args.threads)
    target, draft = converted_gguf(args.verifier, "bf16"), converted_gguf(args.drafter, "bf16")
    n = args.max_new_tokens

    def method(command):
        def run(ids):
            r = lc.run(command(lc.prompt_text(ids)), ids)
            out = lc.token_ids(r, n)  # the tokens delivered: up to the end token, at most n
            figures = {"tokens": min(r.new_tokens, len(out)), "tool_tokens": r.new_tokens,
                       "stopped_at_eos": r.stopped_at_eos}
            if r.drafted is not None:
                figures.update(drafted=r.drafted, accepted=r.accepted)
            return out, r.seconds, None, figures
        return run

    methods = {LLAMA_PLAIN: method(lambda p: lc.completion_command(target, p, n))}
    for k in args.llama_cpp_n_max:
        name = f"llama.cpp speculative 0.5B bf16 n-max {k}"
        methods[name] = method(lambda p, k=k: lc.speculative_command(target, draft, p, n, k))
        REFERENCE_OF[name] = LLAMA_PLAIN
    name = f"llama.cpp lookup n-max {args.llama_cpp_lookup_n_max}"
    methods[name] = method(lambda p: lc.lookup_command(target, p, n, args.llama_cpp_lookup_n_max))
    REFERENCE_OF[name] = LLAMA_PLAIN
    q4 = shipped_gguf(args.verifier)
    name = "llama.cpp plain Q4_K_M (other weights)"
    methods[name] = method(lambda p: lc.completion_command(q4, p, n))
    REFERENCE_OF[name] = None
    return methods


def select(methods: dict, only: list[str] | None, keep=()) -> dict:
    """The methods whose name contains one of ``only`` (all without ``only``); ``keep`` (the plain reference and the
    references of quantized pools) always stay."""
    if not only:
        return methods
    return {k: v for k, v in methods.items() if k in keep or any(o in k for o in only)}


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
                   help="also time transformers' assisted generation (+fix) with the 0.5B assistant quantized this "
                        "way (int4: the very model metasd's int4 pools draft with)")
    p.add_argument("--as-shipped", action="store_true",
                   help="also time plain, assisted and prompt lookup as transformers ships them (no LM-head fix), "
                        "labelled '(as shipped)'; ratios are never computed against them")
    p.add_argument("--no-drafter", action="store_true",
                   help="also time metasd's engine with no drafter (plain decoding through metasd)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also time llama.cpp on the same bf16 weights: plain, speculative with the 0.5B draft, lookup, "
                        "and plain on the shipped Q4_K_M GGUF (builds llama.cpp's tools and converts the weights "
                        "first: ~15 minutes once; metasd.bench.llama_cpp)")
    p.add_argument("--llama-cpp-n-max", type=int, action="append",
                   help="llama-speculative's --spec-draft-n-max (repeatable; default 4, 8 and 16)")
    p.add_argument("--llama-cpp-lookup-n-max", type=int, default=8, help="llama-lookup's --spec-draft-n-max")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: metasd methods sample at this temperature (transformers methods are left out; the "
                        "plain greedy reference still gives the speedup denominator)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature)")
    p.add_argument("--only", action="append",
                   help="run only methods whose name contains this (plain (transformers +fix) always runs)")
    add_run_options(p, "benchmarks/results/speed.json")
    args = p.parse_args(argv)
    args.llama_cpp_n_max = args.llama_cpp_n_max or [4, 8, 16]
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print(tables(saved["rows"], args.oracle or saved["args"].get("oracle")))
        return 0
    torch.set_num_threads(args.threads)
    questions = [q for path in (args.questions or [str(SPEC_BENCH_DEFAULT)])
                 for q in load_questions(path, per_group=args.per_group)]
    if args.copy_heavy:
        from metasd.data.copy_heavy import build_copy_heavy

        questions += build_copy_heavy(args.copy_heavy)
    vm, vt = load_model(args.verifier, dtype=args.dtype, quantize=args.verifier_quantize)
    dm, dt = load_model(args.drafter, dtype=args.dtype)
    methods = select(build_methods(args, vm, vt, dm, dt), args.only,
                     keep={PLAIN, *filter(None, REFERENCE_OF.values())})
    probe = Engine(Verifier(vm, vt), [])
    margins_pass = None
    if args.temperature == 0:
        def margins_pass(ids):  # untimed: the reference output and plain's top-two logit margins
            contiguous_lm_head_input(vm)
            out, _, margins = baselines.plain_with_margins(vm, ids, args.max_new_tokens)
            return out, margins
    rows = run_repeats(args, argv, questions, methods, probe, margins_pass, REFERENCE_OF)
    print(tables(rows, args.oracle))
    return 0


def run_repeats(args, argv, questions, methods: dict, probe: Engine, margins_pass, reference_of: dict | None = None,
                may_fail=lambda name: False) -> list[dict]:
    """Time every method on every prompt, ``args.repeats`` times, interleaved and in rotated order; rows are written
    to ``args.out`` after every (prompt, repeat). Returns all rows (resumed ones included).

    ``margins_pass(ids) -> (reference ids, margins)``: the untimed plain pass (None: no identity check, as when
    sampling). ``reference_of``: method -> the method of the same (prompt, repeat) whose output it must equal instead.
    ``may_fail(name)``: a RuntimeError of that method is recorded in its entry (``"error"``) instead of raised."""
    reference_of = reference_of or {}
    saved = resumed(args, argv) if args.resume else {}
    rows, references = saved.get("rows", []), saved.get("references", {})
    done = {(r["question_id"], r.get("repeat", 0)) for r in rows}
    warm = probe.encode([{"role": "user", "content": "Say hi."}])
    for fn in methods.values():  # warm-up: first calls allocate and tune kernels
        fn(warm[:])
    prompts = [(q, probe.encode([{"role": "user", "content": q.turns[0]}])) for q in questions]
    t_start, total = time.time(), len(prompts) * args.repeats
    for rep in range(args.repeats):
        for qi, (q, ids) in enumerate(prompts):
            if (q.question_id, rep) in done:
                continue
            ref = references.get(q.question_id)
            if ref is None and margins_pass is not None:
                ref_ids, margins = margins_pass(ids)
                ref = references[q.question_id] = {"token_ids": ref_ids, "margins": margins}
            order = stats.rotation(list(methods), qi + rep)
            row = {"question_id": q.question_id, "category": q.category, "group": q.group, "prompt_tokens": len(ids),
                   "repeat": rep, "order": order, "methods": {}}
            outs = {}
            for name in order:
                try:
                    out, seconds, tps, figures = methods[name](ids)
                except RuntimeError as e:
                    if not may_fail(name):
                        raise
                    row["methods"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print(f"  {name} failed on {q.question_id}: {row['methods'][name]['error']}", flush=True)
                    continue
                outs[name] = out
                row["methods"][name] = {"tokens": len(out), "seconds": seconds, "mean_tokens_per_step": tps,
                                        **(figures or {})}
            row["methods"] = {name: row["methods"][name] for name in methods}  # table order, not timing order
            for name, out in outs.items():  # identity against each method's reference
                entry, other = row["methods"][name], reference_of.get(name)
                if name in reference_of and other is None:  # other weights: no output to compare with
                    entry["identical"] = None
                    continue
                target = outs.get(other) if other else (ref["token_ids"] if ref else None)
                if target is None:
                    entry["identical"] = None
                    continue
                div = baselines.first_divergence(out, target)
                entry["identical"] = div is None and len(out) == len(target)
                if other:
                    entry["reference"] = other  # no margins recorded for quantized references
                elif div is not None:
                    entry["first_divergence"] = div
                    entry["plain_top2_margin_at_divergence"] = ref["margins"][div] if div < len(ref["margins"]) else None
            rows.append(row)
            write_result(args, argv, rows, t_start, references)  # an interrupted run keeps what finished
            line = ", ".join(f"{k.replace(' (transformers +fix)', '+fix')[:28]} {v['tokens'] / v['seconds']:.2f}"
                             for k, v in row["methods"].items() if "error" not in v)
            print(f"[repeat {rep + 1}/{args.repeats}, {len(rows)}/{total} {q.group} {q.question_id}] tok/s: {line}",
                  flush=True)
    return rows


def tables(rows: list[dict], oracle: list[str] | None = None, compare=COMPARE) -> str:
    """Every table of a run: summary (with verdicts), outliers, regret (with --oracle), steps, reuse."""
    parts = [summary_table(rows, oracle, compare), outlier_table(rows)]
    if oracle and regret_table(rows, oracle):
        parts.append(regret_table(rows, oracle))
    if any("steps" in e for r in rows for e in r["methods"].values()):
        parts.append(steps_table(rows))
    if reuse_table(rows):
        parts.append(reuse_table(rows))
    if llama_table(rows):
        parts.append(llama_table(rows))
    return "\n\n".join(parts)


def llama_table(rows: list[dict]) -> str:
    """Markdown, runs with llama.cpp: per method the geometric mean over prompts of its tok/s (median over repeats per
    prompt), and prompt by prompt against llama.cpp's plain decoding and its best single method on the same bf16
    weights (the one with the best geometric mean against plain; ``stats.prompt_geomean``: per prompt the median of
    the paired per-repeat ratios, geometric mean over the prompts, [min, max] of the per-repeat geometric means)."""
    methods = _methods(rows)
    if LLAMA_PLAIN not in methods:
        return ""
    llama_bf16 = [m for m in methods if m.startswith("llama.cpp") and "other weights" not in m]
    to_plain = {m: stats.prompt_geomean(rows, m, LLAMA_PLAIN) for m in methods}
    best = max(llama_bf16, key=lambda m: to_plain[m][0] if to_plain[m] else 0.0)

    def cell(g):
        if g is None:
            return "-"
        overall, per_repeat = g
        return f"{overall:.2f}x [{min(per_repeat):.2f}, {max(per_repeat):.2f}]" if len(per_repeat) > 1 else f"{overall:.2f}x"

    def tps_geomean(m):
        per = {q: [e["tokens"] / e["seconds"] for e in es if e.get("seconds", 0) > 0] for q, es in _by_prompt(rows, m).items()}
        meds = [statistics.median(v) for v in per.values() if v]
        return statistics.geometric_mean(meds) if meds else float("nan")

    lines = [f"| method | tok/s (geometric mean over prompts) | vs llama.cpp plain bf16 | vs llama.cpp's best single "
             f"method ({best}) |", "|---|---|---|---|"]
    for m in methods:
        if m == ORACLE:
            continue
        lines.append(f"| {m} | {tps_geomean(m):.2f} | {cell(to_plain[m])} | {cell(stats.prompt_geomean(rows, m, best))} |")
    lines += ["", "Per prompt the median over repeats of the paired ratio (the two methods on the same prompt in the "
              "same repeat), geometric mean over the prompts; [min, max]: the per-repeat geometric means."]
    return "\n".join(lines)


def add_run_options(p: argparse.ArgumentParser, out: str) -> None:
    """The options the benchmark scripts share: repeats, extra pools, the results file, printing an earlier run,
    resuming."""
    p.add_argument("--repeats", type=int, default=3,
                   help="run the prompt set this many times, interleaved (repeat r runs every prompt); the tables "
                        "give the median over repeats and the range of per-repeat ratios")
    p.add_argument("--extra-pool", action="append", help="NAME=pool.yaml: also time this pool (shares loaded models)")
    p.add_argument("--out", default=out, help="the results file (JSON, rewritten after every prompt)")
    p.add_argument("--table", metavar="RESULT_JSON", help="only print the tables of an earlier run")
    p.add_argument("--resume", action="store_true",
                   help="keep the (prompt, repeat) rows an interrupted run with the same command already wrote to "
                        "--out (a larger --repeats adds repeats)")


def resumed(args, argv) -> dict:
    """What an interrupted run of the same command (``--repeats`` aside) wrote to --out: ``{"rows", "references"}``
    (empty when the file is missing)."""
    out = Path(args.out)
    if not out.exists():
        return {}
    saved = json.loads(out.read_text())
    ignored = {"resume", "repeats"}
    ours = {k: v for k, v in vars(args).items() if k not in ignored}
    theirs = {k: v for k, v in saved["args"].items() if k not in ignored}
    if ours != theirs:
        changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise SystemExit(f"error: --resume: {out} was written with other arguments ({', '.join(changed)})")
    print(f"resuming: {len(saved['rows'])} (prompt, repeat) rows already in {out}", flush=True)
    return {"rows": saved["rows"], "references": saved.get("references", {})}


def write_result(args, argv, rows, t_start, references=None) -> None:
    result = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
                   f", native CPU bf16: {cpu_has_native_bf16()}",
        "args": vars(args), "wall_s": time.time() - t_start, "rows": rows, "references": references or {},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


def _methods(rows: list[dict]) -> list[str]:
    """Every method of the rows, in the order of their first appearance."""
    names: dict[str, None] = {}
    for r in rows:
        names.update(dict.fromkeys(r["methods"]))
    return list(names)


def _groups(rows: list[dict]) -> list[str]:
    return [g for g in GROUP_ORDER if any(r["group"] == g for r in rows)] + \
        sorted({r["group"] for r in rows} - set(GROUP_ORDER))


def _best_arms(rows: list[dict], arms: list[str], groups: list[str]) -> dict[str, str]:
    """Per group, the arm with the highest median per-repeat ratio to plain there (in hindsight)."""
    def med(m, g):
        r = stats.ratios(rows, m, PLAIN, group=g)
        return statistics.median(r) if r else float("-inf")
    return {g: max(arms, key=lambda m: med(m, g)) for g in groups}


def with_oracle(rows: list[dict], oracle: list[str] | None) -> tuple[list[dict], dict[str, str]]:
    """``rows`` with an ``ORACLE`` entry per row (the run of the best arm of the row's group), and that choice."""
    arms = [m for m in _methods(rows) if any(m.startswith(p) for p in oracle or [])]
    if not arms:
        return rows, {}
    best = _best_arms(rows, arms, _groups(rows))
    out = []
    for r in rows:
        e = r["methods"].get(best[r["group"]])
        extra = {ORACLE: {k: e[k] for k in ("tokens", "seconds")}} if e and "error" not in e else {}
        out.append({**r, "methods": {**r["methods"], **extra}})
    return out, best


def summary_table(rows: list[dict], oracle: list[str] | None = None, compare=COMPARE) -> str:
    """Markdown: per method the median over repeats of its tokens/s, its per-repeat ratios to plain and to each
    ``compare`` baseline as median [min, max], verdicts (``stats.verdict`` of the per-repeat ratios to plain), the
    median ratio to plain per group, mean tokens/step, identity with the method's reference (plain bf16, or plain
    decoding of the same quantized verifier) and plain's top-two logit margins at first divergences."""
    rows, best = with_oracle(rows, oracle)
    methods, groups = _methods(rows), _groups(rows)
    n_rep = len(stats.repeats(rows))
    present = [(name, label) for name, label in compare if name in methods]
    to_plain = {m: stats.ratios(rows, m, PLAIN) for m in methods}
    lines = ["| method | tok/s (median) | vs plain(+fix) median [range] | "
             + "".join(f"vs {label} median [range] | " for _, label in present)
             + "verdicts | " + " | ".join(groups)
             + " | mean tokens/step | identical to plain | plain's top-2 logit margin at each first divergence |",
             "|" + "---|" * (7 + len(present) + len(groups))]
    for m in methods:
        tps = list(stats.rates(rows, m).values())
        cells = [f"{statistics.median(tps):.2f}" if tps else "-", stats.fmt_median_range(to_plain[m])]
        cells += [stats.fmt_median_range(stats.ratios(rows, m, b)) if b != m else "-" for b, _ in present]
        verdicts = [f"{label}: {stats.verdict(to_plain[m], to_plain[b])}"
                    for b, label in [(PLAIN, "plain(+fix)")] + present if b != m and to_plain[m] and to_plain[b]]
        cells.append("; ".join(verdicts) or "-")
        for g in groups:
            r = stats.ratios(rows, m, PLAIN, group=g)
            cells.append(f"{statistics.median(r):.2f}" if r else "-")
        if m == ORACLE:
            cells += ["-", "-", ", ".join(f"{g}: {a}" for g, a in best.items())]
        else:
            cells += [_tokens_per_step(rows, m), _identical(rows, m), _margins(rows, m)]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Medians over {n_rep} repeat(s); [min, max] of the per-repeat ratios (per repeat: sum of tokens / sum "
                 f"of seconds over the prompts, over the reference's in the same repeat); per group: median ratio to "
                 f"plain(+fix). A verdict says faster/slower only where the two methods' ranges of per-repeat ratios "
                 f"to plain do not overlap.")
    return "\n".join(lines)


def _tokens_per_step(rows, m) -> str:
    tps = [r["methods"][m].get("mean_tokens_per_step") for r in rows if m in r["methods"] and "error" not in r["methods"][m]]
    return f"{statistics.mean(tps):.2f}" if tps and all(t is not None for t in tps) else "-"


def _by_prompt(rows, m) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        e = r["methods"].get(m)
        if e is not None and "error" not in e:
            out.setdefault(r["question_id"], []).append(e)
    return out


def _identical(rows, m) -> str:
    """Prompts whose output equals the reference in every repeat / prompts (and how many changed between repeats)."""
    per = _by_prompt(rows, m)
    flags = [[e.get("identical") for e in es] for es in per.values()]
    if not flags or any(None in f for f in flags):
        return "-"
    same = sum(all(f) for f in flags)
    varied = sum(len(set(f)) > 1 for f in flags)
    return f"{same}/{len(flags)}" + (f" ({varied} varied between repeats)" if varied else "")


def _margins(rows, m) -> str:
    """Per prompt that diverged, plain's margin at the first divergence (the same prompt counts once)."""
    out = []
    for es in _by_prompt(rows, m).values():
        div = [e for e in es if e.get("identical") is False and "reference" not in e]
        if div:
            x = div[0].get("plain_top2_margin_at_divergence")
            out.append("?" if x is None else f"{x:g}")
    return ", ".join(out) or "-"


def outlier_table(rows: list[dict], factor: float = 1.5) -> str:
    """Markdown: the runs ``stats.outliers`` flags, by prompt (the medians above do not move with them)."""
    flagged = stats.outliers(rows, factor)
    if not flagged:
        return (f"No outliers: no run took more than {factor}x the median seconds of the same method and prompt over "
                f"the repeats with the same token count.")
    lines = [f"Outliers: runs that took more than {factor}x the median seconds of the same method and prompt over the "
             f"repeats with the same token count ({len(flagged)}; the medians above are robust to them):", "",
             "| prompt | category | method | repeat | tokens | seconds | median s |", "|---|---|---|---|---|---|---|"]
    for o in sorted(flagged, key=lambda o: (o["question_id"], o["method"], o["repeat"])):
        lines.append(f"| {o['question_id']} | {o['category']} | {o['method']} | {o['repeat']} | {o['tokens']} | "
                     f"{o['seconds']:.2f} | {o['median_s']:.2f} |")
    return "\n".join(lines)


def regret_table(rows, oracle: list[str]) -> str:
    """Markdown, MetaSD-style: for every method that is not an arm (pools, fused drafters), per group its median
    speedup over plain decoding and its regret against the per-group best arm: 1 - its tok/s / the best arm's
    (median over repeats; negative: it beat every arm there)."""
    rows, best = with_oracle(rows, oracle)
    methods = _methods(rows)
    arms = [m for m in methods if any(m.startswith(p) for p in oracle)]
    others = [m for m in methods if m not in arms and m != ORACLE
              and any("steps" in r["methods"].get(m, {}) for r in rows)]
    groups = _groups(rows)
    if not arms or not others:
        return ""

    def med(m, ref, g=None):
        r = stats.ratios(rows, m, ref, group=g)
        return statistics.median(r) if r else float("nan")

    best_arm = max(arms, key=lambda a: med(a, PLAIN))
    lines = ["| method | overall: speedup, regret vs oracle, vs best single arm | " + " | ".join(groups) + " |",
             "|" + "---|" * (2 + len(groups))]
    for m in others:
        cells = [f"{med(m, PLAIN, g):.2f}x, {1 - med(m, best[g], g):+.0%}" for g in groups]
        lines.append(f"| {m} | {med(m, PLAIN):.2f}x, {1 - med(m, ORACLE):+.0%}, {med(m, best_arm) - 1:+.0%} | "
                     + " | ".join(cells) + " |")
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
