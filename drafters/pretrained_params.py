"""Pool-config ``params`` of the pretrained chain drafter (``PretrainedParams``; the steered drafter extends them) and
the help texts the pretrained drafter types share."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from metasd.core.decoding.drafter import Bool, DrafterParams, Float, Int

HEAD_VOCAB_HELP = ("draft among the first N token ids only (plus the EOS ids): the LM head computes N rows instead "
                   "of the whole vocabulary; byte-pair ids come roughly in frequency order (default: all)")

TRACK_HELP = ("full-information feedback: feed the committed tokens every step, also when another arm drafted (priced "
              "as the pool's work), so this arm is scored on every step")

GRAPHS_HELP = ("the drafting loop after the catch-up run as one CUDA graph (core/execution/draft_loop.py), and a "
               "scheduler's drafting levels as one fixed-shape forward for the batch (core/execution/draft_rows.py): "
               "auto = captured where the model is on CUDA, on = required (refused elsewhere), off = eager forwards, "
               "fixed = the fixed shapes run eagerly (the path a GPU captures, on any device)")

class PretrainedParams(DrafterParams):
    """Pool-config ``params`` of the pretrained chain drafter (and, extended, of the steered one)."""

    k: Int = Field(5, ge=1, description="draft tokens per step (the first k with adaptive_k)")
    confidence_threshold: Float | None = Field(None, ge=0.0, lt=1.0,
                                               description="stop after a token whose drafter probability is below it")
    adaptive_k: Bool = Field(False, description="k += 2 after a fully accepted draft, else k -= 1")
    k_min: Int = Field(1, ge=1, description="lower bound of k (adaptive_k)")
    k_max: Int = Field(16, ge=1, description="upper bound of k (adaptive_k); k may not exceed it")
    head_vocab: Int | None = Field(None, ge=2, description=HEAD_VOCAB_HELP)
    track: Bool = Field(False, description=TRACK_HELP)
    graphs: Literal["auto", "on", "off", "fixed"] = Field("auto", description=GRAPHS_HELP)

    @model_validator(mode="after")
    def _order(self) -> "PretrainedParams":
        if not self.k_min <= self.k <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k <= k_max, got k_min={self.k_min}, k={self.k}, k_max={self.k_max}"
                             + (" (k_max defaults to 16: set it too)" if self.k > self.k_max == 16 else ""))
        return self
