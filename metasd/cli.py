"""Command line: ``metasd generate``, ``metasd models``, ``metasd bench``, ``metasd serve``, ``metasd train``."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from metasd.config.cli_options import HelpFormatter, add_pool_options, check_pool_options
from metasd.config.cli_options import pool_overrides as _pool_overrides  # noqa: F401 - the tests call it from here

#: ``metasd generate``'s and ``Engine.generate``'s default (the server follows OpenAI's: docs/serving.md#requests)
DEFAULT_MAX_NEW_TOKENS = 128

# generate's request options, as the CLI spells them in errors (the checks: metasd.core.decoding.sampling.check_request)
_REQUEST_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "top_k": "--top-k", "min_p": "--min-p", "threads": "--threads"}


def _add_generate(sub) -> None:
    from metasd.core.decoding.sampling import REQUEST_LIMITS

    def allowed(key: str) -> str:
        return REQUEST_LIMITS[key][1]

    p = sub.add_parser("generate", help="generate text with speculative decoding", formatter_class=HelpFormatter,
                       description="Generate text with speculative decoding. Every option and the pool file are "
                                   "checked before any model loads.")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--pool", help="pool config YAML, or an embedded pool by name: default (configs/default.yaml) or "
                                  "gpu_default (configs/gpu_default.yaml); default: gpu_default where CUDA is, else "
                                  "default (the choice is printed)")
    p.add_argument("--verifier", help="verifier model reference (overrides the pool's): bundled:<name>, a local HF "
                                      "directory or .gguf file, or a hub id")
    add_pool_options(p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate: {allowed('max_new_tokens')}")
    p.add_argument("--temperature", type=float, default=0.0, help=f"sampling temperature: {allowed('temperature')}")
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus sampling mass: {allowed('top_p')} (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help=f"keep the k most likely tokens: {allowed('top_k')}")
    p.add_argument("--min-p", type=float, default=0.0,
                   help=f"drop a token less likely than min-p times the most likely one: {allowed('min_p')}")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--suffix", help="fill in the middle: the code after the gap (the prompt is the code before it, "
                                    "never a chat turn), in the verifier's fill-in-the-middle format; the answer is "
                                    "the gap's text")
    structured = p.add_argument_group("structured output (one of them; needs llguidance: pip install "
                                      "'metasd[structured]')").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="SCHEMA", help="the answer is a JSON object valid under this "
                            "JSON schema: its JSON text, or a file holding it")
    structured.add_argument("--regex", help="the answer fully matches this regular expression (Rust's regex syntax)")
    structured.add_argument("--grammar", metavar="LARK", help="the answer is in the language of this Lark grammar "
                            "(llguidance's dialect, rule 'start'): its text, or a file holding it")
    structured.add_argument("--choice", action="append", help="the answer is exactly one of these strings "
                            "(repeatable)")
    p.add_argument("--raw", action="store_true",
                   help="encode the prompt as it is; without it the prompt is a user message through the chat template "
                        "(Engine.generate and /v1/completions take a string as it is)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads: {allowed('threads')} (default: torch's choice)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print text as it is committed (default: when the output is a terminal and --json is not given)")
    p.add_argument("--json", action="store_true", help="print the result and per-request stats as JSON")
    p.add_argument("--input", help="JSONL of requests served concurrently (format: metasd/core/batching/offline.py), needs --output")
    p.add_argument("--output", help="with --input: the JSONL file of results, a line per request as it finishes")
    p.add_argument("--max-batch", type=int, default=8, help="with --input: requests verified together per step")
    p.set_defaults(func=_generate)


def _check_options(args) -> None:
    """Request options, then the pool options (--k, --param, --policy, --dtype, --verifier, --drafter): ``ValueError``
    naming the option and what it accepts. Cheap (no model, no network), so it runs before the pool is built."""
    from metasd.core.decoding.sampling import check_request

    check_request(_REQUEST_OPTIONS, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, threads=args.threads)
    check_pool_options(args)
    if args.suffix is not None and args.input:
        raise ValueError("--suffix fills in the middle between the prompt and it: it takes no --input")
    if args.json and args.stream:
        raise ValueError("--stream and --json go apart: --json prints one record once the text is done "
                         "(use --no-stream, or leave --stream out)")
    args.constraint = _constraint(args)


#: the structured-output options, by the request field each fills
_STRUCTURED = {"guided_json": "--json-schema", "guided_regex": "--regex", "guided_grammar": "--grammar",
               "guided_choice": "--choice"}


def _constraint(args):
    """The structured output the options ask for (None: none), checked (the grammar compiled without a tokenizer),
    or ``ValueError`` naming the option."""
    from metasd.core.constraints import INSTALL_HINT, ConstraintError, constraint_from_fields
    from metasd.core.constraints.backend import available

    def text_or_file(value: str | None) -> str | None:
        path = Path(value) if value and "\n" not in value and len(value) < 4096 else None
        return path.read_text() if path is not None and path.is_file() else value

    fields = {"guided_json": text_or_file(args.json_schema), "guided_regex": args.regex,
              "guided_grammar": text_or_file(args.grammar), "guided_choice": args.choice}
    given = next((_STRUCTURED[k] for k, v in fields.items() if v is not None), None)
    if given is not None and not available():
        raise ValueError(f"{given} needs the grammar library: {INSTALL_HINT}")
    try:
        return constraint_from_fields(fields)
    except ConstraintError as e:
        field, _, part = e.field.partition(".")
        raise ValueError(f"{_STRUCTURED.get(field, given)}{f' (at {part})' if part else ''}: {e.reason}") from None


def _check_context(verifier: str, prompt: str, args) -> None:
    """Refuse, before any model loads, a prompt and ``--max-new-tokens`` that do not fit the verifier's context, when
    its config and tokenizer can be read without loading it (a prepared bundled model, a local directory)."""
    from metasd.core.decoding.request import check_context
    from metasd.models import context_length, load_tokenizer

    limit = context_length(verifier)
    if limit is None:
        return  # checked by the engine once the model is loaded
    if args.max_new_tokens >= limit:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} does not fit the context of {verifier} ({limit} tokens)")
    ids = _prompt_ids(load_tokenizer(verifier), prompt, args, verifier)
    check_context(len(ids), args.max_new_tokens, limit, verifier)


def _prompt_ids(tokenizer, prompt: str, args, verifier: str) -> list[int]:
    """The prompt's token ids: a chat turn (a string with ``--raw``), or with ``--suffix`` the fill-in-the-middle
    prompt of the gap between it and the suffix (ValueError naming the model when it has no such format)."""
    from metasd.core.decoding.prompt import encode_infill
    from metasd.core.decoding.request import encode_prompt

    if args.suffix is not None:
        return encode_infill(tokenizer, prompt, args.suffix, verifier).ids
    return encode_prompt(tokenizer, prompt, chat=not args.raw, model_name=verifier)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        print("metasd generate: reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr, flush=True)
    return sys.stdin.read()


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def _should_stream(args) -> bool:
    """--stream / --no-stream when given; otherwise stream to a terminal (never with --json, which --stream refuses)."""
    if args.json:
        return False
    return _stdout_is_terminal() if args.stream is None else args.stream


def _generate(args) -> int:
    from metasd.config import ConfigError, check_model_references, check_quantization, parse_pool_config
    from metasd.config.build import default_pool_choice, pool_argument

    # everything that can be checked without a model is checked first: options, pool file, references, devices
    _check_options(args)
    args.pool = pool_argument(args.pool)  # an embedded pool's name: its file
    source = args.pool or default_pool_choice()
    if args.param:
        source += " with --param " + " ".join(args.param)  # so a refused value is traced to the option
    config = parse_pool_config(_pool_overrides(args), source=source)
    check_model_references(config, source, Path(args.pool).resolve().parent if args.pool else None)
    try:
        check_quantization(config)  # also resolves each device and dtype
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if bool(args.input) != bool(args.output) or (args.input and args.prompt):
        raise ValueError("--input and --output go together, without a prompt")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.input:
        from metasd.core.batching.offline import read_requests, run_offline
        try:
            lines = Path(args.input).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--input {args.input}: {getattr(e, 'strerror', None) or e}") from None
        out_dir = Path(args.output).resolve().parent
        if not out_dir.is_dir() or not os.access(out_dir, os.W_OK) or Path(args.output).is_dir():
            raise ValueError(f"--output {args.output}: not a file that can be written (its folder must exist)")
        requests = read_requests(lines, dict(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, stop=args.stop, chat=not args.raw, constraint=args.constraint))
    else:
        prompt = _read_prompt(args)
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        _check_context(config.verifier.model, prompt, args)

    import torch

    from metasd.config import build_engine
    from metasd.core.engine import GenerationInterrupted
    from metasd.models import needs_preparing
    from metasd.models.machine import warn_if_oversubscribed

    if args.threads:
        torch.set_num_threads(args.threads)
    warn_if_oversubscribed()
    first = [ref for ref in dict.fromkeys([config.verifier.model, *(d.model for d in config.drafters if d.model)])
             if needs_preparing(ref)]
    if first:
        print(f"[metasd] first use of {', '.join(first)}: assembling and converting into the model cache (a few minutes "
              f"and about 6 GB of RAM, once)", file=sys.stderr, flush=True)
    print(f"[metasd] loading {source}", file=sys.stderr, flush=True)
    stream, shown, gen = _should_stream(args), 0, None
    try:  # Ctrl-C: what was generated so far, then its stats; exit 130, no traceback
        t0 = time.perf_counter()
        engine = build_engine(config, Path(args.pool).resolve().parent if args.pool else None)
        print(f"[metasd] loaded in {time.perf_counter() - t0:.1f} s: verifier {engine.verifier.describe()}",
              file=sys.stderr, flush=True)
        if args.input:
            with open(args.output, "w") as out:
                done, failed = run_offline(engine, requests, out, max_batch=args.max_batch)
            print(f"[metasd] {done} requests written to {args.output}, {failed} failed", file=sys.stderr)
            return 0
        kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop, chat=not args.raw,
                      constraint=args.constraint)
        if args.suffix is not None:  # fill in the middle: the format's prompt, ended by its end tokens
            infill = engine.encode_infill(prompt, args.suffix)
            prompt, kwargs["chat"], kwargs["stop_token_ids"] = infill.ids, False, infill.stop_token_ids
        if stream:
            gen = engine.stream(prompt, **kwargs)
            try:
                while True:
                    piece = next(gen)
                    print(piece, end="", flush=True)
                    shown += len(piece)
            except StopIteration as done:
                result, interrupted = done.value, False
        else:
            result, interrupted = engine.generate(prompt, **kwargs), False
    except KeyboardInterrupt as e:
        result, interrupted = GenerationInterrupted.result_of(e, gen), True
        if result is None:
            print("[metasd] interrupted", file=sys.stderr)
            return 130
    if stream:
        print(result.text[shown:])  # what the stream had not shown yet (a held-back tail), and the newline
    elif args.json:
        record = result.to_record()  # the per-request record metasd bench logs too
        print(json.dumps({"text": record.pop("text"), "token_ids": record.pop("token_ids"), "stats": record}))
    else:
        print(result.text)
    if interrupted or not args.json:
        print(f"[metasd] {'interrupted: ' if interrupted else ''}{result.stats.summary()}", file=sys.stderr)
    return 130 if interrupted else 0


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list bundled models and their cache state")
    p.add_argument("--prepare", metavar="NAME", help="assemble, check and cache a bundled model now")
    p.set_defaults(func=_models)


def _models(args) -> int:
    from metasd.models.bundled import bundled_status, cache_dir, prepare_bundled

    if args.prepare:
        print(prepare_bundled(args.prepare.removeprefix("bundled:")))
        return 0
    print(f"cache: {cache_dir()}")
    for row in bundled_status():
        state = model_cache_state(row)
        print(f"  {row['ref']:<36} {state:<28} {row['description']}")
        if row.get("cache_problem"):
            print(f"      damaged cache: {row['cache_problem']}; the next load rebuilds it, or now: "
                  f"metasd models --prepare {row['name']}")
    return 0


def model_cache_state(row: dict) -> str:
    """One word or phrase for a ``bundled_status`` row: cached, damaged, not cached yet, packages missing."""
    if row["cached"]:
        return "cached"
    if row.get("cache_problem"):
        return "cache damaged"
    return "installed, not cached yet" if row["packages_installed"] else \
        f"packages missing: pip install -e '.[{row.get('extra', 'models')}]'"


# Subcommands whose modules are imported only when used: (module, parser-adder)
_LAZY = {"bench": ("metasd.bench.command", "add_bench_parser"),
         "pack-weights": ("metasd.models.packed_weights", "add_pack_weights_parser"),
         "serve": ("metasd.serve.cli", "add_serve_parser")}
_TRAIN = {
    "features": ("metasd.training.features", "add_train_features_parser"),
    "steering": ("metasd.training.steering_cli", "add_train_steering_parser"),
    "treeflash": ("metasd.training.treeflash", "add_train_treeflash_parser"),
    "block": ("metasd.training.block", "add_train_block_parser"),
    "hidden_state": ("metasd.training.hidden_state", "add_train_hidden_state_parser"),
}


def _add_lazy(sub, table: dict, argv: list[str]) -> None:
    for name, (module, adder) in table.items():
        if name not in argv:  # cheap: only import the module of the command being run (or for --help)
            sub.add_parser(name, help=f"({name}: run with --help for its options)")
            continue
        try:
            getattr(importlib.import_module(module), adder)(sub)
        except (ImportError, AttributeError) as e:
            sub.add_parser(name, help=f"unavailable: {e}")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metasd", description="Lossless speculative decoding with a pool of drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_models(sub)
    _add_lazy(sub, _LAZY, argv)
    train = sub.add_parser("train", help="train a steering module or a drafter")
    train_sub = train.add_subparsers(dest="what", required=True)
    _add_lazy(train_sub, _TRAIN, argv[1:] if argv[:1] == ["train"] else [])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if not hasattr(args, "func"):
        print(f"metasd {args.command}: this command is not available in this installation", file=sys.stderr)
        return 2
    from metasd.config import ConfigError
    from metasd.models import ModelLoadError, TokenizerMismatchError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelLoadError, TokenizerMismatchError, FileNotFoundError, ValueError) as e:
        print(f"metasd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
