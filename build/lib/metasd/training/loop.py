"""The scaffold the trainers fill in. ``StepLoop`` - stop at ``until_step`` or at the wall budget, report
train metrics to the log and MLflow, validate (with ``KeepBest``: call back on each improvement) and save
periodically - runs every trainer (steering, block, TreeFlash, hidden-state); each supplies its own step,
validation, saving and what keeping the best means to it. ``FeatureRun`` - threads,
feature set and split, the verifier's embedding/head pieces, resumable state, the draft vocabulary - sets
up the trainers of networks on the verifier's states (TreeFlash, hidden-state)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from metasd.models.draft_vocab import DraftVocab
from metasd.models.machine import warn_if_oversubscribed
from .common import (STATE_META, FeatureTrainingConfig, ShardReader, Tracker, count_tokens, eos_ids, load_verifier_parts,
                     require_tracking, split_shards)
from .devices import training_device
from .features import FeatureSet


@dataclass
class FeatureRun:
    """What a feature-set trainer starts from: the feature set and its split, the verifier (its pieces),
    the output folders, the resumable state (None: a fresh run) and the device training computes on."""

    fs: FeatureSet
    train: list[int]
    val: list[int]
    verifier_model: Any
    n_layers: int
    width: int
    full_vocab: int
    out: Path
    state_dir: Path
    state: dict | None
    device: torch.device = torch.device("cpu")

    @classmethod
    def start(cls, cfg: FeatureTrainingConfig, verifier_model, log) -> "FeatureRun":
        """Threads, the device, the oversubscription warning, the shard split, the verifier's embeddings, final norm
        and LM head (loaded unless given, on the CPU) and the state of an earlier invocation (when ``cfg.resume``)."""
        require_tracking(cfg.mlflow)  # a missing extra fails before anything loads
        device = training_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        warn_if_oversubscribed()  # a trainer sharing the cores with another metasd process runs many times slower
        fs = FeatureSet(cfg.features)
        train, val = split_shards(cfg, fs)
        if verifier_model is None:
            log(f"loading the verifier's embeddings, final norm and LM head from {cfg.verifier}")
            verifier_model = load_verifier_parts(cfg.verifier)
        vcfg = verifier_model.config.get_text_config() if hasattr(verifier_model.config, "get_text_config") else verifier_model.config
        out = Path(cfg.out)
        state_dir = Path(cfg.state_dir) if cfg.state_dir else out / "train_state"
        state_dir.mkdir(parents=True, exist_ok=True)
        meta_path = state_dir / STATE_META
        state = json.loads(meta_path.read_text()) if cfg.resume and meta_path.exists() else None
        return cls(fs, train, val, verifier_model, int(vcfg.num_hidden_layers), int(vcfg.hidden_size),
                   int(verifier_model.get_input_embeddings().weight.shape[0]), out, state_dir, state, device)

    def draft_vocab(self, cfg: FeatureTrainingConfig, reader: ShardReader) -> DraftVocab:
        """The resumed run's vocabulary, else ``cfg.draft_vocab``, else the ``cfg.vocab_size`` most frequent
        training tokens (ties: lower ids first) plus EOS; 0 or the full size: every token. Saved in the state."""
        path = self.state_dir / "draft_vocab.safetensors"
        if self.state is not None and path.exists():
            vocab = DraftVocab.load(path)
        elif cfg.draft_vocab:
            vocab = DraftVocab.load(cfg.draft_vocab)
        elif cfg.vocab_size == 0 or cfg.vocab_size >= self.full_vocab:
            vocab = DraftVocab.full(self.full_vocab)
        else:
            prior = 0.5 * (1.0 - torch.arange(self.full_vocab, dtype=torch.float64) / self.full_vocab)
            vocab = DraftVocab.from_counts(count_tokens(reader, self.train, self.full_vocab) + prior, cfg.vocab_size,
                                           eos_ids(self.verifier_model))
        vocab.save(path)
        return vocab


@dataclass
class KeepBest:
    """Keep-best: ``on_best(step, metrics)`` after each validation whose ``key`` is strictly lower (``mode="min"``)
    or higher (``"max"``) than every earlier one; ``best`` is the best value so far (None: none yet), which a
    resumed run restores from its own state."""

    key: str
    mode: Literal["min", "max"]
    on_best: Callable[[int, dict[str, float]], None]
    best: float | None = None

    def offer(self, step: int, metrics: dict[str, float]) -> None:
        """Call ``on_best`` if ``metrics`` improve on the best so far."""
        value = metrics[self.key]
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best = value
            self.on_best(step, metrics)


@dataclass
class StepLoop:
    """Steps ``start .. steps - 1`` of one schedule (a stage) of a trainer that supplies ``train_step(step) ->
    metrics`` (it sets its own learning rate), ``save(step)`` and optionally ``validate(step) -> metrics`` and
    ``keep_best``. ``run`` reports every ``log_every`` steps, after the last and (``log_first``) after the first -
    each metric's mean over the steps since the last report (``lr``: its latest value), by default as
    ``train/<metric>`` to MLflow and a log line, else through ``report(step, metrics)`` - validates every
    ``eval_every`` steps (not after the last: the caller does, through ``validation``) and saves every
    ``save_every``.

    Steps are numbered from 0 within the loop; ``offset`` turns them into the run's global step (MLflow,
    ``until_step``). ``elapsed`` is the wall time spent in earlier invocations; the budget counts it."""

    steps: int
    log_every: int
    eval_every: int
    save_every: int
    tracker: Tracker
    log: Callable[[str], None]
    train_step: Callable[[int], dict[str, float]]
    save: Callable[[int], None]
    validate: Callable[[int], dict[str, float] | None] | None = None
    keep_best: KeepBest | None = None
    until_step: int | None = None
    max_minutes: float | None = None
    elapsed: float = 0.0
    offset: int = 0
    label: str = ""  # prefix of the log lines, e.g. "stage 1 "
    log_first: bool = True
    report: Callable[[int, dict[str, float]], None] | None = None

    def __post_init__(self) -> None:
        self._t0 = time.time()

    def wall(self) -> float:
        """Wall seconds of this schedule so far, earlier invocations included."""
        return self.elapsed + time.time() - self._t0

    def validation(self, step: int) -> dict[str, float] | None:
        """``validate(step)``, then ``keep_best``; returns its metrics (None or {}: nothing validated)."""
        metrics = self.validate(step)
        if metrics and self.keep_best is not None:
            self.keep_best.offer(step, metrics)
        return metrics

    def run(self, start: int) -> tuple[str, int]:
        """Train from step ``start``; returns (why it stopped: "finished" | "interrupted" | "time", the next step)."""
        step, window = start, []
        while step < self.steps:
            if self.until_step is not None and self.offset + step >= self.until_step:
                return "interrupted", step
            if self.max_minutes and self.wall() > self.max_minutes * 60:
                self.log(f"{self.label}time budget of {self.max_minutes} min reached at step {step}/{self.steps}")
                return "time", step
            t0 = time.time()
            window.append(self.train_step(step))
            step += 1
            if step % self.log_every == 0 or step == self.steps or (step == 1 and self.log_first):
                metrics = {k: v if k == "lr" else sum(m[k] for m in window) / len(window) for k, v in window[-1].items()}
                window = []
                if self.report is not None:
                    self.report(step, metrics)
                else:
                    self.tracker.metrics({**{f"train/{k}": v for k, v in metrics.items()}, "train/step_s": time.time() - t0},
                                         self.offset + step)
                    self.log(f"{self.label}step {step}/{self.steps} " + " ".join(_fmt(k, v) for k, v in metrics.items())
                             + f" {time.time() - t0:.2f}s")
            if self.validate is not None and self.eval_every and step % self.eval_every == 0 and step < self.steps:
                self.validation(step)
            if step % self.save_every == 0:
                self.save(step)
        return "finished", step


def _fmt(key: str, value: float) -> str:
    return f"{key} {value:.2e}" if key == "lr" else f"{key} {value:.4f}"
