"""The grammar along a draft as a drafter grows it: ``DraftGuide`` masks a model drafter's logits at each node, so
that its drafts stay inside the grammar the verifier is held to.

Masking the drafter changes only what it proposes, never what is accepted: the verifier's rows are masked along
each node's path anyway (metasd/core/decoding/processing.py), and a sampled draft carries the masked distribution
``q`` it was drawn from, which the acceptance rules use as they use any ``q``. What it buys is acceptance: a drafter
that does not know the grammar spends its draft on tokens of probability 0 under the constrained verifier.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .masking import apply_mask
from .state import ConstraintState, ConstraintViolation


class DraftGuide:
    """The grammar states of a growing draft, one per node it has masked below (made lazily, by forking the parent's
    state and accepting the node's token). Node -1 is the root: the request's committed state (a fork of it; the
    committed state is never changed). ``add(node, parent, token)`` records a node; ``mask(nodes, logits)`` masks
    the logits rows after those nodes ([len(nodes), vocab]); ``expandable(node)`` says whether drafting below a node
    can help (a node outside the grammar, or after an end-of-sequence token, gets an all-False row).
    """

    def __init__(self, committed: ConstraintState):
        self._states: dict[int, ConstraintState | None] = {-1: committed.fork()}
        self._nodes: dict[int, tuple[int, int]] = {}  # node -> (parent, token)

    def add(self, node: int, parent: int, token: int) -> None:
        self._nodes[node] = (parent, token)

    def _state(self, node: int) -> ConstraintState | None:
        """The state after ``node``'s path; None when a token on it is outside the grammar."""
        if node in self._states:
            return self._states[node]
        parent, token = self._nodes[node]
        base = self._state(parent)
        state = None
        if base is not None:
            state = base.fork()
            try:
                state.accept_tokens([token])
            except ConstraintViolation:
                state = None
        self._states[node] = state
        return state

    def expandable(self, node: int) -> bool:
        """Whether drafting below ``node`` can help: its path is inside the grammar and holds no end-of-sequence
        token (a tree drafter expands only such nodes; its ``masks`` row is all False otherwise)."""
        state = self._state(node)
        return state is not None and not state.is_terminated()

    def masks(self, nodes: Sequence[int], vocab: int) -> torch.Tensor:
        """bool [len(nodes), vocab]: the tokens allowed after each node; all False below a node outside the grammar
        and below an end-of-sequence token (the request ends there: drafting on would only add rows no answer
        keeps)."""
        rows = [self._state(n) for n in nodes]
        out = torch.zeros((len(rows), vocab), dtype=torch.bool)
        for i, state in enumerate(rows):
            if state is not None and not state.is_terminated():
                out[i] = state.mask(vocab)
        return out

    def mask(self, nodes: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [len(nodes), vocab] a drafter's logits after each node -> float32 logits, -inf outside the
        grammar (a new tensor on the logits' device)."""
        masks = self.masks(nodes, logits.shape[-1]).to(logits.device)
        return apply_mask(logits.float(), masks)
