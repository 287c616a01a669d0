"""``metasd train steering CONFIG``: the steering trainer's command line (``--set KEY=VALUE`` overrides any field)."""
from __future__ import annotations

import argparse
import sys

import yaml

from metasd.config import ConfigError

from .devices import DEVICE_HELP
from .steering import train_steering
from .steering_config import read_config


def add_train_steering_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``steering`` under ``metasd train``: ``metasd train steering CONFIG``."""
    p = subparsers.add_parser("steering", help="train an SD² steering module (or a distilled drafter)",
                              description="Train an SD² steering module (or a distilled drafter) on cached verifier features.")
    p.add_argument("config", help="training YAML (schema: metasd.training.steering_config.SteeringTrainingConfig)")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in out_dir")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--wall-limit", type=float, default=None, help="override train.wall_limit_s (seconds)")
    p.add_argument("--out-dir", default=None, help="override out_dir")
    p.add_argument("--device", default=None, help=f"override train.device ({DEVICE_HELP})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any dotted key, VALUE read as YAML (e.g. --set train.lr=1e-2 --set steering.rank=null); "
                        "repeatable")
    p.set_defaults(func=train_steering_main)
    return p


def train_steering_main(args: argparse.Namespace) -> int:
    overrides = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.wall_limit is not None:
        overrides["train.wall_limit_s"] = args.wall_limit
    if args.out_dir is not None:
        overrides["out_dir"] = args.out_dir
    if args.device is not None:
        overrides["train.device"] = args.device
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            print(f"error: --set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.lr=1e-2", file=sys.stderr)
            return 2
        overrides[key.strip()] = yaml.safe_load(value)
    try:
        cfg = read_config(args.config, overrides)
        train_steering(cfg, fresh=args.fresh)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
