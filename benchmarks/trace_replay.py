"""Trace-replayed acceptance: record a pool's real acceptance here, replay it on random weights of the real shapes
where the real weights cannot go (issue "metasd at GPU speed", item 5; the format and the drafter: drafters/trace.py).

    # 1. on this CPU, with the real models (greedy): each arm's unbounded draft at every position of the verifier's
    #    text, and the forwards it ran - shapes and acceptance only, no token of the prompts or the answers
    python benchmarks/trace_replay.py record --pool configs/pools/trace_record.yaml --per-group 1 --copy-heavy 1 \
        --max-new-tokens 64 --threads 2 --check cascade --out benchmarks/results/trace_default.json
    # 2. anywhere (a GPU: --device cuda), random-weight models of the real shapes, acceptance from the trace; the
    #    pool's arms, policy and reward from the same pool file, chosen live; timed against metasd with no drafter
    python benchmarks/trace_replay.py replay --trace benchmarks/results/trace_default.json \
        --pool configs/default.yaml --verifier-shape 1.5b --drafter-shape 0.5b --repeats 3 --out $OUT/replay.json

``record --check ARM`` also runs that arm alone on each prompt and compares its steps with the trace (the trace's
acceptance at each step's start is the step's; a bf16 near-tie may break a verify differently from plain decoding -
each mismatch is counted, never hidden). ``replay`` builds the verifier and the drafter as
``benchmarks/gpu_overhead.py`` does (decisive random heads: no near-ties), records the verifier's greedy continuation
of a random prompt of each recorded length up front, and marks a row whose output leaves it (``identical: false``).
Figures from a replay are labelled "trace-replayed": the acceptance is the recorded pool's, the forwards and the
engine are the device's.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import metasd_layout  # noqa: F401  (first: metasd from a bare checkout, as a GPU machine gets it)
import torch

from metasd import Engine, Verifier
from metasd.bench import stats
from metasd.config import load_pool, read_pool_config
from metasd.config.build import make_policy_from_config
from metasd.core.execution.clock import synchronize
from metasd.data import SPEC_BENCH_DEFAULT, load_questions
from metasd.drafters.budgeted import NoSpeculation, budget_arms
from metasd.core.execution.graph_runner import resolve_graphs
from metasd.drafters.static_tree import DEFAULT_WIDTHS
from metasd.drafters.trace import PromptTrace, Trace, TraceDrafter
from metasd.drafters.trace_record import record_arm
from metasd.drafters.trace_loop import LoopTraceDrafter


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- record
def record_pool(engine: Engine, arms: list[str], prompts: list[tuple[str, list[int]]], max_new: int, margin: int,
                check: str | None = None) -> Trace:
    """Each of ``arms`` (names of the engine's drafters, budget arms by their inner drafter) recorded over every
    prompt's greedy continuation: ``max_new`` positions, the continuation ``margin`` tokens longer (the deepest
    draft). ``check``: an arm also run alone on each prompt, its steps compared with its trace."""
    plain = Engine(engine.verifier, [], check_tokenizers=False)
    by_name = {d.name: d for d in engine.all_drafters}
    missing = [a for a in arms if a not in by_name]
    if missing:
        raise SystemExit(f"error: the pool has no drafter named {missing} (it has {sorted(by_name)})")
    traces, meta_prompts = [], []
    for name, ids in prompts:
        t0 = time.perf_counter()
        R = plain.generate(ids, max_new_tokens=max_new + margin).token_ids
        positions = min(max_new, len(R))
        steps = {a: record_arm(by_name[a].fork(), ids, R, positions) for a in arms}
        info = {"name": name, "prompt_len": len(ids), "positions": positions, "record_s": time.perf_counter() - t0}
        if check:
            result = Engine(engine.verifier, by_name[check].fork(), check_tokenizers=False).generate(
                ids, max_new_tokens=positions)
            taus = result.stats.tokens_per_step
            # where each step started (after the token drawn with the prefill); the last step: cut by the tokens left
            starts = [result.stats.prefill_committed + sum(taus[:k]) for k in range(len(taus) - 1)]
            info.update({"check_arm": check, "check_tokens_per_step": taus,
                         "check_identical": result.token_ids == R[:positions],
                         "check_mismatches": sum(steps[check][p].accepted() != t - 1 for p, t in zip(starts, taus))})
        traces.append(PromptTrace(name, len(ids), positions, steps))
        meta_prompts.append(info)
        mean = {a: statistics.mean(s.accepted() for s in steps[a]) + 1 for a in arms}
        log(f"{name}: {len(ids)} prompt tokens, {positions} positions in {info['record_s']:.0f} s; tokens a step "
            f"would commit from each position, mean over positions: "
            + ", ".join(f"{a} {v:.2f}" for a, v in mean.items())
            + (f"; {check} run alone {positions / len(info['check_tokens_per_step']):.2f} tokens/step, steps whose "
               f"acceptance differs from the trace's {info['check_mismatches']}" if check else ""))
    return Trace(traces, {"prompts": meta_prompts, "max_new_tokens": max_new, "margin": margin, "arms": arms})


def record_main(args) -> int:
    torch.set_num_threads(args.threads)
    config = read_pool_config(args.pool)
    arms = args.arms or [d.name for d in config.drafters if d.arm]
    engine = load_pool(args.pool)
    questions = [q for path in (args.questions or [str(SPEC_BENCH_DEFAULT)])
                 for q in load_questions(path, per_group=args.per_group, groups=args.groups)]
    if args.copy_heavy:
        from metasd.data.copy_heavy import build_copy_heavy

        questions += build_copy_heavy(args.copy_heavy)
    prompts = [(f"{q.group}/{q.question_id}", engine.encode([{"role": "user", "content": q.turns[0]}]))
               for q in questions]
    t0 = time.time()
    if args.check and args.check not in arms:
        raise SystemExit(f"error: --check {args.check!r} is not among the arms recorded ({arms})")
    trace = record_pool(engine, arms, prompts, args.max_new_tokens, args.margin, check=args.check)
    trace.meta.update({"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                       time.gmtime()), "machine": f"{platform.processor() or platform.machine()}, {args.threads} "
                       f"threads", "pool": args.pool, "wall_s": time.time() - t0,
                       "verifier": engine.verifier.name if hasattr(engine.verifier, "name") else None})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    trace.save(args.out)
    log(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)")
    return 0


# ---------------------------------------------------------------------------------------------- replay
def static_tree_of(config, entry) -> tuple[list[int], str] | None:
    """The widths and ``graphs`` setting of the static tree a pool entry drafts with (alone, or a part of its
    cascade); None: it drafts with none."""
    by_name = {d.name: d for d in config.drafters}
    parts = [by_name[a] for a in entry.params.get("arms", []) if a in by_name] if entry.type == "fused" else [entry]
    static = [d for d in parts if d.type == "static_tree"]
    if not static:
        return None
    return list(static[0].params.get("widths") or DEFAULT_WIDTHS), static[0].params.get("graphs", "auto")


def replay_arms(config, trace: Trace, models: list, vocab: int, fixed: bool = False) -> list:
    """The pool file's arms, each a ``TraceDrafter`` of the arm recorded under its name (budget arms around it, the
    "none" arm as the pool gives it); an arm whose recording ran a model forward drafts through ``models``. An arm
    that drafts with a static tree whose drafting loop the pool captures on this device (``graphs``), or any with
    ``fixed`` (the CPU check), replays through that loop (``LoopTraceDrafter``: the captured drafting cost)."""
    arms = []
    for d in config.drafters:
        if not d.arm:
            continue
        if d.name not in trace.arms():
            raise SystemExit(f"error: the trace has no arm {d.name!r} (it has {sorted(trace.arms())})")
        uses = trace.models_of(d.name)
        if len(uses) > len(models):
            raise SystemExit(f"error: arm {d.name!r} drafted with {len(uses)} models, {len(models)} given")
        static = static_tree_of(config, d) if uses else None
        looped = static is not None and (fixed or resolve_graphs(static[1], models[0].device, d.name))
        drafter = (LoopTraceDrafter(trace, d.name, models[0], static[0], vocab=vocab, graphs="off" if fixed else
                                    static[1], fixed_shapes=fixed) if looped else
                   TraceDrafter(trace, d.name, models[: len(uses)], vocab=vocab))
        arms.extend(budget_arms(drafter, d.budgets) if d.budgets is not None else [drafter])
    if config.no_speculation_arm:
        arms.append(NoSpeculation())
    return arms


def replay_rows(trace: Trace, pools: dict, verifier_model, drafter_model, repeats: int, graphs: str, device,
                save=lambda rows: None, described: dict | None = None) -> list[dict]:
    """Time each trace-replayed pool (``pools``: name -> pool config; method ``trace-replayed <name>``) and metasd with
    no drafter on every prompt, ``repeats`` times, the order of the methods rotated; each row one call (synchronised),
    its output checked against the recorded continuation. ``described`` gets each method's verifier runner and arms
    (graphs captured, capture seconds, replays) after every row."""
    from gpu_overhead import record

    vocab = int(verifier_model.config.vocab_size)
    margin = int(trace.meta.get("margin", 32)) + 1
    prompts = []
    for i, p in enumerate(trace.prompts):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(1, vocab, (p.prompt_len,), generator=g).tolist()
        G, margins = record(verifier_model, torch.tensor([ids], device=device), p.recorded_len + margin)
        p.replay_on(ids, G)
        prompts.append((p, ids, margins))
    models = [drafter_model] if drafter_model is not None else []
    fixed = graphs == "fixed"  # the graph runner's and the drafting loop's buffers, run eagerly: the CPU check

    def verifier():  # "fixed": the graph runner's buffers, eagerly
        return Verifier(verifier_model, graphs=graphs)
    methods = {"metasd, no drafter": Engine(verifier(), [], check_tokenizers=False)}
    for name, config in pools.items():
        arms = replay_arms(config, trace, models, vocab, fixed)
        policy = make_policy_from_config(config.policy, len(arms)) if len(arms) > 1 else None
        methods[f"trace-replayed {name}"] = Engine(verifier(), arms, policy,
                                                   granularity=config.granularity, reward=config.reward,
                                                   check_tokenizers=False)
    warm = prompts[0]
    for engine in methods.values():  # untimed: first calls allocate, tune kernels and capture graphs
        engine.generate(warm[1], max_new_tokens=min(8, warm[0].recorded_len))
    rows: list[dict] = []
    for rep in range(repeats):
        for i, (p, ids, margins) in enumerate(prompts):
            for name in stats.rotation(list(methods), i + rep):
                synchronize(device)
                t0 = time.perf_counter()
                result = methods[name].generate(ids, max_new_tokens=p.recorded_len)
                synchronize(device)
                seconds = time.perf_counter() - t0
                row = {"prompt": p.name, "repeat": rep, "method": name, "seconds": seconds,
                       "tokens": len(result.token_ids), "steps": result.stats.steps,
                       "identical": result.token_ids == p.continuation[: p.recorded_len],
                       "ties": margins["ties"]}
                rows.append(row)
                if described is not None:
                    runner = getattr(methods[name].verifier, "runner", None)
                    described[name] = {"verifier_runner": runner.describe() if runner is not None else None,
                                       "arms": [d.describe() for d in methods[name].drafters]}
                save(rows)
                log(f"[{rep}] {p.name} {name}: {row['tokens'] / seconds:.1f} tok/s, "
                    f"{row['tokens'] / max(row['steps'], 1):.2f} tokens/step{'' if row['identical'] else ' LEFT'}")
    return rows


def summary(rows: list[dict], reference: str = "metasd, no drafter") -> dict:
    """Per prompt set (all, Spec-Bench, copy-heavy: the trace's prompt names are ``group/id``) and method: tokens/s per
    repeat (sum of tokens / sum of seconds over the set's prompts) and the median [range] of its per-repeat ratio to
    ``reference``. Repeats that did not run every prompt (a run cut short) are left out."""
    from metasd.data.copy_heavy import CATEGORIES

    prompts = {r["prompt"] for r in rows}
    sets = {"all": prompts, "spec_bench": {p for p in prompts if p.split("/")[0] not in CATEGORIES},
            "copy_heavy": {p for p in prompts if p.split("/")[0] in CATEGORIES}}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    whole = [k for k in sorted({r["repeat"] for r in rows})
             if len({(r["prompt"], r["method"]) for r in rows if r["repeat"] == k}) == len(prompts) * len(methods)]
    out: dict = {"repeats": len(whole)}
    for name, chosen in sets.items():
        if not chosen or not whole:
            continue
        per = {m: [sum(r["tokens"] for r in rows if r["method"] == m and r["repeat"] == k and r["prompt"] in chosen)
                   / sum(r["seconds"] for r in rows if r["method"] == m and r["repeat"] == k and r["prompt"] in chosen)
                   for k in whole] for m in methods}
        out[name] = {}
        for m, tps in per.items():
            med, lo, hi = stats.median_range([a / b for a, b in zip(tps, per[reference])])
            same = all(r["identical"] for r in rows if r["method"] == m and r["prompt"] in chosen)
            out[name][m] = {"tokens_per_s": tps, "ratio_median": med, "ratio_range": [lo, hi], "identical": same}
    return out


def first_per_group(prompts: list[PromptTrace], n: int) -> list[PromptTrace]:
    """The first ``n`` prompts of each group (a trace's prompt names are ``group/id``), in the trace's order."""
    kept, seen = [], {}
    for p in prompts:
        group = p.name.split("/")[0]
        seen[group] = seen.get(group, 0) + 1
        if seen[group] <= n:
            kept.append(p)
    return kept


def replay_main(args) -> int:
    from gpu_overhead import build

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.set_num_threads(args.threads)
    trace = Trace.load(args.trace)
    pools = {Path(p).stem: read_pool_config(p) for p in args.pool or ["configs/default.yaml"]}
    if args.per_group:
        trace.prompts = first_per_group(trace.prompts, args.per_group)
    verifier = build(args.verifier_shape, device, dtype)
    drafter = build(args.drafter_shape, device, dtype, seed=2, perm_seed=3) if args.drafter_shape else None
    quantize = {d.quantize for c in pools.values() for d in c.drafters if d.model and d.quantize}
    if len(quantize) > 1:
        raise SystemExit(f"error: the pools quantize their drafter differently ({sorted(quantize)}): one at a time")
    if drafter is not None and quantize:
        from metasd.models.quantize import quantize_model

        drafter = quantize_model(copy.deepcopy(drafter), quantize.pop(), name="drafter")
    result = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "label": "trace-replayed", "trace": args.trace, "trace_meta": trace.meta, "pools": list(pools)}

    def save(rows):
        result["rows"] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    result["methods"] = {}
    rows = replay_rows(trace, pools, verifier, drafter, args.repeats, args.graphs, device, save, result["methods"])
    result["summary"] = summary(rows)
    save(rows)
    for name, by_method in result["summary"].items():
        for m, s in by_method.items() if isinstance(by_method, dict) else ():
            log(f"{name}: {m}: {statistics.median(s['tokens_per_s']):.1f} tok/s, {s['ratio_median']:.2f}x "
                f"[{s['ratio_range'][0]:.2f}, {s['ratio_range'][1]:.2f}] no drafter (trace-replayed)"
                + ("" if s["identical"] else "; an output LEFT its recording"))
    return 0


# ---------------------------------------------------------------------------------------------- serve
TRACE_TYPE = "metasd.drafters.trace:TraceDrafter"


#: the bytes a replayed prompt is drawn from (ASCII letters): text of them tokenizes to their byte ids, no merges
PROMPT_BYTES = list(range(ord("A"), ord("Z") + 1)) + list(range(ord("a"), ord("z") + 1))


def byte_tokenizer(vocab: int, eos: int | None = None):
    """A byte-level BPE tokenizer (``Qwen2Tokenizer``: what ``AutoTokenizer`` loads beside a Qwen2 config, in any
    server that reads the folder) with no merges: id b < 256 is byte b, the ids above are multi-byte fillers that no
    text tokenizes to; its chat template is the messages' text alone. So a chat prompt of ``PROMPT_BYTES`` tokenizes to
    exactly its bytes' ids, and a replay keyed by prompt ids meets what a client sends as text. ``eos``: the id the
    servers stop at (default: the last)."""
    import itertools
    import tempfile

    from transformers import Qwen2Tokenizer

    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # GPT-2's bytes_to_unicode
    rest = iter(range(256, 512))
    chars = {b: chr(b) if b in visible else chr(next(rest)) for b in range(256)}
    words = [chars[b] for b in range(256)]
    for combo in itertools.chain(itertools.product(words, repeat=2), itertools.product(words, repeat=3)):
        if len(words) >= vocab:
            break
        words.append("".join(combo))
    eos = vocab - 1 if eos is None else eos
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "vocab.json").write_text(json.dumps({w: i for i, w in enumerate(words)}, ensure_ascii=False))
        (Path(d) / "merges.txt").write_text("#version: 0.2\n")
        tok = Qwen2Tokenizer(str(Path(d) / "vocab.json"), str(Path(d) / "merges.txt"), eos_token=words[eos],
                             unk_token=None, bos_token=None, pad_token=None)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tok


def served_pool(raw: dict, trace: Trace, out: Path) -> dict:
    """The pool file ``raw`` (a parsed YAML) served on the replay: its verifier the random one in ``out``, each arm
    a trace entry of the arm recorded under its name (budgets kept; the random drafter where the recording ran a model,
    quantized as the pool's model drafter was), entries that are no arm dropped (the trace replays what they did)."""
    recorded = trace.arms()
    quantize = {d.get("quantize") for d in raw["drafters"] if d.get("model") and d.get("quantize")}
    drafters = []
    for d in raw["drafters"]:
        if not d.get("arm", True):
            continue
        if d["name"] not in recorded:
            raise SystemExit(f"error: the trace has no arm {d['name']!r} (it has {sorted(recorded)})")
        used = bool(trace.models_of(d["name"]))  # a lookup arm runs no forward
        entry = {"name": d["name"], "type": TRACE_TYPE, "params": {"trace": "trace.json", "replay": "replay.json"}}
        if used:
            entry["model"] = str(out / "drafter")
            if quantize:
                entry["quantize"] = sorted(quantize)[0]
        if d.get("budgets") is not None:
            entry["budgets"] = d["budgets"]
        drafters.append(entry)
    verifier = {k: v for k, v in raw["verifier"].items() if k not in ("model", "backend")}
    return {**raw, "verifier": {**verifier, "model": str(out / "verifier")}, "drafters": drafters}


def serve_prep_main(args) -> int:
    """Everything ``metasd serve`` and ``transformers serve`` need to serve the trace on random weights: the models
    (with ``byte_tokenizer``), each prompt's replay ids and the verifier's continuation (``replay.json``), the prompts
    as chat text with their recorded lengths as ``meta.max_tokens`` (``questions.jsonl``), the pool (``pool.yaml``)
    and the same verifier without drafters (``plain.yaml``)."""
    import yaml
    from gpu_overhead import build, record

    out, device = Path(args.out), torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    out.mkdir(parents=True, exist_ok=True)
    trace = Trace.load(args.trace)
    if args.per_group:
        trace.prompts = first_per_group(trace.prompts, args.per_group)
    raw = yaml.safe_load(Path(args.pool).read_text())
    pool = served_pool(raw, trace, out)
    verifier = build(args.verifier_shape, device, dtype)
    vocab = int(verifier.config.vocab_size)
    tok = byte_tokenizer(vocab)
    models = {"verifier": verifier}
    if any("model" in d for d in pool["drafters"]):
        models["drafter"] = build(args.drafter_shape, device, dtype, seed=2, perm_seed=3)
    lines = []
    for i, p in enumerate(trace.prompts):
        g = torch.Generator().manual_seed(1000 + i)
        ids = [PROMPT_BYTES[j] for j in torch.randint(len(PROMPT_BYTES), (p.prompt_len,), generator=g).tolist()]
        G, margins = record(verifier, torch.tensor([ids], device=device), p.recorded_len + args.margin)
        p.replay_on(ids, G)
        group, _, qid = p.name.partition("/")
        lines.append({"question_id": qid or p.name, "category": group, "turns": [tok.decode(ids)],
                      "meta": {"max_tokens": p.recorded_len, "ties": margins["ties"],
                               "eos_at": G.index(tok.eos_token_id) if tok.eos_token_id in G else None}})
        log(f"{p.name}: {p.prompt_len} prompt tokens, {p.recorded_len} to answer, ties {margins['ties']}")
    for name, model in models.items():
        # every server stops at the tokenizer's EOS: transformers serve reads it from the model's configs alone
        model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
    trace.save(out / "trace.json")
    trace.save_replay(out / "replay.json")
    (out / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in lines))
    (out / "pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))
    plain = {"verifier": pool["verifier"], "drafters": []}  # metasd's plain batched path on the same verifier
    (out / "plain.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
    log(f"wrote {out}: {', '.join(sorted(f.name for f in out.iterdir()))}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="record a pool's acceptance with its real models")
    r.add_argument("--pool", default="configs/default.yaml")
    r.add_argument("--arms", nargs="+", help="the pool entries to record (default: its arms)")
    r.add_argument("--questions", action="append", help="Spec-Bench-format JSONL (default: Spec-Bench)")
    r.add_argument("--groups", nargs="+")
    r.add_argument("--per-group", type=int, default=1)
    r.add_argument("--copy-heavy", type=int, default=0, metavar="N")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--margin", type=int, default=32, help="continuation tokens past the last position (>= the "
                                                          "deepest draft)")
    r.add_argument("--check", metavar="ARM", help="also run this arm alone on each prompt and compare its steps with "
                                                   "the trace")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", default="benchmarks/results/trace.json")
    y = sub.add_parser("replay", help="replay a trace on random-weight models of the real shapes")
    y.add_argument("--trace", required=True)
    y.add_argument("--pool", action="append", help="a pool file whose arms, policy and reward are replayed (no model "
                                                   "is loaded; repeatable: one method each; default "
                                                   "configs/default.yaml)")
    y.add_argument("--verifier-shape", default="1.5b")
    y.add_argument("--drafter-shape", default="0.5b", help="'' for a pool of lookups")
    y.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    y.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    y.add_argument("--graphs", default="auto", choices=["auto", "on", "off", "fixed"],
                   help="the verifier's graphs setting (static-tree arms: their pool's); fixed = the verifier's and "
                        "every static-tree arm's fixed-shape buffers run eagerly (the CPU dry run)")
    y.add_argument("--repeats", type=int, default=3)
    y.add_argument("--per-group", type=int, help="only the first N prompts of each group of the trace")
    y.add_argument("--threads", type=int, default=2)
    y.add_argument("--out", default="benchmarks/results/trace_replay.json")
    v = sub.add_parser("serve-prep", help="random-weight models, replay, prompts and a pool to serve the trace")
    v.add_argument("--trace", required=True)
    v.add_argument("--pool", default="configs/pools/serve_adaptive.yaml", help="the pool served (its arms replayed)")
    v.add_argument("--verifier-shape", default="1.5b")
    v.add_argument("--drafter-shape", default="0.5b")
    v.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    v.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    v.add_argument("--margin", type=int, default=33, help="continuation tokens past a prompt's last position")
    v.add_argument("--per-group", type=int, help="only the first N prompts of each group of the trace")
    v.add_argument("--out", required=True, help="a folder")
    args = p.parse_args(argv)
    return {"record": record_main, "replay": replay_main, "serve-prep": serve_prep_main}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
