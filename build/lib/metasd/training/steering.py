"""Training recipe for the SD² steering module (and the "distilled drafter" baseline): ``metasd train steering CONFIG``.

Data: a verifier feature directory (``metasd.training.features``): token ids, response mask, the
verifier's hidden states at the guide layers and its top-k next-token log-probabilities.

Per optimizer step: ``batch_size`` sequences (one forward each, gradients accumulated) and one
staleness o ~ U{1..k}. Drafter position t (input token x_t, predicting x_{t+1}) is steered with the
guide computed from verifier row t - o (the verifier state that produced x_{t-o+1}), so a prediction
never sees a verifier state computed from its own input token or a later one, the same as at
inference, where the draft made at position T-1+i uses the guide of row T-2 (o = i + 1, i = 0..k-1).
Positions before the last prompt token, and positions t < o, are unsteered (the drafter's prompt
prefill is unsteered at inference).

Loss over response tokens (positions t with loss_mask[t+1]): forward KL(p || q) with p the verifier's
top-k distribution renormalised over its k tokens and q the drafter's full softmax, or total variation
0.5 * (sum_topk |p - q| + q(outside top-k)), or (``top1``) -log q(argmax p), the cross-entropy on the
token greedy verification accepts. Trained: W_hml, the LayerNorm, the bias projection and,
optionally, drafter layers (``finetune``). With ``steering.enabled: false`` and ``finetune`` set, the
same recipe trains the distillation baseline.

Checkpoints (``out_dir/checkpoints/step_<n>/``: trainable tensors in fp32 safetensors, AdamW state,
step, tokens and the MLflow run id; ``out_dir/checkpoints/latest`` names the newest) are written every
``checkpoint_every`` steps and when the run stops; rerunning the same command resumes from the latest
one and produces the same parameters as an uninterrupted run (data order and staleness are functions of
the seed and the step). The result is exported to ``out_dir/steering.safetensors`` + ``config.json``,
loadable in a pool config as ``type: steered, model: <drafter>, checkpoint: out_dir/steering.safetensors``.
At every validation that improves the held-out KL (or top-1 agreement, ``log.best_by``), the same export
also goes to ``out_dir/best/`` (``log.keep_best``), so a run that starts to overfit keeps its best module.

Relative paths in the config are resolved against the current working directory. The config's schema is
``metasd.training.steering_config``.
"""
from __future__ import annotations

import json
import math
import shutil
from contextlib import nullcontext
from pathlib import Path

import torch

from metasd.config import ConfigError

from metasd.drafters.steering_net import (Injector, SteeringModule, decoder_layers, default_guide_layers,
                                          resolve_steered_layers, save_steering)
from metasd.models.machine import warn_if_oversubscribed
from .common import Tracker, require_tracking
from .devices import autocast_note, bf16_autocast, compute_dtype, to_device, training_device
from .loop import KeepBest, StepLoop
from .steering_config import (DataConfig, LogConfig, SteeringConfig, SteeringTrainingConfig,  # noqa: F401
                                             TrainConfig, parse_config, read_config)
from .steering_data import SteeringSequences, guide_input_stats
from .steering_state import load_trainer_state, save_trainer_state


# ---------------------------------------------------------------------------------------------- trainer
def _resolve_layers(spec: str | int | list[int], n: int, field: str) -> list[int]:
    if spec == "none":
        return []
    try:
        return resolve_steered_layers(spec, n)
    except ValueError as e:
        raise ConfigError(f"{field}: {e}") from None


