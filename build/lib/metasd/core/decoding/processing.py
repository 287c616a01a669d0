"""What a request does to the verifier's logits before acceptance, row by row along each draft node's own path: the
grammar mask of structured output (metasd/core/constraints), then the penalties (penalties.py). Temperature, top-k
and top-p follow (sampling.py). Each depends only on the tokens before the row's position - the committed ones and
the node's ancestors - so acceptance stays exact: the output is plain decoding's with the same processing
(docs/algorithms.md#lossless-acceptance)."""
from __future__ import annotations

from typing import Sequence

import torch

from ..constraints import CompiledConstraint, ConstraintError, ConstraintState, apply_mask
from ..execution.tree import Draft
from .penalties import PathPenalizer, Penalties


class PathProcessing:
    """One request's grammar state and penalty counts; ``apply`` processes a draft's rows, ``commit`` records the
    tokens a step committed. Built only when the request has a constraint or a penalty (``for_request``)."""

    def __init__(self, grammar: ConstraintState | None, penalizer: PathPenalizer | None):
        self.grammar, self.penalizer = grammar, penalizer

    @classmethod
    def for_request(cls, constraint: CompiledConstraint | None, penalties: Penalties, prompt_ids: Sequence[int],
                    device) -> "PathProcessing | None":
        grammar = constraint.new_state() if constraint is not None else None
        penalizer = None if penalties.off else PathPenalizer(penalties, prompt_ids, device)
        return cls(grammar, penalizer) if grammar is not None or penalizer is not None else None

    def apply(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """logits: [n+1, vocab] the verifier's raw rows (row 0 after the pending token, row i+1 after node i);
        returns the processed rows (a new tensor). A node the grammar does not allow under its parent has an all
        -inf row (never read: no rule accepts a node of probability 0)."""
        if self.grammar is not None:
            masks = self.grammar.tree_masks(draft.parents, draft.tokens, logits.shape[-1])  # [n+1, vocab] bool
            if not bool(masks[0].any()):  # a dead end: nothing to sample (softmax of all -inf is NaN)
                raise ConstraintError("grammar", "allows no token of this tokenizer after the text so far (text it "
                                                 "asks for may exist only as a special token, which a grammar must "
                                                 "name as a token: <tool_call>, not \"<tool_call>\")")
            logits = apply_mask(logits.float(), masks)
        if self.penalizer is not None:
            logits = self.penalizer.apply(logits, draft)
        return logits

    def ended(self, eos: set[int]) -> bool:
        """Whether the grammar is complete (nothing may follow but an end-of-sequence token) while the model has no
        end-of-sequence token to end with: the request must end here."""
        return self.grammar is not None and not eos and self.grammar.is_complete()

    def commit(self, tokens: Sequence[int]) -> None:
        if self.grammar is not None:
            self.grammar.accept_tokens(tokens)
        if self.penalizer is not None:
            self.penalizer.commit(tokens)
