"""What every trainer on a verifier feature set shares: its config fields and the train/validation split."""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .features import FeatureSet, parse_shards


class FeatureTrainingConfig(BaseModel):
    """Data, checkpoint, run and tracking fields of ``metasd train block|treeflash`` configs."""

    model_config = ConfigDict(extra="forbid")

    features: str = Field(description="verifier feature directory (manifest.json + shards)")
    verifier: str = Field(description="model reference of the verifier the features came from (LM head, tokenizer)")
    out: str = Field(description="checkpoint directory written for the drafter")
    state_dir: str | None = Field(None, description="resumable training state (default <out>/train_state)")
    train_shards: str | None = Field(None, description="e.g. '0-22' or '0,1,4-6'; default: every shard not in val_shards")
    val_shards: str | None = Field(None, description="held-out shards; default: the last 2")
    require_complete: bool = Field(True, description="fail unless every shard the manifest announces exists")
    draft_vocab: str | None = Field(None, description="reuse this DraftVocab file instead of counting")
    save_dtype: Literal["bf16", "fp32"] = "bf16"
    seed: int = 0
    threads: int | None = Field(None, ge=1)
    resume: bool = True
    mlflow: bool = True
    mlflow_experiment: str = "metasd-train"
    run_name: str | None = None


def split_shards(cfg: FeatureTrainingConfig, fs: FeatureSet) -> tuple[list[int], list[int]]:
    """(train, validation) shard indices of ``fs`` from ``cfg``; checks completeness and overlap."""
    n = len(fs.shards)
    expected = math.ceil(fs.manifest["n_sequences"] / fs.manifest["shard_size"])
    if cfg.require_complete and n != expected:
        raise ValueError(f"{cfg.features} holds {n} of the {expected} shards its manifest announces (extraction "
                         "unfinished?); wait, or set require_complete: false")
    val = parse_shards(cfg.val_shards, n) if cfg.val_shards else list(range(max(0, n - 2), n))
    train = parse_shards(cfg.train_shards, n) if cfg.train_shards else [s for s in range(n) if s not in val]
    if set(train) & set(val):
        raise ValueError(f"train shards {sorted(set(train) & set(val))} are also validation shards")
    if not train:
        raise ValueError("no training shards")
    return train, val