class SteeringTrainer:
    """Holds the drafter, the steering module, the optimizer and the data of one training run."""

    def __init__(self, cfg: SteeringTrainingConfig, model=None, log=print):
        from .features import FeatureSet

        self.cfg, self.log = cfg, log
        t = cfg.train
        self.device = training_device(t.device)  # the drafter, the module, the optimizer state and every batch
        if t.threads:
            torch.set_num_threads(t.threads)
        warn_if_oversubscribed()  # a trainer sharing the cores with another metasd process runs many times slower
        try:
            fs = FeatureSet(cfg.data.features)
        except FileNotFoundError as e:
            raise ConfigError(f"data.features: {e}") from None
        self.manifest = fs.manifest
        n_shards = len(fs.shards)
        for field, idx in (("data.val_shards", cfg.data.val_shards), ("data.train_shards", cfg.data.train_shards or [])):
            bad = [i for i in idx if not 0 <= i < n_shards]
            if bad:
                raise ConfigError(f"{field}: shards {bad} do not exist ({cfg.data.features} has {n_shards} shards)")
        train_idx = cfg.data.train_shards if cfg.data.train_shards is not None else \
            [i for i in range(n_shards) if i not in set(cfg.data.val_shards)]
        if not train_idx:
            raise ConfigError("data.train_shards: no training shard left")

        if t.min_staleness > t.k:
            raise ConfigError(f"train.min_staleness: {t.min_staleness} is above train.k ({t.k})")
        # steering shape
        s = cfg.steering
        self.guide_layers: list[int] = []
        if s.enabled:
            if s.guide_layers is not None:
                self.guide_layers = list(s.guide_layers)
            else:
                n_v = s.verifier_layers or self.manifest.get("num_layers")
                if n_v is None:
                    raise ConfigError("steering.guide_layers: not given, and neither steering.verifier_layers nor the "
                                      "feature manifest gives the verifier's depth (SD² uses [3, N//2+1, N-2])")
                self.guide_layers = default_guide_layers(int(n_v))
            missing = [layer for layer in self.guide_layers if layer not in fs.layers]
            if missing:
                raise ConfigError(f"steering.guide_layers: layers {missing} are not in the feature set "
                                  f"(it has {fs.layers})")
        elif cfg.finetune == "none":
            raise ConfigError("finetune: steering.enabled is false and finetune is 'none': nothing to train")
        self.train_set = SteeringSequences(fs.path, [fs.shards[i] for i in train_idx], self.guide_layers)
        self.val_set = SteeringSequences(fs.path, [fs.shards[i] for i in cfg.data.val_shards], self.guide_layers)
        self.n_val = min(cfg.data.val_sequences, len(self.val_set))

        # drafter
        finetuning = cfg.finetune != "none"
        self.compute_dtype = compute_dtype(t.dtype, self.device)
        if model is None:
            from metasd.models import load_model

            weight_dtype = torch.float32 if (finetuning or self.compute_dtype == torch.float32) else torch.bfloat16
            model, _ = load_model(cfg.drafter, dtype=weight_dtype, device=self.device)
        self.model = model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        layers = decoder_layers(model)
        self.finetune_layers = _resolve_layers(cfg.finetune, len(layers), "finetune")
        self.drafter_params: dict[str, torch.nn.Parameter] = {}
        prefix = {id(p): n for n, p in model.named_parameters()}
        for i in self.finetune_layers:
            for p in layers[i].parameters():
                if p.dtype != torch.float32:
                    raise ConfigError(f"finetune: drafter weights are {p.dtype}; fine-tuning needs fp32 master weights "
                                      "(load the drafter in fp32)")
                p.requires_grad_(True)
                self.drafter_params[prefix[id(p)]] = p
        d_v = None
        if s.enabled:
            first = self.train_set[0]
            d_v = int(first[f"hidden_{self.guide_layers[0]}"].shape[-1])
            try:
                self.module = SteeringModule.for_models(model, d_v, guide_layers=self.guide_layers, layers=s.layers,
                                                        rank=s.rank, injection=s.injection,
                                                        guide_norm=s.guide_norm, seed=t.seed)
            except ValueError as e:
                raise ConfigError(f"steering.layers: {e}") from None
            self.module.to(self.device)
            self.module.dropout = s.dropout
            self.injector = Injector(model, self.module.spec)
        else:
            self.module, self.injector = None, None
        groups = []
        if self.module is not None:
            if not s.train_guide:
                self.module.guide.requires_grad_(False)
            trained = [p for p in self.module.parameters() if p.requires_grad]
            groups.append({"params": trained, "lr": t.lr, "base_lr": t.lr})
        if self.drafter_params:
            groups.append({"params": list(self.drafter_params.values()), "lr": t.drafter_lr, "base_lr": t.drafter_lr})
        self.opt = torch.optim.AdamW(groups, weight_decay=t.weight_decay)
        self.step = 0
        self.tokens_seen = 0
        self.loss_tokens_seen = 0
        self.wall_s = 0.0
        self.run_id: str | None = None
        self.history: list[dict] = []
        self._plain_val: dict | None = None
        self._order_cache: tuple[int, list[int]] | None = None
        self.lm_head = model.get_output_embeddings()
        self.base = model.base_model

    def fit_guide_stats(self) -> None:
        """Fix the guide-input standardisation from the training shards (``guide_norm: standardize``; one
        pass over the data). A fresh run needs it before its first step; a resumed run loads the statistics
        from its checkpoint instead."""
        if self.module is not None and self.module.spec.guide_norm == "standardize":
            self.module.set_input_stats(*guide_input_stats(self.train_set, self.guide_layers))

    def close(self) -> None:
        """Remove the steering hooks from the drafter model (the module stays usable)."""
        if self.injector is not None:
            self.injector.remove()
            self.injector = None

    # ------------------------------------------------------------------ core computation
    def sequence_loss(self, seq: dict[str, torch.Tensor], offset: int | None) -> dict[str, torch.Tensor] | None:
        """Loss (sum over response tokens), token count and agreements of one sequence.

        offset: guide staleness o (None = unsteered).
        """
        ids, mask = seq["ids"], seq["loss_mask"]
        N = len(ids)
        rows = mask[1:].nonzero().squeeze(-1)  # positions predicting a response token
        if not len(rows):
            return None
        delta = None
        if offset is not None and self.module is not None:
            first_resp = int(mask.nonzero()[0])
            start = max(first_resp - 1, offset)  # unsteered prompt prefill; no guide row before 0
            if start < N:
                h = torch.cat([seq[f"hidden_{layer}"][: N - offset] for layer in self.guide_layers], dim=-1)
                src = h[start - offset:]  # rows t - o for t = start..N-1
                d = self.module(src)  # [N - start, n, d_out] fp32
                delta = torch.cat([d.new_zeros(start, *d.shape[1:]), d])[None]
        autocast = bf16_autocast(self.device) if self.compute_dtype == torch.bfloat16 else nullcontext()
        if delta is not None and self.injector is None:
            self.injector = Injector(self.model, self.module.spec)
        steer = self.injector.active(delta) if delta is not None else nullcontext()
        with steer, autocast:
            hidden = self.base(input_ids=ids[None]).last_hidden_state[0]
            logits = self.lm_head(hidden[rows])
        logq = logits.float().log_softmax(-1)
        top_ids, top_lp = seq["topk_ids"][rows], seq["topk_logp"][rows].float()
        logp = top_lp - top_lp.logsumexp(-1, keepdim=True)
        p = logp.exp()
        logq_top = logq.gather(-1, top_ids)
        kl = (p * (logp - logq_top)).sum(-1)
        q_top = logq_top.exp()
        tvd = 0.5 * ((p - q_top).abs().sum(-1) + (1 - q_top.sum(-1)).clamp_min(0))
        top1 = -logq_top[:, 0]  # -log q(argmax p)
        loss = {"kl": kl, "tvd": tvd, "top1": top1}[self.cfg.train.loss]
        return {"loss": loss.sum(), "kl": kl.detach().sum(),
                "tvd": tvd.detach().sum(), "n": torch.tensor(len(rows)),
                "agree": (logits.argmax(-1) == top_ids[:, 0]).sum(), "tokens": torch.tensor(N)}

    def offset_for(self, step: int) -> int:
        g = torch.Generator().manual_seed(self.cfg.train.seed * 7_919 + step)
        return int(torch.randint(self.cfg.train.min_staleness, self.cfg.train.k + 1, (1,), generator=g))

    def batch_indices(self, step: int) -> list[int]:
        n, b = len(self.train_set), self.cfg.train.batch_size
        out = []
        for j in range(step * b, (step + 1) * b):
            epoch, i = divmod(j, n)
            if self._order_cache is None or self._order_cache[0] != epoch:
                self._order_cache = (epoch, self.train_set.epoch_order(self.cfg.train.seed, epoch))
            out.append(self._order_cache[1][i])
        return out

    def lr_factor(self, step: int) -> float:
        t = self.cfg.train
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "cosine":
            span = max(t.steps - t.warmup_steps, 1)
            x = min(max(step - t.warmup_steps, 0) / span, 1.0)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x))
        return 1.0

    def train_step(self) -> dict[str, float]:
        o = self.offset_for(self.step) if self.module is not None else None
        seqs = [self.train_set[i] for i in self.batch_indices(self.step)]
        total = sum(int(s["loss_mask"][1:].sum()) for s in seqs)
        seqs = to_device(seqs, self.device)
        if self.module is not None:
            self.module.train()
        self.opt.zero_grad(set_to_none=True)
        stats = {"loss": 0.0, "kl": 0.0, "tvd": 0.0, "agree": 0.0, "n": 0, "tokens": 0}
        for s in seqs:
            out = self.sequence_loss(s, o)
            if out is None:
                continue
            (out["loss"] / max(total, 1)).backward()
            for key in ("loss", "kl", "tvd", "agree"):
                stats[key] += float(out[key].detach())
            stats["n"] += int(out["n"])
            stats["tokens"] += int(out["tokens"])
        params = [p for g in self.opt.param_groups for p in g["params"]]
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip or float("inf")))
        f = self.lr_factor(self.step)
        for g in self.opt.param_groups:
            g["lr"] = g["base_lr"] * f
        self.opt.step()
        self.step += 1
        self.tokens_seen += stats["tokens"]
        self.loss_tokens_seen += stats["n"]
        n = max(stats["n"], 1)
        return {"loss": stats["loss"] / n, "kl": stats["kl"] / n, "tvd": stats["tvd"] / n, "agree": stats["agree"] / n,
                "offset": float(o or 0), "grad_norm": gnorm, "lr_factor": f}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Top-1 agreement with the verifier's argmax (and KL) on held-out sequences, steered and plain.

        Validation sequence i uses staleness o = min_staleness + i % (k + 1 - min_staleness) (all offsets
        equally represented).
        """
        if self.module is not None:
            self.module.eval()
        out: dict[str, float] = {}
        modes = ["steered", "plain"] if self.module is not None else ["plain"]
        for mode in modes:
            if mode == "plain" and not self.drafter_params and self._plain_val is not None:
                out.update(self._plain_val)  # a frozen drafter: the unsteered figures never change
                continue
            agree = kl = n = 0.0
            for i in range(self.n_val):
                lo = self.cfg.train.min_staleness
                r = self.sequence_loss(to_device(self.val_set[i], self.device),
                                       lo + i % (self.cfg.train.k + 1 - lo) if mode == "steered" else None)
                if r is not None:
                    agree += float(r["agree"])
                    kl += float(r["kl"])
                    n += int(r["n"])
            res = {f"val_agree_{mode}": agree / max(n, 1), f"val_kl_{mode}": kl / max(n, 1)}
            if mode == "plain" and not self.drafter_params:
                self._plain_val = res
            out.update(res)
        return out

    # ------------------------------------------------------------------ checkpoints
    def trainable_state(self) -> dict[str, torch.Tensor]:
        state = {}
        if self.module is not None:
            state.update({f"steering.{k}": v.detach().clone() for k, v in self.module.state_dict().items()})
        state.update({f"drafter.{k}": p.detach().clone() for k, p in self.drafter_params.items()})
        return state

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of this run (``metasd.training.steering_state``)."""
        return save_trainer_state(self)

    def load_checkpoint(self) -> bool:
        """Resume from ``out_dir/checkpoints/latest`` if it exists; return whether it did."""
        return load_trainer_state(self)

    def export(self, extra: dict | None = None, folder: Path | None = None) -> Path:
        """Write the loadable result: out_dir (or ``folder``)/steering.safetensors + config.json."""
        dtype = torch.bfloat16 if self.cfg.save_dtype == "bf16" else torch.float32
        last_val = next((h for h in reversed(self.history) if "val_agree_plain" in h), None)
        info = {"drafter_model": self.cfg.drafter, "verifier_model": self.manifest.get("model"),
                "features": str(self.cfg.data.features),
                "training": {"step": self.step, "tokens_seen": self.tokens_seen,
                             "loss_tokens_seen": self.loss_tokens_seen, "wall_s": round(self.wall_s, 1),
                             "finetune_layers": self.finetune_layers, "last_validation": last_val,
                             "config": self.cfg.model_dump()}, **(extra or {})}
        return save_steering(Path(folder or self.cfg.out_dir) / "steering.safetensors", self.module,
                             {k: p for k, p in self.drafter_params.items()}, info, dtype)


