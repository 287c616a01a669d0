"""Training the hidden-state drafter (``metasd train hidden_state CONFIG [--set KEY=VALUE]``; docs/algorithms.md#hidden-state-drafter).

Data: a verifier feature directory (``metasd.training.features``) that stores ``hidden_<state_layer>``
(default state_layer = the verifier's num_hidden_layers, the post-final-norm state; the default feature
layers "3,8,15,21,26,28" of the 1.5B verifier include it), token ids, response mask and top-k log-probs.

Per sequence (cropped to ``max_len``), h [n, d] its real states, ``HiddenStateNet.unrolled_states`` gives
out[k] for k = 0..unroll: out[k][t] = state of position t+1 predicted at depth k+1 from real rows 0..t-k
(k = 0 teacher-forced on real states, k >= 1 on the drafter's own predictions, as drafting does).
Losses at every depth k (weight exp(-k/gamma)), positions t >= k:
  * regression: smooth-L1 (or MSE) between out[k][t] and the real h_{t+1} (mean over d), ``reg_weight``;
  * distillation: inject the real token x_{t+1}: q = softmax(head(g(out[k][t], e(x_{t+1})))) against the
    verifier's top-k distribution of x_{t+2} (row t+1), renormalised inside the draft vocabulary
    (cross-entropy = KL up to a constant), only where x_{t+2} is a response token; ``ce_weight``.
Validation (held-out shards): per-depth top-1 agreement ``acc_<k+1>`` of q with the verifier's top-1 and the
losses, and ``tau_chain`` (``chain_accepted``: held-out tokens per step of a greedy chain of ``defaults.depth``
tokens). ``keep_best``: the exported weights are those of the best ``tau_chain`` seen.

Resumable: ``state_dir`` (default ``<out>/train_state``) holds fp32 weights, optimizer, step and MLflow run
id; the sequence order depends on (seed, step) only, so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from metasd.config import read_yaml_mapping, validate_config
from metasd.models.draft_vocab import DraftVocab
from .common import FeatureTrainingConfig, OptimSection, Schedule, ShardReader, Tracker, flatten, lr_at, save_state, state_file
from .devices import DEVICE_HELP, autocast_note, bf16_autocast, load_optimizer, pieces_on, to_device
from .loop import FeatureRun, KeepBest, StepLoop

BEST_WEIGHTS = "best_fp32.safetensors"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Strict):
    """Architecture (``metasd.drafters.hidden_state_net.HiddenStateConfig``); the width is the verifier's."""

    state_layer: int | None = Field(None, description="verifier hidden_states index; default num_hidden_layers (post-norm)")
    num_heads: int = Field(12, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    head_dim: int | None = Field(None, ge=1)
    intermediate_size: int = Field(4096, ge=1)
    inject_intermediate_size: int = Field(1024, ge=1)
    rope_theta: float = 10000.0


class DraftDefaults(_Strict):
    """Drafting parameters stored in the checkpoint (a pool entry's params override them)."""

    mode: Literal["chain", "tree"] = "chain"
    depth: int = Field(4, ge=1)
    nodes: int = Field(16, ge=1)
    k: int = Field(4, ge=1)
    reuse: bool = True
    max_stale: int = Field(8, ge=0)


class TrainHiddenStateConfig(FeatureTrainingConfig):
    """YAML config of ``metasd train hidden_state``."""

    model: ModelSection = Field(default_factory=ModelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    defaults: DraftDefaults = Field(default_factory=DraftDefaults)
    vocab_size: int = Field(32768, ge=0, description="reduced draft vocabulary; 0 = full vocabulary")
    max_len: int = Field(384, ge=3, description="tokens per training sequence (longer ones are cropped)")
    unroll: int = Field(2, ge=0, description="extra depths trained on the drafter's own predicted states")
    gamma: float | None = Field(4.0, gt=0, description="depth k (0-based) weighs exp(-k/gamma); null: uniform")
    reg_loss: Literal["smooth_l1", "mse"] = "smooth_l1"
    reg_weight: float = Field(1.0, ge=0)
    ce_weight: float = Field(1.0, ge=0)
    bf16: bool = Field(True, description="bf16 autocast for matmuls (weights and optimizer stay fp32)")
    save_dtype: Literal["bf16", "fp32", "int4"] = Field(
        "bf16", description="exported weights: bf16, fp32, or int4 (4-bit groups of 32, ~1/4 of bf16's bytes)")
    keep_best: bool = True
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(100, ge=1)
    save_every: int = Field(50, ge=1)
    val_sequences: int = Field(32, ge=1)
    mlflow_experiment: str = "metasd-hidden-state"


def apply_overrides(raw: dict, sets: list[str]) -> dict:
    """``KEY=VALUE`` (dotted keys, YAML values) -> raw config mapping, updated in place."""
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def load_train_hidden_state_config(path: str | Path, sets: list[str] = ()) -> TrainHiddenStateConfig:
    """Read and validate a training file; ``ConfigError`` (a ``ValueError``) names the file and the field."""
    raw = apply_overrides(read_yaml_mapping(path, "training config"), list(sets))
    return validate_config(TrainHiddenStateConfig, raw, str(path), "hidden_state training config")


# ------------------------------------------------------------------------------------------- losses
def soft_targets(seq: dict[str, torch.Tensor], vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """Targets of q at position t (predicting x_{t+2} from row t+1), t = 0..n-1 (invalid where t+2 >= n).
    Returns idx [n, K] reduced ids, p [n, K], valid [n], top1 [n] verifier top-1 (full id)."""
    n = len(seq["ids"])
    t = torch.arange(n, device=seq["ids"].device)
    row = (t + 1).clamp(max=n - 1)
    red = vocab.to_reduced(seq["topk_ids"][row])
    p = seq["topk_logp"][row].float().softmax(-1) * (red >= 0)
    s = p.sum(-1)
    nxt = (t + 2).clamp(max=n - 1)
    exists = (t + 2 < n) & seq["loss_mask"][nxt]
    return {"idx": red.clamp(min=0), "p": p / s.clamp(min=1e-12)[:, None], "valid": exists & (s > 0),
            "exists": exists, "top1": seq["topk_ids"][row, 0]}


def sequence_losses(net, pieces, seq: dict[str, torch.Tensor], vocab: DraftVocab, cfg: TrainHiddenStateConfig,
                    layer: int, unroll: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Per depth k = 0..unroll (default ``cfg.unroll``): sums of the regression and CE losses, their counts,
    top-1 hits (full-id argmax) and ``hits`` [n] (position t: depth k+1's token after x_{t+1} is the verifier's
    top-1; False where there is no target)."""
    h = seq[f"hidden_{layer}"].float()
    n = len(h)
    outs = net.unrolled_states(h, cfg.unroll if unroll is None else unroll)
    tgt = soft_targets(seq, vocab)
    t = torch.arange(n, device=h.device)
    emb = pieces.embed(seq["ids"][(t + 1).clamp(max=n - 1)])  # e(x_{t+1})
    res = []
    for k, s in enumerate(outs):
        ok = t >= k
        reg_ok = ok & (t + 1 < n)
        target = h[(t + 1).clamp(max=n - 1)]
        if cfg.reg_loss == "smooth_l1":
            reg = F.smooth_l1_loss(s.float(), target, reduction="none").mean(-1)
        else:
            reg = F.mse_loss(s.float(), target, reduction="none").mean(-1)
        # the head (N x d per row, most of the cost) only on rows with a target: response tokens at depth k
        rows = (ok & tgt["exists"]).nonzero().squeeze(-1)
        logp = net.head_logits(net.inject(s[rows], emb[rows]), pieces.head_weight, pieces.head_bias).float().log_softmax(-1)
        ce = -(tgt["p"][rows] * logp.gather(-1, tgt["idx"][rows])).sum(-1)
        ce_ok = tgt["valid"][rows]
        hit = vocab.to_full(logp.argmax(-1)) == tgt["top1"][rows]
        hits = torch.zeros(n, dtype=torch.bool, device=h.device)
        hits[rows] = hit
        res.append({"reg": (reg * reg_ok).sum(), "n_reg": reg_ok.sum(), "ce": (ce * ce_ok).sum(), "n_ce": ce_ok.sum(),
                    "hit": hit.sum(), "n_acc": torch.tensor(len(rows)), "hits": hits})
    return res


def depth_weights(n: int, gamma: float | None) -> list[float]:
    return [1.0 if gamma is None else float(torch.exp(torch.tensor(-k / gamma))) for k in range(n)]


def _crop(seq: dict[str, torch.Tensor], max_len: int) -> dict[str, torch.Tensor]:
    return {k: v[:max_len] for k, v in seq.items()}


def chain_accepted(hits: list[torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
    """Greedy chain acceptance, teacher forced. hits[k] [n] (see ``sequence_losses``); anchors [A] positions t
    whose depth-1 draft has a target. Depth j drafted at anchor t is hit ``hits[j-1][t+j-1]``; the accepted
    length is the number of leading hits (a chain cut by the sequence's end counts as rejected there). On
    the verifier's own greedy answers (on-policy data) this is exactly what drafting would get: an accepted
    token is the real next token, so the teacher-forced injection equals the drafted one."""
    n = len(hits[0])
    alive = torch.ones(len(anchors), dtype=torch.bool, device=anchors.device)
    total = torch.zeros(len(anchors), dtype=torch.long, device=anchors.device)
    for k, hk in enumerate(hits):
        pos = anchors + k
        alive &= (pos < n) & hk[pos.clamp(max=n - 1)]
        total += alive
    return total


@torch.no_grad()
def evaluate(net, pieces, reader: ShardReader, val: list[tuple[int, int]], vocab: DraftVocab,
             cfg: TrainHiddenStateConfig, layer: int) -> dict[str, float]:
    """Held-out metrics: per-depth top-1 agreement and losses for depths 1..max(unroll+1, defaults.depth), and
    ``tau_chain``: tokens per step (bonus included) of a greedy chain of ``defaults.depth`` tokens."""
    was = net.training
    net.eval()
    device = net.out_norm.weight.device
    depths = max(cfg.unroll + 1, cfg.defaults.depth)
    tot = [dict.fromkeys(("reg", "n_reg", "ce", "n_ce", "hit", "n_acc"), 0.0) for _ in range(depths)]
    accepted, anchors = 0, 0
    with bf16_autocast(device, cfg.bf16):
        for s, j in val:
            seq = to_device(_crop(reader.sequence(s, j), cfg.max_len), device)
            res = sequence_losses(net, pieces, seq, vocab, cfg, layer, unroll=depths - 1)
            for k, r in enumerate(res):
                for key in tot[k]:
                    tot[k][key] += float(r[key])
            starts = soft_targets(seq, vocab)["exists"].nonzero().squeeze(-1)
            accepted += int(chain_accepted([r["hits"] for r in res[:cfg.defaults.depth]], starts).sum())
            anchors += len(starts)
    net.train(was)
    out: dict[str, float] = {}
    for k, d in enumerate(tot):
        out[f"acc_{k + 1}"] = d["hit"] / max(d["n_acc"], 1)
        out[f"loss_ce_{k + 1}"] = d["ce"] / max(d["n_ce"], 1)
        out[f"loss_reg_{k + 1}"] = d["reg"] / max(d["n_reg"], 1)
    trained = range(cfg.unroll + 1)  # keep_best and the logged means look at the trained depths
    out["acc"] = sum(out[f"acc_{k + 1}"] for k in trained) / len(trained)
    out["loss_ce"] = sum(out[f"loss_ce_{k + 1}"] for k in trained) / len(trained)
    out["tau_chain"] = 1.0 + accepted / max(anchors, 1)
    return out


# ------------------------------------------------------------------------------------------- training
def train_hidden_state(cfg: TrainHiddenStateConfig, verifier_model=None, until_step: int | None = None,
                       command: str | None = None, log=print) -> Path:
    """Run (or resume) training and export the checkpoint to ``cfg.out``; returns that directory.

    verifier_model: the verifier if already loaded (tests); else its embeddings and head are loaded from
    ``cfg.verifier``. until_step: stop this invocation at that step (state saved, resumable)."""
    from metasd.drafters.hidden_state_net import HiddenStateConfig, HiddenStateNet, count_parameters, save_checkpoint
    from metasd.drafters.treeflash_backbone import VerifierPieces

    run = FeatureRun.start(cfg, verifier_model, log)
    fs, train, val, state_dir, state = run.fs, run.train, run.val, run.state_dir, run.state
    layer = run.n_layers if cfg.model.state_layer is None else cfg.model.state_layer
    if layer not in fs.layers:
        raise ValueError(f"{cfg.features} stores verifier layers {fs.layers}, not state_layer {layer} "
                         f"(extract features with --layers including {layer})")
    reader = ShardReader(fs, [layer])
    vocab = run.draft_vocab(cfg, reader)

    m = cfg.model
    net_cfg = HiddenStateConfig(verifier_hidden_size=run.width, verifier_vocab_size=run.full_vocab, state_layer=layer,
                                num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                intermediate_size=m.intermediate_size,
                                inject_intermediate_size=m.inject_intermediate_size, rope_theta=m.rope_theta)
    torch.manual_seed(cfg.seed)
    device = run.device
    net = HiddenStateNet(net_cfg).to(device)  # initialised on the CPU (the same weights on every device), then moved
    pieces = VerifierPieces.from_model(run.verifier_model, vocab.token_ids, dtype=torch.float32)
    pieces.embed_weight = pieces.embed_weight.float()
    pieces = pieces_on(pieces, device)
    run.verifier_model = None
    if state is None:
        state = {"step": 0, "run_id": None, "wall_s": 0.0, "sequences": 0, "history": [], "best": None,
                 "stopped_by_time": None}
    else:
        net.load_state_dict(load_file(str(state_file(state_dir, state, "weights"))))
        log(f"resuming from {state_dir} at step {state['step']}")
    st = cfg.optim
    opt = torch.optim.AdamW(net.parameters(), lr=st.lr, betas=(0.9, 0.95), weight_decay=st.weight_decay)
    opt_path = state_file(state_dir, state, "optimizer")
    if state["step"] > 0 and opt_path is not None and opt_path.exists():
        load_optimizer(opt, opt_path)
    counts = {s: reader.n_sequences(s) for s in train}
    sched = Schedule(counts, cfg.seed)
    val_set = [(s, j) for s in val for j in range(reader.n_sequences(s))][:cfg.val_sequences]
    tracker = Tracker(cfg.mlflow, cfg.mlflow_experiment, cfg.run_name, state.get("run_id"),
                      {**flatten(cfg.model_dump()), "state_layer_resolved": layer, "draft_vocab_size": len(vocab),
                       "parameters": count_parameters(net)})
    state["run_id"] = tracker.run_id
    log(f"hidden-state drafter: {count_parameters(net):,} parameters, draft vocab {len(vocab)}, layer {layer}, "
        f"{sum(counts.values())} training sequences, {len(val_set)} validation sequences, training "
        f"{autocast_note(device, cfg.bf16)}")
    w = depth_weights(cfg.unroll + 1, cfg.gamma)

    def validate(step: int) -> dict[str, float]:
        metrics = evaluate(net, pieces, reader, val_set, vocab, cfg, layer)
        tracker.metrics({f"val/{k}": v for k, v in metrics.items()}, step)
        state["history"].append({"step": step, **metrics})
        log(f"  val step {step}: acc {metrics['acc']:.3f} acc_1 {metrics['acc_1']:.3f} loss_ce {metrics['loss_ce']:.3f} "
            f"tau_chain {metrics['tau_chain']:.3f}")
        return metrics

    def on_best(step: int, metrics: dict[str, float]) -> None:
        state["best"] = {"step": step, "acc": metrics["acc"], "tau_chain": metrics["tau_chain"]}
        save_file({k: v.detach().float().contiguous().cpu() for k, v in net.state_dict().items()}, str(state_dir / BEST_WEIGHTS))

    def train_step(step: int) -> dict[str, float]:
        lr = lr_at(step, st)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        batch = [_crop(reader.sequence(s, j), cfg.max_len) for s, j in sched.batch(step, st.sequences_per_step)]
        loss_sum = 0.0
        for seq in batch:
            seq = to_device(seq, device)
            with bf16_autocast(device, cfg.bf16):
                res = sequence_losses(net, pieces, seq, vocab, cfg, layer)
            loss = sum(wk * (cfg.reg_weight * r["reg"] / r["n_reg"].clamp(min=1) + cfg.ce_weight * r["ce"] / r["n_ce"].clamp(min=1))
                       for wk, r in zip(w, res)) / len(batch)
            loss.backward()
            loss_sum += float(loss.detach())
        gnorm = float(torch.nn.utils.clip_grad_norm_(net.parameters(), st.grad_clip or float("inf")))
        opt.step()
        state["step"] = step + 1
        state["sequences"] += len(batch)
        return {"loss": loss_sum, "lr": lr, "grad_norm": gnorm}

    def save(step: int) -> None:
        state["wall_s"] = loop.wall()
        save_state(state_dir, net, opt, state)

    best = state["best"].get("tau_chain", -1.0) if state["best"] else None  # states before tau_chain was kept: -1
    loop = StepLoop(st.steps, cfg.log_every, cfg.eval_every, cfg.save_every, tracker, log, train_step=train_step, save=save,
                    validate=validate if val_set else None, until_step=until_step, max_minutes=st.max_minutes,
                    elapsed=state["wall_s"], keep_best=KeepBest("tau_chain", "max", on_best, best) if cfg.keep_best else None)
    try:
        if val_set and not state["history"]:
            loop.validation(0)  # the untrained drafter, for reference
        net.train()
        why, step = loop.run(state["step"])
        if why == "interrupted":
            save(step)
            log(f"stopped at step {step} (resumable from {state_dir})")
            return run.out
        if why == "time":
            state["stopped_by_time"] = step
        state["wall_s"] = loop.wall()
        if val_set and (not state["history"] or state["history"][-1]["step"] != state["step"]):
            loop.validation(state["step"])
        save_state(state_dir, net, opt, state)
        final = state["history"][-1] if state["history"] else {}
        if cfg.keep_best and state["best"] is not None and (state_dir / BEST_WEIGHTS).exists():
            net.load_state_dict(load_file(str(state_dir / BEST_WEIGHTS)))
            final = next(h for h in state["history"] if h["step"] == state["best"]["step"])
        meta = {"verifier": cfg.verifier, "defaults": cfg.defaults.model_dump(), "validation": {"final": final, "history": state["history"]},
                "training": {"command": command, "features": str(fs.path), "train_shards": train, "val_shards": val,
                             "steps": state["step"], "sequences": state["sequences"], "wall_s": round(state["wall_s"], 1),
                             "best": state["best"], "stopped_by_time": state["stopped_by_time"], "unroll": cfg.unroll,
                             "optim": st.model_dump(), "bf16": cfg.bf16, "seed": cfg.seed, "mlflow_run_id": state["run_id"]}}
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int4": "int4"}[cfg.save_dtype]
        path = save_checkpoint(run.out, net, vocab, meta, dtype=dtype)
        (path / "metrics.json").write_text(json.dumps(final, indent=1))
        (path / "MODEL_CARD.md").write_text(model_card(json.loads((path / "config.json").read_text())))
        tracker.artifact(path / "config.json")
        log(f"checkpoint written to {path}")
        return path
    finally:
        tracker.end()


def model_card(meta: dict) -> str:
    """MODEL_CARD.md of an exported checkpoint, from its config.json."""
    m, t, final = meta["model"], meta["training"], meta["validation"]["final"]
    depths = sorted(int(k.split("_")[1]) for k in final if k.startswith("acc_"))
    lines = [
        "# Hidden-state drafter (Make Every Draft Count)", "",
        f"Token-free recurrence over verifier states plus token injection, for verifier `{meta['verifier']}`. "
        "The verifier's embeddings and LM head (restricted to the draft vocabulary) are taken from the verifier "
        "at load and are not in this checkpoint.", "",
        "## Architecture",
        f"- one decoder layer at the verifier width {m['verifier_hidden_size']} ({m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads, MLP {m['intermediate_size']}), token injection MLP {m['inject_intermediate_size']}",
        f"- reads verifier hidden_states[{m['state_layer']}]; draft vocabulary {meta['draft_vocab_size']} tokens; "
        f"weights stored in {meta['weights_dtype']}",
        f"- drafting defaults: {meta['defaults']}", "",
        "## Training",
        f"- command: `{t['command']}`",
        f"- data: `{t['features']}`, train shards {t['train_shards']}, held-out shards {t['val_shards']}",
        f"- {t['steps']} steps, {t['sequences']} sequences, {t['wall_s']} s of training, unroll {t['unroll']}, "
        f"bf16 autocast {t['bf16']}, lr {t['optim']['lr']}; exported step: {t['best'] or 'last'}"
        + (f"; stopped by the time budget at step {t['stopped_by_time']}" if t.get("stopped_by_time") else ""), "",
        "## Held-out validation (teacher forced)", "",
        "| depth | " + " | ".join(str(d) for d in depths) + " |",
        "|---" * (len(depths) + 1) + "|",
        "| top-1 agreement | " + " | ".join(f"{final[f'acc_{d}']:.3f}" for d in depths) + " |",
        "",
        f"- greedy chain of {meta['defaults']['depth']} tokens, tokens per step (bonus included): "
        f"**{final.get('tau_chain', float('nan')):.3f}** (exact for greedy drafting on on-policy data)",
        *([f"- measured with the fp32 training weights; this file stores them as 4-bit groups of "
           f"{meta['int4_group_size']} (loading dequantizes them)"] if meta.get("weights_dtype") == "int4" else []),
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- CLI
def add_train_hidden_state_parser(subparsers) -> Any:
    """``metasd train hidden_state CONFIG``: register the sub-command on an argparse subparsers object."""
    p = subparsers.add_parser("hidden_state", help="train a hidden-state drafter (MEDC) on verifier features",
                              description="Train a hidden-state drafter (YAML config, see metasd.training.hidden_state).")
    p.add_argument("config", help="YAML training config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (dotted key, YAML value), e.g. --set optim.steps=50")
    p.add_argument("--until-step", type=int, default=None, help="stop this invocation at this step; resumable")
    p.add_argument("--fresh", action="store_true", help="ignore an existing training state (start over)")
    p.add_argument("--device", default=None, help=f"override the config's device ({DEVICE_HELP}); = --set device=...")
    p.set_defaults(func=train_hidden_state_main)
    return p


def train_hidden_state_main(args) -> int:
    sets = list(args.set) + ([f"device={args.device}"] if getattr(args, "device", None) else [])
    cfg = load_train_hidden_state_config(args.config, sets)
    if args.fresh:
        cfg = cfg.model_copy(update={"resume": False})
    command = " ".join(["metasd train hidden_state", shlex.quote(args.config)]
                       + [f"--set {shlex.quote(x)}" for x in sets])
    train_hidden_state(cfg, until_step=args.until_step, command=command)
    return 0
