"""The pool options ``metasd generate`` and ``metasd serve`` share: ``--drafter``, ``--k``, ``--param``, ``--policy``,
``--granularity``, ``--reward``, ``--dtype``, ``--backend`` (and the verifier, ``--verifier`` or serve's MODEL),
applied to a pool file's mapping and checked before any model loads; and the help formatter both commands use.

Here, below both commands (``metasd.cli`` is above ``metasd.serve``, which may not import it), so neither copies it.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import get_args

from metasd.core.decoding.rewards import RewardName

from .files import read_yaml_mapping
from .schema import select_entries


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" for options that have a default, once: not for None, flags (store_true / store_false) or
    help text that already says what the default is."""

    def _get_help_string(self, action):
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _policy_names() -> str:
    try:
        from metasd.core.decoding.policy import POLICIES
        importlib.import_module("metasd.policies")
        return ", ".join(sorted(POLICIES))
    except ImportError:  # pragma: no cover - a broken install still gets a parser
        return "ucb, thompson, exp3, ..."


def add_pool_options(p: argparse.ArgumentParser) -> None:
    """The drafter and policy options of ``metasd generate`` and ``metasd serve`` (the verifier is each command's)."""
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
    p.add_argument("--reward", choices=list(get_args(RewardName)),
                   help="what the policy maximises (default: the pool's)")
    p.add_argument("--dtype", help="auto | bf16 | fp32 | fp16 (default: the pool's)")
    p.add_argument("--backend", choices=["torch", "llama.cpp"],
                   help="what runs the verifier's forwards (default: the pool's): torch, or llama.cpp on a GGUF of the "
                        "same weights (pip install 'metasd[llama-cpp]'; CPU; drafters stay on torch)")


def _base_path(args, default: Path | None) -> Path | str:
    if args.pool:
        return args.pool
    if default is not None:
        return default
    from .build import default_pool_path

    return default_pool_path()


def pool_overrides(args, default: Path | None = None, drafters: list[dict] | None = None) -> dict:
    """The pool file's mapping (``args.pool``, else ``default``, else the embedded default pool) with the
    command-line overrides applied; ``drafters``: entries that replace the pool's (serve's --speculative-config).
    Validated once, by the caller."""
    cfg = read_yaml_mapping(_base_path(args, default), "pool config")
    backend = getattr(args, "backend", None)
    if args.verifier or args.dtype or backend:
        verifier = dict(cfg["verifier"]) if isinstance(cfg.get("verifier"), dict) else {}
        if args.verifier:
            verifier["model"] = args.verifier
        if args.dtype:
            verifier["dtype"] = args.dtype
        if backend:
            verifier["backend"] = backend
        cfg["verifier"] = verifier
    if drafters is not None:  # the drafters as given, alone: no arm "none", no adaptive sizing of their drafts
        cfg["drafters"], cfg["no_speculation_arm"] = drafters, False
        cfg.pop("serving", None)
    takes_k = []  # the chosen chain drafters --k sets
    if args.drafter:  # the chosen entries become the arms; a fused entry keeps the entries it drafts with
        entries = list(pool_drafters(cfg).values())
        for ref in dict.fromkeys(args.drafter):
            if ref != "none" and ref not in {d["name"] for d in entries}:
                entries.append({"name": "ngram", "type": "ngram", "params": {}} if ref == "ngram" else
                               {"name": ref, "type": "pretrained", "model": ref, "params": {}})
        cfg["drafters"] = select_entries(entries, [ref for ref in args.drafter if ref != "none"])
        takes_k = [d for d in cfg["drafters"] if d["arm"] and d.get("type") in ("pretrained", "ngram", "steered")]
    if args.k is not None and not takes_k:  # never dropped in silence
        raise ValueError(f"--k {args.k}: no chosen drafter drafts a chain of k tokens (--k applies to the drafters "
                         f"--drafter names of type pretrained, ngram or steered; others: --param NAME.KEY=VALUE)")
    if args.k is not None:
        for d in takes_k:
            d["params"] = {**(d.get("params") or {}), "k": args.k}
    entries = pool_drafters(cfg)
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


def pool_drafters(cfg: dict) -> dict:
    """The pool mapping's drafter entries by name."""
    drafters = cfg.get("drafters") if isinstance(cfg.get("drafters"), list) else []
    return {d["name"]: d for d in drafters if isinstance(d, dict) and isinstance(d.get("name"), str)}


def check_pool_options(args, default: Path | None = None, verifier_option: str = "--verifier") -> None:
    """--k, --param, --policy, --dtype, the verifier and --drafter references: ``ValueError`` naming the option and
    what it accepts. Cheap (no model, no network), so it runs before the pool is built."""
    from metasd.models import ModelLoadError, check_model_reference

    if args.k is not None and args.k < 1:
        raise ValueError(f"--k must be an integer >= 1, got {args.k}")
    for item in args.param or []:
        parse_param(item)
    if args.policy:
        from .plugins import resolve_policy_class

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
            raise ValueError(f"{verifier_option} {args.verifier!r}: {e}") from None
    if args.drafter:
        names = sorted(pool_drafters(read_yaml_mapping(_base_path(args, default), "pool config")))
        for ref in args.drafter:
            if ref in ("none", "ngram") or ref in names:
                continue
            try:
                check_model_reference(ref)
            except ModelLoadError as e:
                raise ValueError(f"--drafter {ref!r} is not a drafter of the pool ({', '.join(names) or 'none'}), "
                                 f"'ngram' or 'none', nor a model reference: {e}") from None
