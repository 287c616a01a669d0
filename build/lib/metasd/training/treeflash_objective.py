"""What the TreeFlash trainer optimises and measures: block anchors and targets, the position-weighted losses,
the block forward over verifier states, and the held-out evaluation (teacher-forced tree acceptance).

Used by ``metasd.training.treeflash`` (configuration, training loop, export, CLI).
"""
from __future__ import annotations


import torch

from metasd.models.draft_vocab import DraftVocab
from metasd.core.execution.tree import children_lists
from metasd.drafters.treeflash import draft_from_block
from .common import ShardReader
from .devices import bf16_autocast, to_device
from .treeflash_config import TrainTreeFlashConfig


MODES = ("chain", "marginal", "treeflash")  # drafting modes the evaluation measures

# ------------------------------------------------------------------------------------------- data


def valid_anchors(ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Anchor positions a (the pending token) with 1 <= a <= n-2 whose next token is a response token."""
    n = len(ids)
    if n < 3:
        return torch.empty(0, dtype=torch.long)
    a = torch.arange(1, n - 1)
    return a[loss_mask[a + 1]]


def sample_anchors(ids, loss_mask, count: int, g: torch.Generator) -> torch.Tensor:
    cand = valid_anchors(ids, loss_mask)
    if len(cand) <= count:
        return cand
    return cand[torch.randperm(len(cand), generator=g)[:count]].sort().values


def block_targets(seq: dict[str, torch.Tensor], anchors: torch.Tensor, B: int, vocab: DraftVocab, kind: str) -> dict:
    """Targets of block positions j = 1..B-1 for each anchor: token a+j, predicted from row t = a+j-1.

    Returns valid [A, B-1] (token exists, is a response token, and the target has mass in the draft
    vocabulary), top1 / actual [A, B-1] full ids (verifier top-1 at row t, data token a+j) and the loss
    target: ``soft`` (idx [A, B-1, K] reduced ids clamped, p [A, B-1, K]) or ``hard`` (y [A, B-1])."""
    ids, mask = seq["ids"], seq["loss_mask"]
    n = len(ids)
    t = anchors[:, None] + torch.arange(B - 1)[None, :]  # [A, B-1]
    exists = t + 1 < n
    tc = t.clamp(max=n - 2) if n >= 2 else t.clamp(max=0)
    nxt = (tc + 1).clamp(max=n - 1)
    exists = exists & mask[nxt]
    top1 = seq["topk_ids"][tc, 0]
    actual = ids[nxt]
    out = {"exists": exists, "top1": top1, "actual": actual, "t": tc, "prev": ids[tc]}
    if kind == "soft":
        red = vocab.to_reduced(seq["topk_ids"][tc])  # [A, B-1, K]
        p = seq["topk_logp"][tc].float().softmax(-1) * (red >= 0)
        s = p.sum(-1)
        out["valid"] = exists & (s > 0)
        out["p"] = p / s.clamp(min=1e-12)[..., None]
        out["idx"] = red.clamp(min=0)
    else:
        y = vocab.to_reduced(top1 if kind == "verifier" else actual)
        out["valid"] = exists & (y >= 0)
        out["y"] = y.clamp(min=0)
    return out


def position_loss(logp: torch.Tensor, tgt: dict) -> torch.Tensor:
    """logp [A, B-1, N] -> [A, B-1] cross-entropy against the targets (0 where invalid)."""
    if "p" in tgt:
        loss = -(tgt["p"] * logp.gather(-1, tgt["idx"])).sum(-1)
    else:
        loss = -logp.gather(-1, tgt["y"][..., None]).squeeze(-1)
    return torch.where(tgt["valid"], loss, torch.zeros_like(loss))


def position_weights(B: int, gamma: float | None) -> torch.Tensor:
    j = torch.arange(1, B, dtype=torch.float32)
    return torch.ones_like(j) if gamma is None else torch.exp(-(j - 1) / gamma)


def block_states(model, pieces, seq: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
    """Backbone output h [A, B, d] for blocks at ``anchors`` of one sequence (context rows < anchor); ``seq`` and
    ``anchors`` on the model's device."""
    cfg = model.cfg
    dev = anchors.device
    B, C = cfg.block_size, cfg.context_window
    A = len(anchors)
    hi = int(anchors.max())
    lo = max(0, int(anchors.min()) - C) if C else 0
    last, skip = None, None
    if cfg.output_skip_layer is not None:
        rows = (anchors - 1).clamp(min=0)
        skip = seq[f"hidden_{cfg.output_skip_layer}"][rows].to(model.dtype) * (anchors >= 1)[:, None]
    if hi > lo:
        hidden = torch.cat([seq[f"hidden_{l}"][lo:hi] for l in cfg.context_layers], dim=-1)
        pos = torch.arange(lo, hi, device=dev)
        ctx = model.project_context(hidden)
        kv = model.context_kv(ctx, pos)
        visible = pos[None, :] < anchors[:, None]
        if C:
            visible &= pos[None, :] >= anchors[:, None] - C
        if cfg.last_state:
            rows = anchors - 1 - lo  # the row before each anchor (anchors >= 1, so it exists)
            last = torch.where((rows >= 0)[:, None], ctx[rows.clamp(min=0)], torch.zeros_like(ctx[:1]))
    else:
        e = torch.zeros(1, cfg.num_kv_heads, 0, cfg.head_dim, dtype=model.dtype, device=dev)
        kv = [(e, e) for _ in model.layers]
        visible = torch.zeros(A, 0, dtype=torch.bool, device=dev)
    emb = pieces.embed(seq["ids"][anchors], model.dtype)
    block = model.block_inputs(emb, B)
    positions = anchors[:, None] + torch.arange(B, device=dev)[None, :]
    return model(block, positions, kv, visible, last, skip)


def marginal_logp(model, pieces, h: torch.Tensor) -> torch.Tensor:
    """h [A, B, d] -> log-probs [A, B-1, N] of block positions 1..B-1."""
    return model.logits(pieces, h[:, 1:]).float().log_softmax(-1)


def ar_logp(model, pieces, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
    """h [A, B, d], prev_ids [A, B-1] (token before each position) -> conditional log-probs [A, B-1, N]."""
    prev = pieces.embed(prev_ids, h.dtype)
    return model.logits(pieces, model.ar_hidden(h[:, 1:], prev, pieces)).float().log_softmax(-1)




# ------------------------------------------------------------------------------------------- eval
def tf_accept(tokens: list[int], parents: list[int], top1: list[int], valid: list[bool], actual: list[int]) -> tuple[int, int]:
    """Teacher-forced acceptance of a draft: (optimistic count, lower-bound count); see module docstring."""
    kids = children_lists(torch.tensor(parents, dtype=torch.long))
    row, n, lb = 0, 0, None
    for j in range(len(top1)):
        if not valid[j]:
            break
        child = next((c for c in kids[row] if tokens[c] == top1[j]), None)
        if child is None:
            break
        n += 1
        if lb is None and top1[j] != actual[j]:
            lb = n
        row = child + 1
    return n, (n if lb is None else lb)


def val_anchor_set(reader: ShardReader, shards: list[int], total: int, per_seq: int, seed: int) -> list[tuple[int, int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 17)
    out, count = [], 0
    for s in shards:
        for j in range(reader.n_sequences(s)):
            seq = reader.sequence(s, j)
            a = sample_anchors(seq["ids"], seq["loss_mask"], min(per_seq, total - count), g)
            if len(a):
                out.append((s, j, a))
                count += len(a)
            if count >= total:
                return out
    return out


@torch.no_grad()
def evaluate(model, pieces, reader: ShardReader, anchors, vocab: DraftVocab, cfg: TrainTreeFlashConfig,
             trees: int = 0) -> dict[str, float]:
    """Validation figures at fixed held-out anchors (``trees``: how many anchors also get tree drafts), computed on
    the model's device (targets are made on the CPU, then moved)."""
    B = model.cfg.block_size
    device = model.mask_embedding.device
    w = position_weights(B, cfg.gamma).to(device)
    sums: dict[str, torch.Tensor] = {k: torch.zeros(B - 1, device=device) for k in ("marg_hit", "ar_hit", "n")}
    loss = {"marg": 0.0, "ar": 0.0, "w": 0.0}
    taus: dict[str, list[float]] = {}
    done_trees = 0
    was_training = model.training
    model.eval()
    with bf16_autocast(device, cfg.bf16):
        for s, j, a in anchors:
            seq = reader.sequence(s, j)
            seq, a, tgt = to_device((seq, a, block_targets(seq, a, B, vocab, cfg.target)), device)
            h = block_states(model, pieces, seq, a)
            lm = marginal_logp(model, pieces, h)
            la = ar_logp(model, pieces, h, tgt["prev"])
            ex = tgt["exists"]
            for name, lp in (("marg", lm), ("ar", la)):
                hit = (vocab.to_full(lp.argmax(-1)) == tgt["top1"]) & ex
                sums[f"{name}_hit"] += hit.float().sum(0)
                loss[name] += float((position_loss(lp, tgt) * w).sum())
                # teacher-forced chains: leading hits
                lead = torch.cumprod(hit.long(), dim=1).sum(1)
                agree = torch.cumprod((hit & (tgt["top1"] == tgt["actual"])).long(), dim=1).sum(1)
                lb = torch.minimum(lead, agree + 1)
                taus.setdefault(f"tau_argmax_{name}_tf", []).extend((1 + lead).tolist())
                taus.setdefault(f"tau_argmax_{name}_lb", []).extend((1 + lb).tolist())
            sums["n"] += ex.float().sum(0)
            loss["w"] += float((tgt["valid"].float() * w).sum())
            for i in range(len(a)):
                if done_trees >= trees:
                    break
                done_trees += 1
                root = int(seq["ids"][a[i]])
                top1, valid, actual = tgt["top1"][i].tolist(), ex[i].tolist(), tgt["actual"][i].tolist()
                for mode in MODES:
                    toks, parents = draft_from_block(model, pieces, h[i].float(), root, mode, B - 1, cfg.defaults.m,
                                                     cfg.defaults.k, cfg.defaults.tree_size)
                    full = vocab.to_full(torch.tensor(toks, dtype=torch.long)).tolist()
                    tf, lb = tf_accept(full, parents, top1, valid, actual)
                    taus.setdefault(f"tau_{mode}_tf", []).append(1 + tf)
                    taus.setdefault(f"tau_{mode}_lb", []).append(1 + lb)
                    taus.setdefault(f"nodes_{mode}", []).append(len(full))
    model.train(was_training)
    out: dict[str, float] = {}
    n = sums["n"].clamp(min=1)
    for name in ("marg", "ar"):
        acc = sums[f"{name}_hit"] / n
        out[f"acc_{name}"] = float(sums[f"{name}_hit"].sum() / n.sum())
        for jj in range(B - 1):
            out[f"acc_{name}_{jj + 1}"] = float(acc[jj])
        out[f"loss_{name}"] = loss[name] / max(loss["w"], 1e-9)
    for k, v in taus.items():
        out[k] = sum(v) / max(len(v), 1)
    out["val_anchors"] = float(sum(len(a) for _, _, a in anchors))
    return out
