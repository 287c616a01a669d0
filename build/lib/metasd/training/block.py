"""Training the block drafter's heads (``metasd train block CONFIG``; docs/algorithms.md#block-drafters-and-lattice-rescoring).

Data: a verifier feature directory (``metasd.training.features``). Input = the verifier hidden state
``hidden_<L>`` (L = num_layers, after the final norm) at position t, which produced token t+1; head i's
target is the token at t+2+i (``target: data``), or the verifier's own greedy prediction of that token
under teacher forcing, ``topk_ids[t+1+i, 0]`` (``target: verifier``, self-distillation). A target counts
only when token t+2+i is a response token (``loss_mask``). Positions with no valid target are dropped.

Reduced vocabulary: the heads score a ``DraftVocab`` of ``vocab_size`` tokens, the most frequent in the
training shards (EOS tokens always in; tokens never seen fill the rest in id order, which for BPE
vocabularies roughly follows merge frequency). Targets outside it are *ignored* by the loss (the heads
cannot propose them); validation counts them as misses, so its figures are what drafting would see.

Validation on held-out shards (``val_shards``): per-head top-1 accuracy against the sequence's tokens,
and the expected tokens per step of the argmax chain, ``tau = 1 + E[number of leading heads correct]``
over positions where all k targets exist (bonus included; plain decoding = 1.00).

Files: ``out`` gets the drafter checkpoint (heads.safetensors in ``save_dtype``, config.json,
draft_vocab.safetensors, metrics.json, MODEL_CARD.md); ``state_dir`` (default ``<out>/train_state``)
gets the resumable state (fp32 heads as safetensors, optimizer state, step and counters). A run
resumes from ``state_dir`` when it exists (unless ``resume: false``); the data order depends on the step
only, so an interrupted and resumed run follows the same trajectory. Relative paths in the config are
relative to the current directory. MLflow: URI from MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in
the current directory; a resumed run continues the same MLflow run.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import load_file

from metasd.config import read_yaml_mapping, validate_config
from metasd.models.draft_vocab import DraftVocab
from metasd.models.machine import warn_if_oversubscribed
from .common import (STATE_META, FeatureTrainingConfig, Tracker, lr_at, require_tracking, save_state, split_shards,
                     state_file, write_atomic)
from .devices import DEVICE_HELP, autocast_note, bf16_autocast, load_optimizer, to_device, training_device
from .loop import StepLoop
from .features import FeatureSet

LEGACY_WEIGHTS, LEGACY_OPTIM = "heads_fp32.safetensors", "optimizer.pt"  # fixed names of states before step-named files
VOCAB_FILE = "draft_vocab.safetensors"


class TrainBlockConfig(FeatureTrainingConfig):
    """YAML config of ``metasd train block``."""

    k: int = Field(4, ge=1, description="heads; head i predicts token pending+1+i")
    hidden_layer: int | None = Field(None, description="feature layer read (default: the verifier's num_layers)")
    vocab_size: int = Field(16384, ge=0, description="reduced draft vocabulary size; 0 = full vocabulary")
    target: Literal["data", "verifier"] = "data"
    steps: int = Field(1000, ge=1, description="total optimizer steps (sets the LR schedule)")
    batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor, as a fraction of lr")
    warmup: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    head_decay: float = Field(1.0, gt=0, description="loss weight of head i is head_decay**i")
    init: Literal["zero", "normal"] = "zero"
    bf16: bool = Field(True, description="bf16 autocast for the matmuls (weights and optimizer stay fp32)")
    max_minutes: float | None = Field(None, gt=0, description="stop (and save) after this much training wall time per invocation")
    log_every: int = Field(20, ge=1)
    eval_every: int = Field(200, ge=1)
    save_every: int = Field(200, ge=1)
    val_max_positions: int = Field(4096, ge=1, description="validation positions (the first ones of the held-out shards)")
    mlflow_experiment: str = "metasd-block"


def load_train_block_config(path: str | Path, device: str | None = None) -> TrainBlockConfig:
    """Read and validate a training file (``device``: overrides its device); ``ConfigError`` (a ``ValueError``) names
    the file and the field."""
    raw = read_yaml_mapping(path, "training config")
    return validate_config(TrainBlockConfig, {**raw, **({"device": device} if device else {})}, str(path),
                           "block training config")


# ------------------------------------------------------------------------------------------- data
def block_targets(ids: torch.Tensor, loss_mask: torch.Tensor, k: int, next_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k] full-vocabulary targets of the heads at every position of one sequence, -1 where none.

    Position t's hidden state produced token t+1 (the pending token at drafting time); head i predicts
    token t+2+i: ``ids[t+2+i]``, or ``next_ids[t+1+i]`` (the verifier's prediction of that token) when
    given. Valid only where token t+2+i exists and is a response token.
    """
    T = len(ids)
    out = torch.full((T, k), -1, dtype=torch.long)
    for i in range(k):
        n = T - 2 - i
        if n <= 0:
            continue
        src = ids[2 + i:] if next_ids is None else next_ids[1 + i:1 + i + n]
        out[:n, i] = torch.where(loss_mask[2 + i:], src, torch.full_like(src, -1))
    return out


