"""Cross-tokenizer drafting against plain decoding and transformers' universal assisted generation, in one process.

Every method decodes the same prompts (first turn of Spec-Bench questions, chat template) with the same verifier,
dtype, threads and max_new_tokens; the order of methods rotates from prompt to prompt. Wall time includes the
prefill. Methods:

- plain (transformers +fix): ``model.generate`` of the verifier - the reference every speedup is measured against
  (greedy: also the reference output; the verifier's top-two logit margin is recorded at each first divergence);
- UAG (transformers +fix): transformers' universal assisted generation with the same assistant model, ``generate(...,
  assistant_model=, tokenizer=, assistant_tokenizer=)`` with its default schedule (greedy: translation through text;
  sampling: its vocabulary-intersection variant, which prunes the assistant's LM head in place - so it gets its own
  copy of the assistant, with a dense head of the dequantized weight where the assistant is quantized, since the
  pruning reads the head's ``weight``);
- metasd cross-tokenizer k=K: the assistant alone as a ``pretrained`` drafter with ``tokenizer: own``;
- any ``--extra-pool NAME=pool.yaml`` (its models are shared with the ones loaded here when the references match).

``--temperature T`` samples every method at temperature T (the same seed for each prompt); outputs then differ by
design and only speed is compared.

A prompt on which transformers' UAG raises (transformers 5.24 with Gemma-3 as the assistant fails once the assistant's
context passes its 512-token sliding window: an attention-mask size mismatch) is recorded with the error for that
method; the tables then compare every method over the prompts all of them finished, and the others without UAG over
all prompts. An error of a metasd method is not caught.

    python benchmarks/cross_tokenizer.py --out benchmarks/results/cross_tokenizer.json
    python benchmarks/cross_tokenizer.py --temperature 1 --out benchmarks/results/cross_tokenizer_t1.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from metasd import Engine, Verifier
from metasd.bench import baselines
from metasd.config import ModelCache, build_engine, read_pool_config
from metasd.data import SPEC_BENCH_DEFAULT, load_questions
from metasd.drafters import PretrainedDrafter
from metasd.models import load_model
from metasd.models.quantize import QuantizedLinear
# benchmarks/speed.py, beside this file (on sys.path when run as a script)
from speed import add_run_options, engine_figures, resumed_rows, steps_table, summary_table, write_result

REFERENCE = "plain (transformers +fix)"


def _sampled(model, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int, **kwargs):
    """transformers ``generate`` with sampling at ``temperature`` (no top-p / top-k), seeded: (new ids, seconds)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
                             temperature=temperature, top_p=1.0, top_k=0, **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0


def build_methods(args, vm, vt, am, at) -> dict:
    """name -> callable(prompt_ids) -> (new ids, seconds, mean tokens per step or None, engine figures or None)."""
    n, temperature = args.max_new_tokens, args.temperature
    verifier = Verifier(vm, vt, name=args.verifier)
    sampling = {"temperature": temperature, "seed": args.seed} if temperature > 0 else {}

    def engine_method(engine):
        def run(ids):
            r = engine.generate(ids, max_new_tokens=n, **sampling)
            return r.token_ids, r.stats.wall_s, r.stats.mean_tokens_per_step, engine_figures(r.stats)
        return run

    def hf(fn):
        def run(ids):
            out, seconds = fn(ids)
            return out, seconds, None, None
        return run

    # sampling: transformers prunes and re-indexes the assistant's LM head and embeddings in place
    uag_assistant = copy.deepcopy(am) if temperature > 0 else am
    head = uag_assistant.get_output_embeddings()
    if temperature > 0 and isinstance(head, QuantizedLinear):
        # its pruning reads the head's `.weight`: give the copy a dense head of the dequantized weight (the same
        # numbers; transformers then keeps only the rows of the shared vocabulary, in the model's dtype)
        dense = torch.nn.Linear(head.in_features, head.out_features, bias=False, device=head.qweight.device,
                                dtype=head.dtype)
        dense.weight.data.copy_(head.dense_weight())
        uag_assistant.set_output_embeddings(dense)
    uag = dict(assistant_model=uag_assistant, tokenizer=vt, assistant_tokenizer=at)
    if temperature > 0:
        methods = {"UAG (transformers +fix)": hf(lambda ids: _sampled(vm, ids, n, temperature, args.seed, **uag))}
    else:
        methods = {"UAG (transformers +fix)": hf(lambda ids: baselines.assisted(vm, am, ids, n, tokenizer=vt,
                                                                                  assistant_tokenizer=at))}
    arm = PretrainedDrafter(am, at, k=args.k, confidence_threshold=args.confidence_threshold, name="cross",
                            model_ref=args.assistant, verifier_tokenizer=vt, verifier_name=args.verifier)
    methods[f"metasd cross-tokenizer k={args.k}"] = engine_method(Engine(verifier, arm))
    cache = ModelCache(None)  # extra pools share the models loaded here
    cache.put(args.verifier, args.dtype, (vm, vt))
    cache.put(args.assistant, args.dtype, (am, at), args.assistant_quantize)
    for spec in args.extra_pool or []:
        name, path = spec.rsplit("=", 1)
        methods[name] = engine_method(build_engine(read_pool_config(path), Path(path).resolve().parent, cache))
    return methods


