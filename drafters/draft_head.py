"""The draft head: a drafter's LM head restricted to a draft vocabulary (``head_vocab``, docs/algorithms.md)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from metasd.models.draft_vocab import DraftVocab
from metasd.models.quantize import dense_weight, quantize_model

ROW_MULTIPLE = 16  # draft-head rows are padded (with the next ids) to a multiple of this: the int4 kernels need it


class DraftHead(nn.Module):
    """The drafter's LM head restricted to a draft vocabulary (the first ``n`` ids plus ``extra`` ids, padded
    with the ids after ``n`` to a multiple of ``ROW_MULTIPLE`` rows): the
    rows it computes are the only tokens the drafter can propose. The verifier still decides every token, so
    output stays exact; sampling stays exact because q is zero off the draft vocabulary and the drafted
    tokens come from q.

    The output is full-vocabulary logits with -inf off the draft vocabulary, so argmax, top-k and
    ``process_logits`` downstream are unchanged (one fill of a vocabulary-sized row per position).
    """

    def __init__(self, lm_head: nn.Module, n: int, extra: Sequence[int] = ()):
        super().__init__()
        weight = dense_weight(lm_head)  # [V, d] as the head computes (dequantized when quantized)
        self.vocab_size = int(weight.shape[0])
        if not 2 <= n < self.vocab_size:
            raise ValueError(f"head_vocab must be in [2, {self.vocab_size}) (the model's vocabulary), got {n}")
        chosen = set(range(n)) | {int(i) for i in extra if 0 <= int(i) < self.vocab_size}
        nxt = n
        while len(chosen) % ROW_MULTIPLE and nxt < self.vocab_size:  # quantized kernels want rows in multiples
            chosen.add(nxt)
            nxt += 1
        vocab = DraftVocab(torch.tensor(sorted(chosen)), self.vocab_size)
        self.register_buffer("token_ids", vocab.token_ids.to(weight.device), persistent=False)
        bias = getattr(lm_head, "bias", None)
        self.head = nn.Linear(weight.shape[1], len(vocab), bias=bias is not None, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.head.weight.copy_(vocab.head_weight(weight))
            if bias is not None:
                self.head.bias.copy_(bias[self.token_ids])
        self.head.requires_grad_(False)
        mode = getattr(lm_head, "mode", None)  # a quantized LM head: quantize the draft rows the same way
        if mode is not None:
            quantize_model(self, mode, name="draft head")

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: [rows, d] -> logits [rows, vocab]
        reduced = self.head(h)  # [rows, N]
        full = reduced.new_full((reduced.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.token_ids, reduced)
