"""Small forward hooks on transformers models (no model code is copied or patched)."""
from __future__ import annotations

import torch


def _canonical(x: torch.Tensor) -> torch.Tensor:
    """``x`` with row-major strides, copying only when a stride differs (also for size-1 dimensions)."""
    expected, step = [], 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == x.stride():
        return x
    return x.new_empty(x.shape).copy_(x)


def contiguous_lm_head_input(model: torch.nn.Module) -> torch.nn.Module:
    """Give the LM head an input with canonical strides (idempotent).

    With ``logits_to_keep=1`` on a multi-token forward the head receives the slice ``h[:, -1:, :]``,
    whose size-1 batch dimension keeps the parent's stride. ``contiguous()`` and ``clone()`` keep that
    stride, and ``F.linear`` then takes a ``bmm`` path that copies the whole (vocab x d) weight: measured
    630 ms instead of 20 ms for Qwen2.5-0.5B's 151936 x 896 head in bf16 on 2 CPU cores.
    """
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_metasd_canonical_input", False):
        head.register_forward_pre_hook(lambda module, args: (_canonical(args[0]), *args[1:]))
        head._metasd_canonical_input = True
    return model
