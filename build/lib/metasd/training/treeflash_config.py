"""The YAML config of ``metasd train treeflash`` (``TrainTreeFlashConfig``): model shape, reduced vocabulary, the two
stages' schedules and the drafting defaults the validation uses (docs/algorithms.md#treeflash)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from metasd.config import read_yaml_mapping, validate_config

from .common import FeatureTrainingConfig, OptimSection


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    """Drafter architecture (see ``metasd.drafters.treeflash_backbone.TreeFlashConfig``)."""

    hidden_size: int = Field(768, ge=8, description="internal width of the drafter layers")
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(12, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(2048, ge=1)
    ar_intermediate_size: int = Field(768, ge=1, description="I of the AR MLP (UG: 2H -> 2I)")
    block_size: int = Field(8, ge=2, description="B; drafts reach depth B-1")
    context_window: int = Field(128, ge=0, description="C: context positions a block sees (0: all)")
    context_layers: list[int] | None = Field(None, description="verifier hidden-state layers; default: every "
                                             "feature layer below the final-norm state")
    rope_theta: float = 10000.0
    output_norm: Literal["verifier", "own"] = Field("own", description="N before the frozen LM head: the "
                                                    "verifier's final norm (frozen) or a trainable one of the drafter")
    context_layer_norm: bool = Field(True, description="RMSNorm each verifier layer's states before fc")
    last_state: bool = Field(True, description="add the projected last committed context row to every block input")
    output_skip_layer: int | None = Field(None, description="Medusa-style identity-initialised skip from this "
                                          "verifier layer's last committed state to the output (one of context_layers)")


class StageSection(OptimSection):
    """One stage's schedule, plus the block anchors sampled per sequence."""

    steps: int = Field(200, ge=0, description="optimizer steps of the stage (sets the LR schedule)")
    lr: float = Field(6e-4, gt=0)
    anchors_per_sequence: int = Field(16, ge=1)


class DraftDefaults(_Strict):
    """Drafting parameters stored in the checkpoint (a pool entry's params override them)."""

    mode: Literal["chain", "marginal", "treeflash"] = "treeflash"
    m: int = Field(8, ge=1)
    k: int = Field(8, ge=1)
    tree_size: int = Field(32, ge=1)


class TrainTreeFlashConfig(FeatureTrainingConfig):
    """YAML config of ``metasd train treeflash``."""

    model: ModelSection = Field(default_factory=ModelSection)
    vocab_size: int = Field(32768, ge=0, description="reduced draft vocabulary; 0 = full vocabulary")
    target: Literal["soft", "verifier", "data"] = "soft"
    gamma: float | None = Field(4.0, gt=0, description="loss weight exp(-(j-1)/gamma) of block position j")
    stage1: StageSection = Field(default_factory=StageSection)
    stage2: StageSection = Field(default_factory=lambda: StageSection(lr=1e-3))
    defaults: DraftDefaults = Field(default_factory=DraftDefaults)
    bf16: bool = Field(True, description="bf16 autocast for matmuls (weights and optimizer stay fp32)")
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=1)
    save_every: int = Field(50, ge=1)
    val_anchors: int = Field(256, ge=1, description="held-out anchors for accuracies and chain figures")
    val_tree_anchors: int = Field(128, ge=0, description="held-out anchors for the final tree figures")
    val_anchors_per_sequence: int = Field(4, ge=1)
    mlflow_experiment: str = "metasd-treeflash"


def load_train_treeflash_config(path: str | Path, device: str | None = None) -> TrainTreeFlashConfig:
    """Read and validate a training file (``device``: overrides its device); ``ConfigError`` (a ``ValueError``)
    names the file and the field."""
    raw = read_yaml_mapping(path, "training config")
    return validate_config(TrainTreeFlashConfig, {**raw, **({"device": device} if device else {})}, str(path),
                           "treeflash training config")
