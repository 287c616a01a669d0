"""Resumable checkpoints of the steering trainer (``metasd.training.steering.SteeringTrainer``): written
atomically every ``log.checkpoint_every`` steps and when a run stops, refused on resume when the settings
that shape the run changed."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from metasd.config import ConfigError
from .devices import load_optimizer, save_optimizer
from .steering_config import SteeringTrainingConfig


def resume_key(cfg: SteeringTrainingConfig) -> dict[str, Any]:
    """Settings that must not change across a resume (steps, wall limit, threads, device and logging may)."""
    d = cfg.model_dump()
    t = dict(d["train"])
    for k in ("steps", "wall_limit_s", "threads", "device"):
        t.pop(k)
    return {"drafter": d["drafter"], "data": {k: v for k, v in d["data"].items() if k != "val_sequences"},
            "steering": d["steering"], "finetune": d["finetune"], "train": t}


def save_trainer_state(tr) -> Path:
    """Write ``out_dir/checkpoints/step_<n>/`` (trainable tensors in fp32, AdamW state, counters, the MLflow run
    id and the settings a resume must match) beside, then rename it and point ``latest`` at it; keep the newest
    ``log.keep_checkpoints``."""
    root = Path(tr.cfg.out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{tr.step:07d}"
    tmp = root / f".tmp_step_{tr.step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.float().contiguous().cpu() for k, v in tr.trainable_state().items()}, str(tmp / "trainable.safetensors"))
    save_optimizer(tr.opt, tmp / "optimizer.pt")
    state = {"step": tr.step, "tokens_seen": tr.tokens_seen, "loss_tokens_seen": tr.loss_tokens_seen,
             "wall_s": tr.wall_s, "mlflow_run_id": tr.run_id, "history": tr.history,
             "config": resume_key(tr.cfg)}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    for old in sorted(root.glob("step_*"))[: -tr.cfg.log.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final

def load_trainer_state(tr) -> bool:
    """Restore ``tr`` from ``out_dir/checkpoints/latest`` if it exists; return whether it did. A checkpoint
    written with other settings (``resume_key``) is refused."""
    root = Path(tr.cfg.out_dir) / "checkpoints"
    if not (root / "latest").is_file():
        return False
    path = root / (root / "latest").read_text().strip()
    state = json.loads((path / "state.json").read_text())
    mine = resume_key(tr.cfg)
    diff = sorted(k for k in set(mine) | set(state["config"]) if mine.get(k) != state["config"].get(k))
    if diff:
        raise ConfigError(f"{path} was trained with different settings ({', '.join(diff)}); "
                          "use another out_dir or start fresh (--fresh)")
    tensors = load_file(str(path / "trainable.safetensors"))
    with torch.no_grad():
        if tr.module is not None:
            tr.module.load_state_dict({k[9:]: v for k, v in tensors.items() if k.startswith("steering.")})
        for k, p in tr.drafter_params.items():
            p.copy_(tensors[f"drafter.{k}"].to(p.dtype))
    load_optimizer(tr.opt, path / "optimizer.pt")
    tr.step, tr.tokens_seen = state["step"], state["tokens_seen"]
    tr.loss_tokens_seen, tr.wall_s = state.get("loss_tokens_seen", 0), state["wall_s"]
    tr.run_id, tr.history = state.get("mlflow_run_id"), state.get("history", [])
    return True
