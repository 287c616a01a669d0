"""Training a TreeFlash drafter (``metasd train treeflash CONFIG``; docs/algorithms.md#treeflash).

Data: a verifier feature directory (``metasd.training.features``): token ids, response mask, verifier
hidden states of several layers, and the verifier's top-k next-token log-probabilities at every position.

Stage 1, the block backbone (DFlash recipe). Per step, ``sequences_per_step`` training sequences (the
order is a function of the step only) and ``anchors_per_sequence`` random anchor positions a in each
(1 <= a <= n-2, token a+1 a response token). The block is [ids[a], MASK x (B-1)] at positions a..a+B-1;
its context is the verifier states of rows max(0, a-C)..a-1 (row a, the anchor's own state, does not
exist yet at drafting time: the anchor is the pending token). Block position j (1..B-1) predicts token
a+j. Loss weight of position j: exp(-(j-1)/gamma) (uniform when gamma is null); only positions whose
token a+j exists and is a response token count.

Stage 2, the AR approximation (TreeFlash), backbone frozen: position j's state is corrected with the
teacher-forced previous token ids[a+j-1] (the anchor itself for j = 1) and trained with the same loss.

Targets (``target``; default ``soft``): the verifier's own distribution of token a+j given the real
prefix, i.e. row a+j-1 of the stored top-k log-probabilities, renormalised over the entries inside the
draft vocabulary (a distillation cross-entropy, equal to KL(p_top-k || q) up to a constant). It carries
the verifier's top-1 (what greedy verification accepts) and its ranking of alternatives (what tree
siblings need). ``verifier``: hard label = the verifier's top-1 ``topk_ids[a+j-1, 0]``; ``data``: hard
label = the sequence's token ids[a+j]. Targets outside the draft vocabulary are dropped from the loss;
validation counts them as misses.

Output norm (``model.output_norm``): N in q = softmax(lm_head(N(h))). ``verifier`` uses the verifier's
final norm, frozen; ``own`` a trainable RMSNorm of the drafter initialised to ones (what the public
TreeFlash code does: its drafter's own ``model.norm`` before the target's LM head). With the verifier's
norm (gains up to ~12 on Qwen2.5-Coder-1.5B) the untrained drafter's logits are very sharp (initial loss
16 vs 9.6) and 250 steps on the bundled verifier only reached the unigram level; prefer ``own``.

Reduced vocabulary: the ``vocab_size`` most frequent tokens of the training shards (sequence tokens plus
the verifier's top-1 predictions; EOS always in).

Validation on held-out shards, at fixed anchors: per-position top-1 accuracy against the verifier's top-1
(``acc_marg_j`` for the marginals, ``acc_ar_j`` for the AR conditionals with teacher-forced previous
tokens) and teacher-forced tokens per step (bonus included; plain decoding = 1.00) of a draft:
``tau_<mode>_tf`` walks the draft (chain, marginal tree or TreeFlash tree) accepting a node when its token
equals the verifier's top-1 at that depth under the real prefix (optimistic where the data diverge from
the verifier's greedy path); ``tau_<mode>_lb`` also stops after a node whose accepted token differs from
the data's token (where the next target would be conditioned on another prefix): a lower bound.
``tau_argmax_marg_*`` is the chain of marginal argmaxes (= mode chain) over all validation anchors;
``tau_argmax_ar_*`` the chain of AR-conditional argmaxes given the real previous tokens (an upper-bound
view of what the AR approximation knows); the tree figures use ``val_tree_anchors`` anchors and the
checkpoint's drafting defaults (m, k, tree_size).

Files: ``out`` receives model.safetensors (``save_dtype``), config.json, draft_vocab.safetensors,
metrics.json and MODEL_CARD.md; ``state_dir`` (default ``<out>/train_state``) the resumable state (fp32
weights, optimizer, stage, step, counters, MLflow run id). A run resumes from ``state_dir`` unless
``resume: false``; data order and anchors depend on (seed, stage, step) only, so an interrupted and
resumed run equals an uninterrupted one. MLflow: URI from MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
in the current directory; a resumed run continues its MLflow run.

Code: configuration, training loop, export and CLI here; anchors, targets, losses, the block forward and the
held-out evaluation in ``metasd.training.treeflash_objective``.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from metasd.models.draft_vocab import DraftVocab
from .common import Schedule, ShardReader, Tracker, flatten, lr_at, save_state, state_file
from .devices import DEVICE_HELP, autocast_note, bf16_autocast, load_optimizer, pieces_on, to_device
from .loop import FeatureRun, StepLoop
from .features import FeatureSet
from .treeflash_config import TrainTreeFlashConfig, load_train_treeflash_config  # noqa: F401  (the config's home)
from .treeflash_objective import (ar_logp, block_states, block_targets, evaluate, marginal_logp, position_loss,
                                  position_weights, sample_anchors, val_anchor_set)



# ------------------------------------------------------------------------------------------- training


def train_treeflash(cfg: TrainTreeFlashConfig, verifier_model=None, until_step: int | None = None,
                    command: str | None = None, log=print) -> Path:
    """Run (or resume) both stages and export the checkpoint to ``cfg.out``; returns that directory.

    verifier_model: the verifier, if already loaded (tests); else ``cfg.verifier`` is loaded in bf16.
    until_step: stop this invocation once the global step (stage 1 steps + stage 2 steps) reaches it
    (the state is saved; a later call resumes).
    """
    from metasd.drafters.treeflash_backbone import TreeFlashConfig, TreeFlashModel, VerifierPieces, count_parameters

    t_invocation = time.time()
    run = FeatureRun.start(cfg, verifier_model, log)
    fs, train, val, state_dir, state = run.fs, run.train, run.val, run.state_dir, run.state
    layers = cfg.model.context_layers or [l for l in fs.layers if l < run.n_layers]
    missing = [l for l in layers if l not in fs.layers]
    if missing:
        raise ValueError(f"context layers {missing} are not in the feature set (layers {fs.layers})")
    reader = ShardReader(fs, layers)
    vocab = run.draft_vocab(cfg, reader)

    mcfg = TreeFlashConfig(verifier_hidden_size=run.width, verifier_vocab_size=run.full_vocab, context_layers=layers,
                           hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                           num_heads=cfg.model.num_heads, num_kv_heads=cfg.model.num_kv_heads,
                           intermediate_size=cfg.model.intermediate_size,
                           ar_intermediate_size=cfg.model.ar_intermediate_size, block_size=cfg.model.block_size,
                           context_window=cfg.model.context_window, rope_theta=cfg.model.rope_theta,
                           output_norm=cfg.model.output_norm, context_layer_norm=cfg.model.context_layer_norm,
                           last_state=cfg.model.last_state, output_skip_layer=cfg.model.output_skip_layer)
    torch.manual_seed(cfg.seed)
    device = run.device
    model = TreeFlashModel(mcfg).to(device)  # initialised on the CPU (the same weights on every device), then moved
    head_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    pieces = VerifierPieces.from_model(run.verifier_model, vocab.token_ids, copy_norm=True, dtype=torch.float32)
    pieces.head_weight = pieces.head_weight.to(head_dtype)
    if pieces.head_bias is not None:
        pieces.head_bias = pieces.head_bias.to(head_dtype)
    pieces = pieces_on(pieces, device)
    run.verifier_model = None

    if state is None:
        state = {"stage": 1, "step": 0, "run_id": None, "wall_s": {"1": 0.0, "2": 0.0}, "anchors": {"1": 0, "2": 0},
                 "targets": {"1": 0, "2": 0}, "history": [], "stopped_by_time": {}}
    else:
        model.load_state_dict(load_file(str(state_file(state_dir, state, "weights"))))
        log(f"resuming from {state_dir}: stage {state['stage']}, step {state['step']}")

    counts_per_shard = {s: reader.n_sequences(s) for s in train}
    val_set = val_anchor_set(reader, val, cfg.val_anchors, cfg.val_anchors_per_sequence, cfg.seed) if val else []
    params = {**flatten(cfg.model_dump()), "context_layers_resolved": layers, "draft_vocab_size": len(vocab),
              "train_sequences": sum(counts_per_shard.values()), "parameters": count_parameters(model)}
    tracker = Tracker(cfg.mlflow, cfg.mlflow_experiment, cfg.run_name, state.get("run_id"), params)
    state["run_id"] = tracker.run_id
    log(f"TreeFlash: {count_parameters(model):,} trainable parameters, draft vocab {len(vocab)}, "
        f"context layers {layers}, {sum(counts_per_shard.values())} training sequences, {len(val_set)} val sequences, "
        f"training {autocast_note(device, cfg.bf16)}")

    if val_set and not state["history"] and state["stage"] == 1 and state["step"] == 0:
        metrics = evaluate(model, pieces, reader, val_set, vocab, cfg)  # the untrained drafter, for reference
        tracker.metrics({f"val/{k}": v for k, v in metrics.items()}, 0)
        state["history"].append({"stage": 0, "step": 0, **metrics})
        log(f"untrained: acc_marg {metrics['acc_marg']:.3f} loss_marg {metrics['loss_marg']:.3f}")
    stages = {1: cfg.stage1, 2: cfg.stage2}
    w = position_weights(mcfg.block_size, cfg.gamma)
    w_dev = w.to(device)
    try:
        while state["stage"] <= 2:
            stage = state["stage"]
            st = stages[stage]
            trainable = model.backbone_parameters() if stage == 1 else model.ar_parameters()
            for p in model.parameters():
                p.requires_grad_(False)
            for p in trainable:
                p.requires_grad_(True)
            opt = torch.optim.AdamW(trainable, lr=st.lr, betas=(0.9, 0.95), weight_decay=st.weight_decay)
            opt_path = state_file(state_dir, state, "optimizer")
            if state["step"] > 0 and opt_path is not None and opt_path.exists():
                load_optimizer(opt, opt_path)
            sched = Schedule(counts_per_shard, cfg.seed + 1000 * stage)
            base = cfg.stage1.steps if stage == 2 else 0
            model.train()

            def train_step(step: int) -> dict[str, float]:
                lr = lr_at(step, st)
                for group in opt.param_groups:
                    group["lr"] = lr
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + stage * 100_003 + step)
                batch = []
                for s, j in sched.batch(step, st.sequences_per_step):
                    seq = reader.sequence(s, j)
                    a = sample_anchors(seq["ids"], seq["loss_mask"], st.anchors_per_sequence, g)
                    if len(a):
                        batch.append((seq, a, block_targets(seq, a, mcfg.block_size, vocab, cfg.target)))
                total_w = sum(float((t["valid"].float() * w).sum()) for _, _, t in batch)
                opt.zero_grad(set_to_none=True)
                loss_sum, n_targets, gnorm = 0.0, 0, 0.0
                if total_w > 0:
                    for seq, a, tgt in batch:
                        seq, a, tgt = to_device((seq, a, tgt), device)  # drawn on the CPU, computed on the device
                        with bf16_autocast(device, cfg.bf16):
                            if stage == 1:
                                lp = marginal_logp(model, pieces, block_states(model, pieces, seq, a))
                            else:
                                with torch.no_grad():
                                    h = block_states(model, pieces, seq, a)
                                lp = ar_logp(model, pieces, h, tgt["prev"])
                        loss = (position_loss(lp, tgt) * w_dev).sum() / total_w
                        loss.backward()
                        loss_sum += float(loss.detach())
                        n_targets += int(tgt["valid"].sum())
                    gnorm = float(torch.nn.utils.clip_grad_norm_(trainable, st.grad_clip or float("inf")))
                    opt.step()
                state["step"] = step + 1
                state["anchors"][str(stage)] += sum(len(a) for _, a, _ in batch)
                state["targets"][str(stage)] += n_targets
                return {f"loss_stage{stage}": loss_sum, "lr": lr, "grad_norm": gnorm}

            def validate(step: int) -> dict[str, float]:
                metrics = evaluate(model, pieces, reader, val_set, vocab, cfg)
                tracker.metrics({f"val/{k}": v for k, v in metrics.items()}, base + step)
                log(f"  val: acc_marg {metrics['acc_marg']:.3f} acc_ar {metrics['acc_ar']:.3f} "
                    f"tau_argmax_marg_tf {metrics['tau_argmax_marg_tf']:.3f}")
                return metrics

            def save(step: int) -> None:
                state["wall_s"][str(stage)] = loop.wall()
                save_state(state_dir, model, opt, state)

            loop = StepLoop(st.steps, cfg.log_every, cfg.eval_every, cfg.save_every, tracker, log, train_step=train_step,
                            save=save, validate=validate if val_set else None, until_step=until_step,
                            max_minutes=st.max_minutes, elapsed=state["wall_s"][str(stage)], offset=base,
                            label=f"stage {stage} ")
            why, step = loop.run(state["step"])
            state["wall_s"][str(stage)] = loop.wall()
            if why == "interrupted":
                save_state(state_dir, model, opt, state)
                log(f"stopped at global step {until_step} (resumable from {state_dir})")
                return run.out
            if why == "time":
                state["stopped_by_time"][str(stage)] = step
            # stage done: record validation, move on
            if val_set:
                metrics = evaluate(model, pieces, reader, val_set, vocab, cfg)
                tracker.metrics({f"val/{k}": v for k, v in metrics.items()}, base + state["step"])
                state["history"].append({"stage": stage, "step": state["step"], **metrics})
                log(f"stage {stage} done: acc_marg {metrics['acc_marg']:.3f} acc_ar {metrics['acc_ar']:.3f}")
            state["stage"], state["step"] = stage + 1, 0
            save_state(state_dir, model, None, state)
            if opt_path.exists():
                opt_path.unlink()

        final = {}
        if val_set:
            final = evaluate(model, pieces, reader, val_set, vocab, cfg, trees=cfg.val_tree_anchors)
            tracker.metrics({f"final/{k}": v for k, v in final.items()}, cfg.stage1.steps + cfg.stage2.steps)
        path = export_checkpoint(cfg, model, vocab, layers, state, final, fs, train, val, command, t_invocation)
        tracker.artifact(path / "config.json")
        tracker.artifact(path / "MODEL_CARD.md")
        log(f"checkpoint written to {path}")
        return path
    finally:
        tracker.end()


def export_checkpoint(cfg: TrainTreeFlashConfig, model, vocab: DraftVocab, layers: list[int], state: dict,
                      final: dict, fs: FeatureSet, train: list[int], val: list[int], command: str | None,
                      t_invocation: float) -> Path:
    from metasd.drafters.treeflash import CONFIG_FILE, save_checkpoint
    from metasd.drafters.treeflash_backbone import count_parameters

    out = Path(cfg.out)
    B = model.cfg.block_size
    training = {
        "command": command, "features": str(fs.path), "feature_manifest": fs.manifest,
        "train_shards": train, "val_shards": val, "target": cfg.target, "gamma": cfg.gamma,
        "stage1": {**cfg.stage1.model_dump(), "steps_done": cfg.stage1.steps if state["stage"] > 1 else state["step"],
                   "anchors": state["anchors"]["1"], "target_positions": state["targets"]["1"],
                   "block_positions": state["anchors"]["1"] * B, "wall_s": round(state["wall_s"]["1"], 1)},
        "stage2": {**cfg.stage2.model_dump(), "anchors": state["anchors"]["2"],
                   "target_positions": state["targets"]["2"], "block_positions": state["anchors"]["2"] * B,
                   "wall_s": round(state["wall_s"]["2"], 1)},
        "stopped_by_time": state.get("stopped_by_time", {}), "bf16": cfg.bf16, "seed": cfg.seed,
        "parameters": count_parameters(model), "mlflow_run_id": state.get("run_id"),
    }
    save_checkpoint(out, model, vocab, {"weights_dtype": cfg.save_dtype, "verifier": cfg.verifier,
                                        "defaults": cfg.defaults.model_dump(), "training": training,
                                        "validation": {"stages": state.get("history", []), "final": final}},
                    dtype=torch.bfloat16 if cfg.save_dtype == "bf16" else torch.float32)
    meta = json.loads((out / CONFIG_FILE).read_text())
    (out / "metrics.json").write_text(json.dumps(final, indent=1))
    (out / "MODEL_CARD.md").write_text(model_card(meta))
    return out


def model_card(meta: dict) -> str:
    tr, val, m = meta["training"], meta["validation"]["final"], meta["model"]
    B = m["block_size"]
    lines = [
        "# TreeFlash drafter",
        "",
        f"One-shot block drafter (DFlash backbone) with the TreeFlash AR approximation, for verifier "
        f"`{meta['verifier']}`. Frozen verifier embeddings, final norm and LM head are taken from the verifier "
        f"at load and are not in this checkpoint.",
        "",
        "## Architecture",
        f"- {m['num_layers']} layers, width {m['hidden_size']} ({m['num_heads']} heads, {m['num_kv_heads']} KV heads), "
        f"MLP {m['intermediate_size']}; AR MLP I = {m['ar_intermediate_size']}",
        f"- block size B = {B} (drafts reach depth {B - 1}); context = verifier layers {m['context_layers']}, "
        f"last {m['context_window'] or 'all'} positions",
        f"- draft vocabulary: {meta['draft_vocab_size']} tokens; {tr['parameters']:,} parameters stored in "
        f"{meta['weights_dtype']}",
        f"- drafting defaults: {meta['defaults']}",
        "",
        "## Training",
        f"- command: `{tr['command'] or '(python API)'}`",
        f"- data: `{tr['features']}` ({tr['feature_manifest'].get('data', '')}), train shards {tr['train_shards']}, "
        f"held-out shards {tr['val_shards']}",
        f"- target: {tr['target']} (see metasd/training/treeflash_objective.py), position weights exp(-(j-1)/{tr['gamma']})",
    ]
    for s in ("stage1", "stage2"):
        d = tr[s]
        lines.append(f"- {s}: {d.get('steps_done', d['steps'])} steps x {d['sequences_per_step']} sequences x "
                     f"{d['anchors_per_sequence']} anchors, lr {d['lr']}; anchors {d['anchors']}, block positions "
                     f"{d['block_positions']}, target positions {d['target_positions']}, wall {d['wall_s']} s")
    if tr.get("stopped_by_time"):
        lines.append(f"- stages stopped by their time budget (stage: step): {tr['stopped_by_time']}")
    if val:
        lines += ["", "## Validation (held-out shards, teacher forced; tokens per step include the bonus)", ""]
        lines.append("| position j | " + " | ".join(str(j) for j in range(1, B)) + " |")
        lines.append("|---|" + "---|" * (B - 1))
        for name in ("marg", "ar"):
            lines.append(f"| top-1 acc {name} | " + " | ".join(f"{val.get(f'acc_{name}_{j}', float('nan')):.3f}"
                                                              for j in range(1, B)) + " |")
        lines.append("")
        for key in sorted(k for k in val if k.startswith("tau_") or k.startswith("nodes_")):
            lines.append(f"- {key}: {val[key]:.3f}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- CLI
def add_train_treeflash_parser(subparsers) -> Any:
    """``metasd train treeflash CONFIG``: register the sub-command on an argparse subparsers object."""
    p = subparsers.add_parser("treeflash", help="train a TreeFlash drafter on verifier features",
                              description="Train a TreeFlash drafter (YAML config, see metasd.training.treeflash).")
    p.add_argument("config", help="YAML training config")
    p.add_argument("--until-step", type=int, default=None,
                   help="stop this invocation at this global step (stage-1 steps + stage-2 steps); resumable")
    p.add_argument("--fresh", action="store_true", help="ignore an existing training state (start over)")
    p.add_argument("--device", default=None, help=f"override the config's device ({DEVICE_HELP})")
    p.set_defaults(func=train_treeflash_main)
    return p


def train_treeflash_main(args) -> int:
    cfg = load_train_treeflash_config(args.config, getattr(args, "device", None))
    if getattr(args, "fresh", False):
        cfg = cfg.model_copy(update={"resume": False})
    argv = sys.argv[1:]
    command = " ".join(["metasd"] + [shlex.quote(a) for a in argv]) if argv[:2] == ["train", "treeflash"] else None
    train_treeflash(cfg, until_step=getattr(args, "until_step", None), command=command)
    return 0


if __name__ == "__main__":  # python -m metasd.training.treeflash CONFIG [--until-step N] [--fresh]
    import argparse

    parser = argparse.ArgumentParser(prog="python -m metasd.training.treeflash")
    add_train_treeflash_parser(parser.add_subparsers(dest="what", required=True))
    a = parser.parse_args(["treeflash"] + sys.argv[1:])
    sys.exit(train_treeflash_main(a))
