"""What every trainer on a verifier feature set shares: config fields, the train/validation split, shard reading
and sequence order, the learning-rate schedule, resumable state files, MLflow tracking, and the verifier's
embeddings/head loaded alone."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors import safe_open
from safetensors.torch import save_file

from metasd.config import expand_env_path
from metasd.config.tracking import DEFAULT_TRACKING_URI, artifact_location, require_extra, resolve_tracking_uri
from .devices import DEVICE_HELP, check_device, save_optimizer
from .features import FeatureSet, parse_shards

STATE_WEIGHTS = "model_fp32.safetensors"
STATE_OPTIM = "optimizer.pt"
STATE_META = "trainer.json"


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
    device: str = Field("auto", description=DEVICE_HELP)
    resume: bool = True
    mlflow: bool = True
    mlflow_experiment: str = "metasd-train"
    run_name: str | None = None

    _expand = field_validator("features", "draft_vocab", "state_dir", "out")(expand_env_path)
    _device = field_validator("device")(check_device)


class OptimSection(BaseModel):
    """AdamW schedule of a trainer (or of one TreeFlash stage): linear warmup, then cosine decay to
    ``min_lr_ratio * lr`` (``lr_at``); gradient clipping; a wall budget summed over resumed invocations."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(500, ge=0, description="optimizer steps (sets the LR schedule)")
    lr: float = Field(5e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    sequences_per_step: int = Field(4, ge=1)
    max_minutes: float | None = Field(None, gt=0, description="stop after this much training wall time "
                                      "(summed over resumed invocations)")


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


class ShardReader:
    """Reads the keys TreeFlash needs from shards, keeping the last two in memory."""

    def __init__(self, fs: FeatureSet, layers: list[int]):
        self.fs = fs
        self.keys = ["ids", "loss_mask", "offsets", "topk_ids", "topk_logp"] + [f"hidden_{l}" for l in layers]
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._order: list[int] = []

    def shard(self, s: int) -> dict[str, torch.Tensor]:
        if s not in self._cache:
            with safe_open(str(self.fs.shards[s]), "pt") as f:
                self._cache[s] = {k: f.get_tensor(k) for k in self.keys}
            self._order.append(s)
            while len(self._order) > 2:
                self._cache.pop(self._order.pop(0))
        return self._cache[s]

    def sequence(self, s: int, j: int) -> dict[str, torch.Tensor]:
        sh = self.shard(s)
        a, b = int(sh["offsets"][j]), int(sh["offsets"][j + 1])
        return {k: v[a:b] for k, v in sh.items() if k != "offsets"}

    def n_sequences(self, s: int) -> int:
        with safe_open(str(self.fs.shards[s]), "pt") as f:
            return len(f.get_tensor("offsets")) - 1


class Schedule:
    """Sequence order: per epoch a seeded permutation of shards, then of the sequences inside each
    shard (so consecutive steps read the same shard). Step s of a stage reads positions s*n .. s*n+n-1."""

    def __init__(self, counts: dict[int, int], seed: int):
        self.counts = counts
        self.total = sum(counts.values())
        self.seed = seed
        self._epochs: dict[int, list[tuple[int, int]]] = {}

    def _epoch(self, e: int) -> list[tuple[int, int]]:
        if e not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 7919 + e)
            shards = sorted(self.counts)
            order = []
            for i in torch.randperm(len(shards), generator=g).tolist():
                s = shards[i]
                order += [(s, j) for j in torch.randperm(self.counts[s], generator=g).tolist()]
            self._epochs = {e: order}  # keep one epoch
        return self._epochs[e]

    def batch(self, step: int, n: int) -> list[tuple[int, int]]:
        out = []
        for p in range(step * n, step * n + n):
            out.append(self._epoch(p // self.total)[p % self.total])
        return out


def lr_at(step: int, st) -> float:
    """Learning rate at ``step``: linear warmup, then cosine decay to ``min_lr_ratio * lr`` (``st``: any section
    with lr, warmup, steps, min_lr_ratio)."""
    if st.warmup and step < st.warmup:
        return st.lr * (step + 1) / st.warmup
    span = max(st.steps - st.warmup, 1)
    progress = min(max(step - st.warmup, 0) / span, 1.0)
    return st.lr * (st.min_lr_ratio + (1 - st.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def tracking_uri(explicit: str | None = None) -> str:
    """MLflow store of a trainer: ``explicit``, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here."""
    uri = resolve_tracking_uri(explicit)
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}" if uri == DEFAULT_TRACKING_URI else uri


def require_tracking(enabled: bool) -> None:
    """With MLflow logging on, ``MissingExtraError`` naming the ``bench`` extra unless MLflow is installed: trainers
    call it before they load data or models."""
    if enabled:
        require_extra("bench", "MLflow logging of a training run (on by default: 'mlflow: false' in the config, "
                      "'log: {mlflow: false}' for steering, trains without it)", "mlflow")


class Tracker:
    """MLflow logging of one training run, or nothing when disabled; shared by every trainer.

    A resumed run (``run_id``) continues the same MLflow run. A tracking hiccup (a locked SQLite file) while
    logging metrics or ending the run is a warning on stderr, not the end of a long run: the trainer's own
    state and log files hold everything."""

    def __init__(self, enabled: bool, experiment: str, run_name: str | None, run_id: str | None, params: dict,
                 uri: str | None = None, log=None):
        self.enabled = enabled
        self.run_id = run_id
        if not enabled:
            return
        require_tracking(enabled)
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri(uri))
        if mlflow.get_experiment_by_name(experiment) is None:  # artifacts beside a SQLite store, not in ./mlruns
            mlflow.create_experiment(experiment, artifact_location=artifact_location(tracking_uri(uri), experiment))
        mlflow.set_experiment(experiment)
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        self.run_id = run.info.run_id
        if run_id is None:
            mlflow.log_params(flatten(params))
        if log is not None:
            log(f"mlflow: {tracking_uri(uri)}, run {self.run_id}")

    def metrics(self, values: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        try:
            self.mlflow.log_metrics({k: float(v) for k, v in values.items() if math.isfinite(float(v))}, step=step)
        except Exception as e:  # noqa: BLE001 - see the class docstring
            print(f"warning: MLflow logging failed at step {step}: {type(e).__name__}: {e}", file=sys.stderr)

    def artifact(self, path: Path) -> None:
        if self.enabled:
            self.mlflow.log_artifact(str(path))

    def end(self, status: str = "FINISHED") -> None:
        if not self.enabled:
            return
        try:
            self.mlflow.end_run(status=status)
        except Exception as e:  # noqa: BLE001
            print(f"warning: MLflow end_run failed: {type(e).__name__}: {e}", file=sys.stderr)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """Nested mapping -> {"a.b": str(value)} (MLflow parameters; values cut to 500 characters)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:500]
    return out


def eos_ids(model) -> tuple[int, ...]:
    """``metasd.models.config_eos_ids``, sorted."""
    from metasd.models import config_eos_ids

    return tuple(sorted(config_eos_ids(model)))


def count_tokens(reader: ShardReader, shards: list[int], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in shards:
        with safe_open(str(reader.fs.shards[s]), "pt") as f:
            ids = f.get_tensor("ids")
            top1 = f.get_slice("topk_ids")[:, 0:1].reshape(-1)
        counts += torch.bincount(torch.cat([ids, top1]), minlength=vocab_size)[:vocab_size].double()
    return counts


def load_verifier_parts(ref: str):
    """The verifier with only its input embeddings, output embeddings and final norm loaded (the other
    weights stay on the meta device): about 1 GB instead of the whole model for a 1.5B verifier. Falls
    back to a full load for references that are not safetensors directories (GGUF files, hub ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from metasd.drafters.treeflash_backbone import final_norm_of
    from metasd.models import resolve_model, load_model

    src = resolve_model(ref)
    files = sorted(Path(src.path).glob("*.safetensors")) if src.kind in ("bundled", "dir") else []
    if not files:
        return load_model(ref, dtype="bf16")[0]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src.path))
    wanted = {}
    for mod in (model.get_input_embeddings(), model.get_output_embeddings(), final_norm_of(model)):
        for p in mod.parameters(recurse=False):
            wanted[id(p)] = p
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in wanted}
    state = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for key in set(sf.keys()) & names:
                state[key] = sf.get_tensor(key)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in names - set(state):  # tied weights are stored once, under one of their names
        twin = next((n for n in state if params[n] is params[name]), None)
        if twin is not None:
            state[name] = state[twin]
    missing = names - set(state)
    if missing:
        raise ValueError(f"{ref}: cannot find {sorted(missing)} in its safetensors files")
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False, assign=True)
    try:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(src.path)
    except (OSError, ValueError):
        pass
    return model.eval().requires_grad_(False)


