"""Command line: ``metasd generate``, ``metasd models``, ``metasd bench``, ``metasd train``."""
from __future__ import annotations

import argparse
import importlib
import json
import sys


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding")
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    p.add_argument("--pool", help="pool config YAML (default: the embedded default pool)")
    p.add_argument("--verifier", help="verifier model reference (overrides the pool's)")
    p.add_argument("--drafter", action="append",
                   help="use only this drafter: a name from the pool, a model reference (drafts with k tokens), "
                        "'ngram', or 'none' for plain decoding; repeat for several")
    p.add_argument("--k", type=int, default=None, help="draft length for --drafter model references")
    p.add_argument("--policy", help="policy name (ucb, thompson, exp3, ...), overrides the pool's")
    p.add_argument("--granularity", choices=["step", "request"])
    p.add_argument("--reward", choices=["throughput", "block_efficiency", "block_divergence"])
    p.add_argument("--dtype", help="auto | bf16 | fp32 | fp16 (overrides the pool's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to the prompt")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--stream", action="store_true", help="print text as it is committed")
    p.add_argument("--json", action="store_true", help="print the result and per-request stats as JSON")
    p.set_defaults(func=_generate)


def _pool_overrides(args) -> dict:
    from .config import read_pool_config

    cfg = read_pool_config(args.pool).model_dump()
    if args.verifier:
        cfg["verifier"]["model"] = args.verifier
    if args.dtype:
        cfg["verifier"]["dtype"] = args.dtype
    if args.drafter:
        by_name = {d["name"]: d for d in cfg["drafters"]}
        chosen = []
        for ref in args.drafter:
            if ref == "none":
                continue
            if ref in by_name:
                d = dict(by_name[ref])
            elif ref == "ngram":
                d = {"name": "ngram", "type": "ngram", "params": {}}
            else:
                d = {"name": ref, "type": "pretrained", "model": ref, "params": {}}
            if args.k is not None and d["type"] in ("pretrained", "ngram", "steered"):
                d["params"] = {**d.get("params", {}), "k": args.k}
            chosen.append(d)
        cfg["drafters"] = chosen
    if args.policy:
        cfg["policy"] = {"name": args.policy, "params": {}, "seed": cfg["policy"].get("seed")}
    if args.granularity:
        cfg["granularity"] = args.granularity
    if args.reward:
        cfg["reward"] = args.reward
    return cfg


def _generate(args) -> int:
    import torch

    from .config import build_engine, parse_pool_config

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("metasd generate: the prompt is empty", file=sys.stderr)
        return 2
    config = parse_pool_config(_pool_overrides(args), source=args.pool or "default pool")
    from pathlib import Path

    engine = build_engine(config, Path(args.pool).resolve().parent if args.pool else None)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop, chat=not args.raw)
    if args.stream and not args.json:
        gen = engine.stream(prompt, **kwargs)
        try:
            while True:
                print(next(gen), end="", flush=True)
        except StopIteration as done:
            result = done.value
        print()
    else:
        result = engine.generate(prompt, **kwargs)
        if args.json:
            print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict()}))
            return 0
        print(result.text)
    print(f"[metasd] {result.stats.summary()}", file=sys.stderr)
    return 0


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list bundled models and their cache state")
    p.add_argument("--prepare", metavar="NAME", help="assemble, check and cache a bundled model now")
    p.set_defaults(func=_models)


def _models(args) -> int:
    from .models import bundled_status, cache_dir, prepare_bundled

    if args.prepare:
        print(prepare_bundled(args.prepare.removeprefix("bundled:")))
        return 0
    print(f"cache: {cache_dir()}")
    for row in bundled_status():
        state = "cached" if row["cached"] else ("installed, not cached yet" if row["packages_installed"]
                                                else "packages missing: pip install -e '.[models]'")
        print(f"  {row['ref']:<36} {state:<28} {row['description']}")
    return 0


# Subcommands whose modules are imported only when used: (module, parser-adder)
_LAZY = {
    "bench": ("metasd.runner", "add_bench_parser"),
}
_TRAIN = {
    "features": ("metasd.training.features", "add_train_features_parser"),
    "steering": ("metasd.training.steering", "add_train_steering_parser"),
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
    from .config import ConfigError
    from .models import ModelLoadError, TokenizerMismatchError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelLoadError, TokenizerMismatchError, FileNotFoundError, ValueError) as e:
        print(f"metasd {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
