"""Cross-tokenizer drafting against plain decoding and transformers' universal assisted generation, in one process.

Every method decodes the same prompts (first turn of Spec-Bench questions, chat template) with the same verifier,
dtype, threads and max_new_tokens. Wall time includes the prefill. Methods:

- plain (transformers +fix): ``model.generate`` of the verifier with metasd's LM-head stride fix
  (``metasd.core.execution.hooks.contiguous_lm_head_input``) - the reference every speedup is measured against;
- UAG (transformers +fix): transformers' universal assisted generation with the same assistant model, ``generate(...,
  assistant_model=, tokenizer=, assistant_tokenizer=)`` with its default schedule (greedy: translation through text;
  sampling: its vocabulary-intersection variant, which prunes the assistant's LM head in place - so it gets its own
  copy of the assistant, with a dense head of the dequantized weight where the assistant is quantized, since the
  pruning reads the head's ``weight``). The fix is applied to the verifier and the assistant before every call: under
  sampling, transformers replaces the assistant's head by its pruned wrapper on the first (untimed warm-up) call,
  and the fix then wraps that wrapper's input, so every timed call has it;
- metasd cross-tokenizer k=K: the assistant alone as a ``pretrained`` drafter with ``tokenizer: own``;
- any ``--extra-pool NAME=pool.yaml`` (its models are shared with the ones loaded here when the references match);
- with ``--as-shipped``: plain and UAG without the fix, labelled "(as shipped)" (never a denominator).

Order, repeats and statistics as in ``benchmarks/speed.py``: ``--repeats N`` (default 3) interleaved repeats; within
each (prompt, repeat) all methods, plain included, in an order rotated by prompt index + repeat; greedy: the
reference output and plain's top-two logit margins come from a separate untimed pass with ``output_logits=True``
once per prompt; tables give medians over repeats and [min, max] of per-repeat ratios, with verdicts ("faster" /
"slower" only where ranges do not overlap) and per-prompt outliers.

``--temperature T`` samples every method at temperature T (the same seed for each prompt); outputs then differ by
design and only speed is compared.

A prompt on which transformers' UAG raises (transformers 5.24 with Gemma-3 as the assistant fails once the assistant's
context passes its 512-token sliding window: an attention-mask size mismatch) is recorded with the error for that
method; the tables then compare every method over the prompts all of them finished, and the others without UAG over
all prompts. An error of a metasd method is not caught.

    python benchmarks/cross_tokenizer.py --repeats 3 --out benchmarks/results/cross_tokenizer.json
    python benchmarks/cross_tokenizer.py --temperature 1 --repeats 3 --out benchmarks/results/cross_tokenizer_t1.json
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
from metasd.core.execution.hooks import contiguous_lm_head_input
from metasd.models import load_model
from metasd.models.quantize import QuantizedLinear
# benchmarks/speed.py, beside this file (on sys.path when run as a script)
from speed import PLAIN, add_run_options, engine_figures, hf, outlier_table, run_repeats, steps_table, summary_table

REFERENCE = PLAIN
UAG = "UAG (transformers +fix)"
COMPARE = ((UAG, "UAG(+fix)"),)


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
        plain = lambda ids: _sampled(vm, ids, n, temperature, args.seed)  # noqa: E731
        uag_fn = lambda ids: _sampled(vm, ids, n, temperature, args.seed, **uag)  # noqa: E731
    else:
        plain = lambda ids: baselines.plain(vm, ids, n)  # noqa: E731
        uag_fn = lambda ids: baselines.assisted(vm, am, ids, n, tokenizer=vt, assistant_tokenizer=at)  # noqa: E731
    methods = {REFERENCE: hf(plain, vm), UAG: hf(uag_fn, vm, uag_assistant)}
    if args.as_shipped:  # opt-in, never a denominator
        methods["plain (as shipped)"] = hf(plain, vm, fix=False)
        methods["UAG (as shipped)"] = hf(uag_fn, vm, uag_assistant, fix=False)
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


def margins_pass(args, vm):
    """Greedy: callable(prompt_ids) -> (reference ids, margins), the untimed plain pass with ``output_logits=True``;
    sampling: None (no identity check)."""
    if args.temperature > 0:
        return None

    def run(ids):
        contiguous_lm_head_input(vm)
        out, _, margins = baselines.plain_with_margins(vm, ids, args.max_new_tokens)
        return out, margins
    return run


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
    p.add_argument("--as-shipped", action="store_true",
                   help="also time plain and UAG as transformers ships them (no LM-head fix), labelled '(as shipped)'")
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
    probe = Engine(Verifier(vm, vt), [])
    rows = run_repeats(args, argv, questions, methods, probe, margins_pass(args, vm),
                       may_fail=lambda name: name.startswith("UAG"))  # transformers' UAG only, recorded and shown
    print(tables(rows))
    return 0


def tables(rows: list[dict]) -> str:
    """Summary (medians over repeats, ranges, verdicts), outliers and steps tables; with failed runs, over the
    (prompt, repeat) rows every method finished and then without the failing methods over all rows."""
    failed = {name: sum("error" in r["methods"].get(name, {}) for r in rows) for name in rows[0]["methods"]}
    failed = {name: n for name, n in failed.items() if n}
    if not failed:
        return "\n\n".join([summary_table(rows, compare=COMPARE), outlier_table(rows), steps_table(rows)])
    finished = [r for r in rows if not any("error" in e for e in r["methods"].values())]
    without = [{**r, "methods": {k: v for k, v in r["methods"].items() if k not in failed}} for r in rows]
    why = ", ".join(f"{name} failed on {n}" for name, n in failed.items())
    text = f"All {len(rows)} (prompt, repeat) runs, without the methods that failed on some ({why}):\n\n"
    text += "\n\n".join([summary_table(without, compare=COMPARE), outlier_table(without), steps_table(without)])
    if finished:
        text += (f"\n\nThe {len(finished)} (prompt, repeat) runs every method finished:\n\n"
                 + summary_table(finished, compare=COMPARE))
    return text


if __name__ == "__main__":
    sys.exit(main())
