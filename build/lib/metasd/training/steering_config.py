"""The steering trainer's configuration file (``metasd train steering CONFIG``): its schema, validated by
pydantic so that an error names the file, the field path and the allowed values, and how it is read
(dotted overrides such as ``train.steps`` applied before validation). The trainer is
``metasd.training.steering``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from metasd.config import expand_env_path, read_yaml_mapping, validate_config
from .devices import DEVICE_HELP, check_device


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DataConfig(_Strict):
    features: str = Field(description="feature directory (metasd.training.features)")
    train_shards: list[int] | None = Field(default=None, description="shard indices; default: all but val_shards")
    val_shards: list[int] = Field(default_factory=list, description="held-out shard indices for validation")
    val_sequences: int = Field(default=16, ge=0, description="validation sequences (the first of val_shards)")

    _expand = field_validator("features")(expand_env_path)


class SteeringConfig(_Strict):
    enabled: bool = True
    guide_layers: list[int] | None = Field(default=None, description="verifier hidden_states indices (low, mid, high)")
    verifier_layers: int | None = Field(default=None, gt=0, description="verifier depth, for the default guide layers")
    layers: Literal["all"] | int | list[int] = Field(default="all", description="steered drafter layers: all, last N, or a list")
    rank: int | None = Field(default=None, gt=0, description="low-rank projection d_v -> rank -> n*d_out; None = full rank")
    injection: Literal["up", "mlp_out"] = "up"
    guide_norm: Literal["none", "standardize"] = Field(
        default="none", description="standardize: z-score each guide input dimension with the training features' "
                                    "mean and std (computed once, stored in the module)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the normalised guide during training")
    train_guide: bool = Field(default=True, description="train W_hml (the guide's [low; mid; high] -> d_v mixing, "
                              "3 d_v^2 parameters); false keeps it at its [I I I] initialisation")


class TrainConfig(_Strict):
    steps: int = Field(default=1000, gt=0)
    batch_size: int = Field(default=4, gt=0, description="sequences per optimizer step")
    lr: float = Field(default=1e-3, gt=0, description="steering module learning rate")
    drafter_lr: float = Field(default=2e-5, gt=0, description="learning rate of fine-tuned drafter layers")
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float | None = Field(default=1.0, gt=0)
    k: int = Field(default=5, gt=0, description="maximum guide staleness (draft length)")
    min_staleness: int = Field(default=1, ge=0, description="smallest guide staleness o; 1 is what inference sees. "
                               "0 is a diagnostic only: the guide is the verifier state that predicts the very "
                               "token the drafter is trained on, an upper bound the drafter can never use")
    loss: Literal["kl", "tvd", "top1"] = Field(
        default="kl", description="kl: forward KL to the verifier's top-k; tvd: total variation (what sampled "
                                  "acceptance depends on); top1: cross-entropy on the verifier's most likely token "
                                  "(what greedy acceptance checks)")
    seed: int = 0
    dtype: Literal["auto", "bf16", "fp32"] = Field(default="auto", description="compute dtype of the drafter forward")
    threads: int | None = Field(default=None, gt=0)
    device: str = Field(default="auto", description=DEVICE_HELP)
    wall_limit_s: float | None = Field(default=None, gt=0, description="stop (checkpoint, export) after this long")

    _device = field_validator("device")(check_device)


class LogConfig(_Strict):
    log_every: int = Field(default=10, gt=0)
    val_every: int = Field(default=100, gt=0)
    checkpoint_every: int = Field(default=50, gt=0)
    keep_checkpoints: int = Field(default=2, gt=0)
    keep_best: bool = Field(default=True, description="also export the best module so far (``best_by``) to "
                                                       "out_dir/best/ (validation steps only)")
    best_by: Literal["kl", "agree"] = Field(default="kl", description="held-out metric keep_best selects on: lowest "
                                                                        "KL, or highest top-1 agreement")
    mlflow: bool = True
    tracking_uri: str | None = Field(default=None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db")
    experiment: str = "metasd-steering"
    run_name: str | None = None


class SteeringTrainingConfig(_Strict):
    """``metasd train steering CONFIG``: the YAML schema."""

    drafter: str = Field(description="drafter model reference (bundled:<name>, a local HF dir, ...)")
    out_dir: str
    data: DataConfig
    steering: SteeringConfig = Field(default_factory=SteeringConfig)
    finetune: Literal["none", "all"] | int | list[int] = Field(
        default="none", description="drafter layers trained too: none, all, the last N, or a list")
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    save_dtype: Literal["fp32", "bf16"] = "fp32"


def parse_config(raw: dict[str, Any], source: str = "<config>") -> SteeringTrainingConfig:
    return validate_config(SteeringTrainingConfig, raw, source, "steering training config")


def read_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SteeringTrainingConfig:
    """Read a steering training file; ``overrides`` set dotted keys (``train.steps``) before validation."""
    raw = read_yaml_mapping(path, "training config")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, last = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return parse_config(raw, str(path))