def write_atomic(path: Path, write) -> None:
    """``write(tmp)`` to a temp file beside ``path``, then rename it over ``path``: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_state(state_dir: Path, model, opt, state: dict) -> None:
    """Write a resumable training state so that a kill at any moment leaves the previous one usable: the
    weights and optimizer go to files named by the step (each written to a temp file, then renamed), then
    ``STATE_META`` - the commit point - is replaced by one naming them; older files are removed last."""
    step = int(state["step"])
    files = {"weights": f"model_fp32.step{step}.safetensors", "optimizer": f"optimizer.step{step}.pt" if opt is not None else None}

    weights = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    write_atomic(state_dir / files["weights"], lambda p: save_file(weights, str(p)))
    if opt is not None:
        write_atomic(state_dir / files["optimizer"], lambda p: save_optimizer(opt, p))
    write_atomic(state_dir / STATE_META, lambda p: p.write_text(json.dumps({**state, "files": files}, indent=1)))
    keep = set(files.values()) | {STATE_META}
    for old in [*state_dir.glob("model_fp32*.safetensors"), *state_dir.glob("optimizer*.pt")]:
        if old.name not in keep:
            old.unlink(missing_ok=True)


def state_file(state_dir: Path, state: dict, kind: str) -> Path | None:
    """The weights (``kind="weights"``) or optimizer file the committed state ``state`` (``STATE_META``'s
    contents) names; states written before step-named files read the fixed names."""
    legacy = {"weights": STATE_WEIGHTS, "optimizer": STATE_OPTIM}[kind]
    name = (state.get("files") or {}).get(kind, legacy) if "files" in state else legacy
    return None if name is None else state_dir / name
