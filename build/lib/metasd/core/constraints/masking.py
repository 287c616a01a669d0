"""Masks as tensors: unpacking llguidance's packed rows, applying a mask to logits, and the draft nodes a tree mask
leaves reachable. Pure functions of tensors, no grammar library needed."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed mask rows -> booleans sized to a model's vocabulary.

    bits: int32 [..., words] on the CPU, bit j of word k set = token ``32k + j`` allowed (llguidance's and
    xgrammar's layout). Returns bool [..., vocab]: ids past ``32 * words`` (a model vocabulary wider than the
    tokenizer's) are False; ids at or past ``vocab`` are dropped (the model cannot produce them).
    """
    if bits.dtype != torch.int32:
        raise TypeError(f"packed mask rows must be int32, got {bits.dtype}")
    if vocab < 0:
        raise ValueError(f"vocab must be >= 0, got {vocab}")
    words = bits.shape[-1]
    little = np.ascontiguousarray(bits.detach().cpu().numpy(), dtype="<i4")  # [..., words], little-endian words
    flat = np.unpackbits(little.view(np.uint8), axis=-1, bitorder="little").view(np.bool_)  # [..., 32 * words]
    out = torch.from_numpy(flat)
    if vocab <= 32 * words:
        return out[..., :vocab]
    pad = torch.zeros((*out.shape[:-1], vocab - 32 * words), dtype=torch.bool)  # [..., extra ids]
    return torch.cat([out, pad], dim=-1)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits with every disallowed token set to -inf (a new tensor; the input is unchanged).

    logits: float [..., vocab], the raw logits BEFORE any softmax, temperature, top-k or top-p: a -inf logit is
    exact under all of them (temperature keeps it -inf, top-k/top-p then choose among allowed tokens, softmax gives
    it probability 0 and renormalises over the allowed ones), so the masked distribution is the verifier's
    distribution conditioned on the grammar. mask: bool, broadcastable to logits ([vocab], or [n+1, vocab] for a
    tree's rows), True = allowed; on the logits' device already (masks are built on the host: stage them as
    metasd/core/execution/staging.py does; a CPU mask here is copied with a plain ``.to``, a blocking copy on CUDA).
    A row whose mask is all False (an unreachable tree node, see
    ``ConstraintState.tree_masks``) becomes all -inf: its softmax is NaN, so reading it by mistake shows.
    """
    if not logits.is_floating_point():
        raise TypeError(f"apply_mask works on float logits, got {logits.dtype}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    if mask.shape[-1] != logits.shape[-1]:
        raise ValueError(f"mask covers {mask.shape[-1]} token ids, the logits {logits.shape[-1]}")
    return logits.masked_fill(~mask.to(logits.device), float("-inf"))


def reachable_nodes(masks: torch.Tensor, parents: Sequence[int] | torch.Tensor,
                    tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Which draft nodes the grammar allows, from ``tree_masks``' rows: node i is reachable when its token is
    allowed in its parent's row. masks: bool [n+1, vocab]; returns bool [n]. A node below an unreachable one is
    unreachable too (its parent's row is all False). Nodes whose token is past the vocabulary are unreachable."""
    parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1)  # [n]
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)  # [n]
    if masks.dim() != 2 or masks.shape[0] != tokens.numel() + 1 or parents.numel() != tokens.numel():
        raise ValueError(f"masks must be [n+1, vocab] for n = {tokens.numel()} nodes, got {list(masks.shape)}")
    inside = (tokens >= 0) & (tokens < masks.shape[1])  # [n]
    out = torch.zeros(tokens.numel(), dtype=torch.bool)
    out[inside] = masks.cpu()[(parents + 1)[inside], tokens[inside]]
    return out
