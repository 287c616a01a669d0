"""The steering trainer's data: the sequences of some shards of a verifier feature directory (one shard in
memory at a time, only the keys training needs), their epoch order, and the guide-input statistics."""
from __future__ import annotations

from pathlib import Path

import torch


class SteeringSequences:
    """Sequences of some shards of a feature directory, loading one shard at a time (only needed keys)."""

    def __init__(self, path: Path, shard_paths: list[Path], layers: list[int]):
        from safetensors import safe_open

        self.paths = shard_paths
        self.keys = ["ids", "loss_mask", "topk_ids", "topk_logp"] + [f"hidden_{layer}" for layer in sorted(set(layers))]
        self.index: list[tuple[int, int, int]] = []  # (shard, start row, end row)
        for s, p in enumerate(shard_paths):
            with safe_open(str(p), framework="pt") as f:
                off = f.get_tensor("offsets").tolist()
            self.index += [(s, a, b) for a, b in zip(off[:-1], off[1:])]
        self._shard, self._data = -1, None

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, a, b = self.index[i]
        return {k: v[a:b] for k, v in self.shard(s).items()}

    def shard(self, s: int) -> dict[str, torch.Tensor]:
        """Every row of shard ``s`` (the one kept in memory)."""
        from safetensors import safe_open

        if s != self._shard:
            with safe_open(str(self.paths[s]), framework="pt") as f:
                self._data = {k: f.get_tensor(k) for k in self.keys}
            self._shard = s
        return self._data

    def epoch_order(self, seed: int, epoch: int) -> list[int]:
        """Shards in random order, sequences shuffled inside each shard (one shard load per shard)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        by_shard: dict[int, list[int]] = {}
        for i, (s, _, _) in enumerate(self.index):
            by_shard.setdefault(s, []).append(i)
        order = []
        for s in torch.randperm(len(self.paths), generator=g).tolist():
            seqs = by_shard.get(s, [])
            order += [seqs[j] for j in torch.randperm(len(seqs), generator=g).tolist()]
        return order


def guide_input_stats(data: "SteeringSequences", layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std of the concatenated guide input over every position of ``data``."""
    total, total_sq, n = None, None, 0
    for shard in range(len(data.paths)):
        rows = data.shard(shard)
        x = torch.cat([rows[f"hidden_{layer}"] for layer in layers], dim=-1).double()  # [rows, n_in * d_v]
        total = x.sum(0) if total is None else total + x.sum(0)
        total_sq = (x * x).sum(0) if total_sq is None else total_sq + (x * x).sum(0)
        n += x.shape[0]
    mean = total / n
    var = (total_sq / n - mean * mean).clamp_min(0)
    return mean.float(), var.sqrt().float()