def load_block_data(fs: FeatureSet, shards: list[int], layer: int, k: int, target: str = "data",
                    max_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [P, d] as stored, targets [P, k] full ids / -1) over the positions with any valid target."""
    H, Y = [], []
    total = 0
    for s in shards:
        with safe_open(str(fs.shards[s]), "pt") as f:
            ids, mask, off = f.get_tensor("ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets").tolist()
            hidden = f.get_tensor(f"hidden_{layer}")
            nxt = f.get_slice("topk_ids")[:, 0:1].reshape(-1) if target == "verifier" else None
        for a, b in zip(off[:-1], off[1:]):
            y = block_targets(ids[a:b], mask[a:b], k, None if nxt is None else nxt[a:b])
            rows = (y >= 0).any(1)
            H.append(hidden[a:b][rows])
            Y.append(y[rows])
            total += int(rows.sum())
            if max_positions is not None and total >= max_positions:
                return torch.cat(H)[:max_positions], torch.cat(Y)[:max_positions]
    d = fs.manifest.get("hidden_size") or (H[0].shape[1] if H else 0)
    return (torch.cat(H) if H else torch.empty(0, d)), (torch.cat(Y) if Y else torch.empty(0, k, dtype=torch.long))


def token_counts(fs: FeatureSet, shards: list[int], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in shards:
        with safe_open(str(fs.shards[s]), "pt") as f:
            counts += torch.bincount(f.get_tensor("ids"), minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab(counts: torch.Tensor, size: int, always: tuple[int, ...]) -> DraftVocab:
    """Most frequent ``size`` tokens; unseen tokens fill the rest in id order; ``always`` first."""
    if size == 0 or size >= len(counts):
        return DraftVocab.full(len(counts))
    prior = 0.5 * (1.0 - torch.arange(len(counts), dtype=torch.float64) / len(counts))  # < 1: breaks ties only
    return DraftVocab.from_counts(counts.double() + prior, size, always)


# ------------------------------------------------------------------------------------------- eval
@torch.no_grad()
def evaluate(heads, H: torch.Tensor, Y: torch.Tensor, bf16: bool = True, batch: int = 512) -> dict[str, float]:
    """Per-head top-1 accuracy (targets outside the draft vocab count as misses), in-vocab CE loss, and
    the argmax chain's expected tokens per step (bonus included) over positions with all k targets. ``H``, ``Y``
    on the heads' device."""
    k, vocab = heads.k, heads.vocab
    device = heads.weight.device
    correct = torch.zeros(k, device=device)
    counted = torch.zeros(k, device=device)
    loss_sum, loss_n = 0.0, 0
    acc_lens: list[torch.Tensor] = []
    for a in range(0, len(H), batch):
        h, y = H[a:a + batch], Y[a:a + batch]
        with bf16_autocast(device, bf16):
            logits = heads(h).float()  # [B, k, N]
        pred = vocab.to_full(logits.argmax(-1))
        valid = y >= 0
        ok = (pred == y) & valid
        correct += ok.sum(0)
        counted += valid.sum(0)
        yr = vocab.to_reduced(y.clamp(min=0))
        in_vocab = valid & (yr >= 0)
        if in_vocab.any():
            loss_sum += float(F.cross_entropy(logits[in_vocab], yr[in_vocab], reduction="sum"))
            loss_n += int(in_vocab.sum())
        full = valid.all(1)
        acc_lens.append(ok[full].long().cumprod(1).sum(1))
    out = {f"acc_head{i}": float(correct[i] / counted[i]) if counted[i] else 0.0 for i in range(k)}
    lens = torch.cat(acc_lens) if acc_lens else torch.empty(0, device=device)
    out["tau"] = 1.0 + float(lens.float().mean()) if len(lens) else 1.0
    out["loss"] = loss_sum / loss_n if loss_n else 0.0
    out["positions"] = float(len(H))
    return out