# ---------------------------------------------------------------------------------------------- driver
def train_steering(cfg: SteeringTrainingConfig, model=None, fresh: bool = False, stop_at_step: int | None = None,
                   log=print) -> SteeringTrainer:
    """Train (resuming from the latest checkpoint unless ``fresh``); export and return the trainer.

    model: an already loaded drafter model (tests; moved onto ``train.device``); default: load ``cfg.drafter`` there.
    stop_at_step: stop like an interruption after this step (checkpoint, no export); for tests.
    """
    require_tracking(cfg.log.mlflow)  # a missing extra fails before anything loads
    tr = SteeringTrainer(cfg, model=model, log=log)
    out = Path(cfg.out_dir)
    try:
        if fresh:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
        resumed = tr.load_checkpoint()
        if not resumed:
            tr.fit_guide_stats()
        tracker = Tracker(cfg.log.mlflow, cfg.log.experiment, cfg.log.run_name, tr.run_id, cfg.model_dump(),
                          uri=cfg.log.tracking_uri)
    except BaseException:
        tr.close()
        raise
    log(f"training {autocast_note(tr.device, tr.compute_dtype == torch.bfloat16)}")
    if resumed:
        log(f"resumed from step {tr.step} ({tr.tokens_seen} tokens, {tr.wall_s:.0f}s so far)")
    if tr.step >= cfg.train.steps:
        log(f"already trained for {tr.step} >= {cfg.train.steps} steps")
    tr.run_id = tracker.run_id
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train_log.jsonl", "a")
    status = "FINISHED"
    wall0 = tr.wall_s
    limit = cfg.train.wall_limit_s

    def record(values: dict[str, float]) -> None:
        entry = {"step": tr.step, "tokens_seen": tr.tokens_seen, "wall_s": round(tr.wall_s, 1), **values}
        if any(k.startswith("val_") for k in values):
            tr.history.append(entry)
        logf.write(json.dumps(entry) + "\n")
        logf.flush()
        tracker.metrics({k.replace("/", "_"): v for k, v in {**values, "tokens_seen": tr.tokens_seen, "wall_s": tr.wall_s}.items()},
                        tr.step)

    def validate(step: int) -> dict[str, float] | None:
        if not tr.n_val or (tr.history and tr.history[-1]["step"] == tr.step):
            return None
        v = tr.validate()
        record(v)
        log(f"step {tr.step}: " + ", ".join(f"{k} {x:.4f}" for k, x in v.items()))
        return v

    key = f"val_{cfg.log.best_by}_{'steered' if tr.module is not None else 'plain'}"
    lowest = cfg.log.best_by == "kl"

    def on_best(step: int, v: dict[str, float]) -> None:
        path = tr.export({"selected_by": f"{'lowest' if lowest else 'highest'} {key} over validations so far"},
                         Path(cfg.out_dir) / "best")
        log(f"best so far ({key} {v[key]:.4f}): exported {path}")

    earlier = [h[key] for h in tr.history if key in h]
    keep_best = (KeepBest(key, "min" if lowest else "max", on_best, (min if lowest else max)(earlier, default=None))
                 if cfg.log.keep_best else None)

    def report(step: int, metrics: dict[str, float]) -> None:
        avg = {f"train_{k}": v for k, v in metrics.items()}
        record(avg)
        log(f"step {tr.step}/{cfg.train.steps} loss {avg['train_loss']:.4f} agree {avg['train_agree']:.3f} "
            f"tokens {tr.tokens_seen} {tr.wall_s:.0f}s")

    def train_step(step: int) -> dict[str, float]:
        metrics = tr.train_step()  # advances tr.step to step + 1
        tr.wall_s = wall0 + loop.wall()
        return metrics

    # a wall limit per invocation (elapsed 0); stop_at_step ends like an interruption: checkpoint, no export
    loop = StepLoop(cfg.train.steps, cfg.log.log_every, cfg.log.val_every, cfg.log.checkpoint_every, tracker, log,
                    train_step=train_step, save=lambda step: tr.save_checkpoint(), validate=validate, keep_best=keep_best,
                    until_step=stop_at_step, max_minutes=limit / 60 if limit is not None else None, log_first=False,
                    report=report)
    try:
        if not resumed:
            loop.validation(tr.step)
        why, _ = loop.run(tr.step)
        if why == "interrupted":
            tr.save_checkpoint()
            status = "KILLED"
            return tr
        if why == "time":  # the loop said so; the run stays resumable
            log(f"wall limit of {limit:.0f}s: rerun the same command to resume from step {tr.step}")
            status = "KILLED"
        loop.validation(tr.step)
        tr.wall_s = wall0 + loop.wall()
        tr.save_checkpoint()
        path = tr.export()
        log(f"exported {path} (step {tr.step}, {tr.tokens_seen} tokens, {tr.wall_s:.0f}s)")
        return tr
    except BaseException:
        status = "FAILED"
        raise
    finally:
        logf.close()
        tracker.end(status)
        tr.close()
