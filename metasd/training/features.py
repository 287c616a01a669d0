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


def extract_features(model, examples: Sequence[Example], out_dir: str | Path, layers: Sequence[int], topk: int = 32,
                     shard_size: int = 32, meta: dict | None = None, log=print) -> Path:
    """Run the verifier over ``examples`` and write the shards that are missing."""
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