def reference(args, vm):
    """callable(prompt_ids) -> (new ids, seconds, margins or None): plain decoding of the verifier."""
    if args.temperature > 0:
        return lambda ids: (*_sampled(vm, ids, args.max_new_tokens, args.temperature, args.seed), None)
    return lambda ids: baselines.plain_with_margins(vm, ids, args.max_new_tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", default=str(SPEC_BENCH_DEFAULT))
    p.add_argument("--per-group", type=int, default=2)
    p.add_argument("--copy-heavy", type=int, default=0, metavar="N",
                   help="also N prompts per copy-heavy category (metasd.data.copy_heavy; generated from this Python)")
    p.add_argument("--limit", type=int, help="only the first N prompts (a smoke run)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--verifier", default="bundled:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--assistant", default="bundled:gemma-3-270m", help="a model of another tokenizer")
    p.add_argument("--assistant-quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the assistant (the metasd arm and transformers use the same)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=6, help="the metasd arm's draft length, in the assistant's own tokens")
    p.add_argument("--confidence-threshold", type=float, default=None, help="the metasd arm's confidence stop")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: every method samples at this temperature")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature), the same for each prompt")
    add_run_options(p, "benchmarks/results/cross_tokenizer.json")
    args = p.parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.table).read_text())["rows"]))
        return 0
    torch.set_num_threads(args.threads)
    questions = load_questions(args.questions, per_group=args.per_group)
    if args.copy_heavy:
        from metasd.data.copy_heavy import build_copy_heavy

        questions += build_copy_heavy(args.copy_heavy)
    questions = questions[: args.limit]
    vm, vt = load_model(args.verifier, dtype=args.dtype)
    am, at = load_model(args.assistant, dtype=args.dtype, quantize=args.assistant_quantize)
    methods = build_methods(args, vm, vt, am, at)
    plain = reference(args, vm)
    probe = Engine(Verifier(vm, vt), [])
    warm = probe.encode([{"role": "user", "content": "Say hi."}])
    for fn in methods.values():  # warm-up: first calls allocate and tune kernels
        fn(warm[:])
    rows, t_start = resumed_rows(args, argv) if args.resume else [], time.time()
    done_ids = {r["question_id"] for r in rows}
    for qi, q in enumerate(questions):
        if q.question_id in done_ids:
            continue
        ids = probe.encode([{"role": "user", "content": q.turns[0]}])
        ref_ids, ref_s, margins = plain(ids)
        row = {"question_id": q.question_id, "category": q.category, "group": q.group, "prompt_tokens": len(ids),
               "methods": {REFERENCE: {"tokens": len(ref_ids), "seconds": ref_s,
                                       "identical": True if args.temperature == 0 else None}}}
        names = list(methods)
        names = names[qi % len(names):] + names[:qi % len(names)]  # rotate the order
        for name in names:
            try:
                out, seconds, tps, figures = methods[name](ids)
            except RuntimeError as e:  # transformers' UAG only; recorded and shown, never a silent gap
                if not name.startswith("UAG"):
                    raise
                row["methods"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(f"  {name} failed on {q.question_id}: {row['methods'][name]['error']}", flush=True)
                continue
            entry = {"tokens": len(out), "seconds": seconds, "mean_tokens_per_step": tps, **(figures or {})}
            if args.temperature == 0:
                div = baselines.first_divergence(out, ref_ids)
                entry["identical"] = div is None and len(out) == len(ref_ids)
                if div is not None:
                    entry["first_divergence"] = div
                    entry["plain_top2_margin_at_divergence"] = margins[div] if div < len(margins) else None
            else:
                entry["identical"] = None
            row["methods"][name] = entry
        rows.append(row)
        write_result(args, argv, rows, t_start)  # after every prompt: an interrupted run keeps what finished
        done = ", ".join(f"{k.split(' (')[0][:24]} {v['tokens'] / v['seconds']:.2f}" for k, v in row["methods"].items()
                         if "error" not in v)
        print(f"[{qi + 1}/{len(questions)} {q.group}] tok/s: {done}", flush=True)
    print(tables(rows))
    return 0


def tables(rows: list[dict]) -> str:
    """Summary and steps tables; with failed prompts, over the prompts every method finished and then without the
    failing methods over all prompts."""
    failed = {name: sum("error" in r["methods"].get(name, {}) for r in rows) for name in rows[0]["methods"]}
    failed = {name: n for name, n in failed.items() if n}
    if not failed:
        return summary_table(rows) + "\n\n" + steps_table(rows)
    finished = [r for r in rows if not any("error" in e for e in r["methods"].values())]
    without = [{**r, "methods": {k: v for k, v in r["methods"].items() if k not in failed}} for r in rows]
    why = ", ".join(f"{name} failed on {n}" for name, n in failed.items())
    text = f"All {len(rows)} prompts, without the methods that failed on some ({why}):\n\n"
    text += summary_table(without) + "\n\n" + steps_table(without)
    if finished:
        text += f"\n\nThe {len(finished)} prompts every method finished:\n\n" + summary_table(finished)
    return text


if __name__ == "__main__":
    sys.exit(main())