# ------------------------------------------------------------------------------------------- training
def _batch_indices(cfg: TrainBlockConfig, n: int, step: int) -> torch.Tensor:
    """Rows of the batch of ``step``: epochs are seeded permutations, so the order depends on the step only."""
    per_epoch = max(1, n // cfg.batch_size)
    epoch, j = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[j * cfg.batch_size:(j + 1) * cfg.batch_size]


def _save_state(state_dir: Path, heads, opt, meta: dict) -> None:
    """The resumable state: the draft vocabulary, then ``save_state``'s step-named weights and optimizer
    with trainer.json written last, so a kill at any moment leaves the previous state usable."""
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(state_dir / VOCAB_FILE, lambda p: heads.vocab.save(p))
    save_state(state_dir, heads, opt, meta)


def _state_path(state_dir: Path, meta: dict, kind: str) -> Path:
    """A committed state's weights or optimizer file (states written before step-named files: fixed names)."""
    if "files" not in meta:
        return state_dir / (LEGACY_WEIGHTS if kind == "weights" else LEGACY_OPTIM)
    return state_file(state_dir, meta, kind)


def train_block(cfg: TrainBlockConfig, until_step: int | None = None, log=print, command: str | None = None) -> dict[str, Any]:
    """Train (or resume) block heads; returns the final validation metrics and counters."""
    from metasd.drafters.block import BlockHeads
    from metasd.models import eos_token_ids, load_model

    require_tracking(cfg.mlflow)  # a missing extra fails before anything loads
    device = training_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    warn_if_oversubscribed()  # a trainer sharing the cores with another metasd process runs many times slower
    torch.manual_seed(cfg.seed)
    fs = FeatureSet(cfg.features)
    man = fs.manifest
    train, val = split_shards(cfg, fs)

    model, tokenizer = load_model(cfg.verifier, dtype="fp32" if not cfg.bf16 else "bf16", device="cpu")  # its head only
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers, d = int(text_cfg.num_hidden_layers), int(text_cfg.hidden_size)
    full_lm = model.get_output_embeddings().weight.detach()
    eos = tuple(sorted(eos_token_ids(model, tokenizer)))
    layer = cfg.hidden_layer if cfg.hidden_layer is not None else num_layers
    if layer not in fs.layers:
        raise ValueError(f"{cfg.features} holds layers {fs.layers}, not {layer}")

    out = Path(cfg.out)
    state_dir = Path(cfg.state_dir) if cfg.state_dir else out / "train_state"
    resuming = cfg.resume and (state_dir / STATE_META).is_file()
    meta: dict[str, Any] = {"step": 0, "positions_seen": 0, "targets_seen": 0, "elapsed_s": 0.0, "mlflow_run_id": None}
    if resuming:
        meta.update(json.loads((state_dir / STATE_META).read_text()))
        vocab = DraftVocab.load(state_dir / VOCAB_FILE)
        log(f"resuming from {state_dir} at step {meta['step']}")
    elif cfg.draft_vocab:
        vocab = DraftVocab.load(cfg.draft_vocab)
    else:
        vocab = build_vocab(token_counts(fs, train, full_lm.shape[0]), cfg.vocab_size, eos)
    if vocab.full_size != full_lm.shape[0]:
        raise ValueError(f"draft vocab is for vocabulary {vocab.full_size}, the verifier has {full_lm.shape[0]}")
    lm_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    heads = BlockHeads(d, cfg.k, vocab.head_weight(full_lm).to(lm_dtype), vocab, layer, init=cfg.init).to(device)
    del model, full_lm
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if resuming:
        w = load_file(str(_state_path(state_dir, meta, "weights")))
        with torch.no_grad():
            heads.weight.copy_(w["weight"])
            heads.bias.copy_(w["bias"])
        load_optimizer(opt, _state_path(state_dir, meta, "optimizer"))

    t0 = time.time()
    H, Y = load_block_data(fs, train, layer, cfg.k, cfg.target)
    Yr = vocab.to_reduced(Y.clamp(min=0))
    Yr[(Y < 0) | (Yr < 0)] = -100
    Hv, Yv = load_block_data(fs, val, layer, cfg.k, "data", cfg.val_max_positions)
    in_vocab = float(((Yr >= 0).sum()) / max(1, int((Y >= 0).sum())))
    log(f"data: {len(H)} train positions ({int((Y >= 0).sum())} targets, {in_vocab:.3f} inside the {len(vocab)}-token "
        f"draft vocab) from shards {train[0]}..{train[-1]}, {len(Hv)} validation positions from {val}; "
        f"loaded in {time.time() - t0:.0f}s")
    if not cfg.bf16:
        H, Hv = H.float(), Hv.float()
    Hv, Yv = to_device((Hv, Yv), device)  # the validation positions live on the device; training batches move per step
    log(f"training {autocast_note(device, cfg.bf16)}")

    tracker = Tracker(cfg.mlflow, cfg.mlflow_experiment, cfg.run_name, meta.get("mlflow_run_id"), cfg.model_dump(), log=log)
    meta["mlflow_run_id"] = tracker.run_id
    head_w = torch.tensor([cfg.head_decay ** i for i in range(cfg.k)])
    step = int(meta["step"])
    run_t0 = time.time()
    elapsed0 = float(meta["elapsed_s"])

    def save(at: int) -> None:
        meta.update(step=at, elapsed_s=elapsed0 + time.time() - run_t0)
        _save_state(state_dir, heads, opt, meta)
        heads.save(out, torch.bfloat16 if cfg.save_dtype == "bf16" else torch.float32,
                   extra={"verifier": cfg.verifier, "num_layers": num_layers, "step": at, "target": cfg.target,
                          "features": str(cfg.features)})

    def train_step(step: int) -> dict[str, float]:
        idx = _batch_indices(cfg, len(H), step)
        h, y = to_device((H[idx], Yr[idx]), device)
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        with bf16_autocast(device, cfg.bf16):
            logits = heads(h)  # [B, k, N]
        logits = logits.float()
        per_head = []
        for i in range(cfg.k):
            yi = y[:, i]
            per_head.append(F.cross_entropy(logits[:, i], yi, ignore_index=-100) if (yi >= 0).any()
                            else logits.new_zeros(()))
        loss = sum(w * l for w, l in zip(head_w.tolist(), per_head)) / float(head_w.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        meta["positions_seen"] += len(idx)
        meta["targets_seen"] += int((y >= 0).sum())
        return {"loss": float(loss.detach()), "lr": lr, **{f"loss_head{i}": float(l.detach()) for i, l in enumerate(per_head)}}

    def validate(step: int) -> dict[str, float]:
        heads.eval()
        metrics = evaluate(heads, Hv, Yv, cfg.bf16)
        heads.train()
        log("val " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        tracker.metrics({f"val/{k}": v for k, v in metrics.items()}, step)
        return metrics

    heads.train()
    # at until_step the run ends like a finished one: a report, no validation in the loop, the final one after
    end_step = min(cfg.steps, until_step) if until_step is not None else cfg.steps
    loop = StepLoop(end_step, cfg.log_every, cfg.eval_every, cfg.save_every, tracker, log, train_step=train_step,
                    save=save, validate=validate, max_minutes=cfg.max_minutes)
    why, step = loop.run(step)
    stopped_by_time = why == "time"
    metrics = loop.validation(step)
    save(step)
    result = {**{f"val/{k}": v for k, v in metrics.items()}, "step": step, "steps": cfg.steps,
              "positions_seen": meta["positions_seen"], "targets_seen": meta["targets_seen"],
              "wall_s": meta["elapsed_s"], "train_positions": len(H), "val_positions": len(Hv),
              "train_shards": train, "val_shards": val, "draft_vocab": len(vocab), "train_targets_in_vocab": in_vocab,
              "stopped_by_time": stopped_by_time, "finished": step >= cfg.steps}
    tracker.metrics({"positions_seen": meta["positions_seen"], "wall_s": meta["elapsed_s"]}, step)
    tracker.end()
    (out / "metrics.json").write_text(json.dumps(result, indent=1))
    _write_model_card(out, cfg, result, command or " ".join(shlex.quote(a) for a in sys.argv), man, num_layers, d)
    return result


def _write_model_card(out: Path, cfg: TrainBlockConfig, r: dict, command: str, manifest: dict, num_layers: int, d: int) -> None:
    heads = "\n".join(f"| head {i} (token pending+{i + 1}) | {r[f'val/acc_head{i}']:.3f} |" for i in range(cfg.k))
    text = f"""# Block drafter heads: {cfg.k} x residual SiLU on `{cfg.verifier}`

Drafter kind `block` (drafters/block.py). Head i reads the verifier's hidden state after the final norm
(hidden_states[{num_layers}], d={d}) at the position that produced the pending token and predicts token
pending+1+i, through the verifier's frozen LM head restricted to a {r['draft_vocab']}-token draft vocabulary
(draft_vocab.safetensors: token ids only; the LM-head rows are taken from the verifier at load time).

## Training
- command: `{command}`
- data: `{cfg.features}` ({manifest.get('data', '')}; verifier {manifest.get('model', '')}, max_len {manifest.get('max_len', '')}),
  train shards {r['train_shards'][0]}..{r['train_shards'][-1]} ({r['train_positions']} positions), held out {r['val_shards']}
- targets: `{cfg.target}` (head i at position t: token t+2+i, response tokens only); targets outside the draft
  vocabulary are ignored by the loss ({r['train_targets_in_vocab']:.3f} of training targets are inside it)
- steps: {r['step']} of {cfg.steps}{'' if r['finished'] else ' (stopped by the time limit; `metasd train block` on the same config resumes from ' + repr(str(cfg.state_dir or Path(cfg.out) / 'train_state')) + ')'}, batch {cfg.batch_size}, AdamW lr {cfg.lr} (warmup {cfg.warmup}, cosine to
  {cfg.min_lr_ratio} x lr), weight decay {cfg.weight_decay}, head loss decay {cfg.head_decay}, bf16 autocast {cfg.bf16}
- positions seen: {r['positions_seen']} ({r['targets_seen']} head targets); wall time {r['wall_s'] / 60:.1f} min
  (2 shared CPU cores, nice 19)

## Validation (held-out shards, first {int(r['val/positions'])} positions)
Teacher-forced on the held-out ShareGPT responses (not the verifier's own outputs). Top-1 accuracy against
the sequence's tokens (targets outside the draft vocabulary count as misses):

| head | top-1 accuracy |
| --- | --- |
{heads}

Expected tokens per step of the argmax chain (bonus included; plain decoding = 1.00): {r['val/tau']:.3f}.
In-vocabulary cross-entropy: {r['val/loss']:.3f}.

## Files
heads.safetensors (weight [k, d, d], bias [k, d], {cfg.save_dtype}), config.json, draft_vocab.safetensors,
metrics.json. Use in a pool config: `type: block`, `checkpoint: <this directory>`, params `refine: none | ngram | neural`.
"""
    (out / "MODEL_CARD.md").write_text(text)


# ------------------------------------------------------------------------------------------- CLI
def add_train_block_parser(subparsers) -> Any:
    """``metasd train block CONFIG``: register the sub-command on an argparse subparsers object."""
    p = subparsers.add_parser("block", help="train block-drafter heads on verifier features",
                              description="Train the block drafter's heads (YAML config, see metasd.training.block).")
    p.add_argument("config", help="YAML training config")
    p.add_argument("--until-step", type=int, default=None, help="stop this invocation at this step (resumable)")
    p.add_argument("--max-minutes", type=float, default=None, help="override the config's max_minutes")
    p.add_argument("--fresh", action="store_true", help="ignore an existing training state (start over)")
    p.add_argument("--device", default=None, help=f"override the config's device ({DEVICE_HELP})")
    p.set_defaults(func=train_block_main)
    return p


def train_block_main(args) -> int:
    cfg = load_train_block_config(args.config, getattr(args, "device", None))
    updates = {}
    if getattr(args, "max_minutes", None) is not None:
        updates["max_minutes"] = args.max_minutes
    if getattr(args, "fresh", False):
        updates["resume"] = False
    if updates:
        cfg = cfg.model_copy(update=updates)
    train_block(cfg, until_step=getattr(args, "until_step", None),
                command=" ".join(["metasd", "train", "block"] + [shlex.quote(a) for a in sys.argv[3:]])
                if sys.argv[1:3] == ["train", "block"] else None)
    return 0
