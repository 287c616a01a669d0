"""Structured output for a model that thinks first: the grammar holds the answer, not the thinking.

A reasoning model (Qwen3, QwQ, DeepSeek-R1) writes ``<think> ... </think>`` before its answer. A JSON schema, a regex
or a required tool call is about the answer, so ``AfterThinking`` wraps a compiled constraint in a three-phase gate
on the token path (vLLM applies structured output after the reasoning end token the same way):

- ``open``: the answer has not started. The model may open a thinking block with the start token, or start its
  answer, which the grammar then holds from its first token: allowed = grammar's tokens | {start}.
- ``thinking``: inside the block every token is allowed (the thinking is free text); the end token closes it.
- ``answer``: after the end token (or from the first token that did not open a block), the wrapped grammar.

A prompt that ends inside an open block (a chat template that writes ``<think>`` itself; DeepSeek-R1, whose answers
start inside one) starts in ``thinking``. The markers must each be one token of the tokenizer (``thinking_tokens``):
the gate follows token ids, as vLLM's reasoning end check does; Qwen3's, QwQ's and DeepSeek-R1's ``<think>`` and
``</think>`` are added tokens. The server's text parser (metasd/serve/reasoning.py) and this gate then agree on
where the answer starts - except for a model that spells ``</think>`` in pieces instead of its token, which the
parser reads as the end and this gate does not (its answer is then not held to the grammar; never seen, not
excluded). An end-of-sequence token inside the block ends the request there, with no answer.

``AfterThinking`` is shared between requests like the ``CompiledConstraint`` it wraps; ``new_state()`` gives each
request its own ``AfterThinkingState``, which has ``ConstraintState``'s interface (``accept_tokens``, ``mask``,
``tree_masks``, ``is_complete``, ``is_terminated``, ``fork``), so the engine, the drafters' guides and the verifier's
masks use it unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .masking import unpack_bitmask
from .state import ConstraintState, ConstraintViolation, _check_tree, _token_ids

OPEN, THINKING, ANSWER, ENDED = "open", "thinking", "answer", "ended"  # ENDED: an end-of-sequence token in the block


def thinking_tokens(tokenizer: Any, start: str = "<think>", end: str = "</think>") -> tuple[int, int] | None:
    """The ids of the thinking block's two markers where the tokenizer writes each as exactly one token (None where
    it does not: e.g. Qwen2.5's tokenizer, which spells ``<think>`` in three pieces)."""
    ids = []
    for marker in (start, end):
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


def _packed(ids: range | Sequence[int], words: int) -> torch.Tensor:
    """int32 [words] with the bits of ``ids`` set (llguidance's packed layout: bit j of word k = id 32k + j)."""
    allowed = np.zeros(32 * words, dtype=np.bool_)
    allowed[list(ids)] = True
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32))


class AfterThinking:
    """A compiled constraint held back until the model's thinking block is over (module doc).

    ``inner``: the ``CompiledConstraint`` the answer follows; ``start_id`` / ``end_id``: the block's marker tokens
    (``thinking_tokens``); ``inside``: the prompt ends inside an open block (the answer starts thinking).
    """

    def __init__(self, inner: Any, start_id: int, end_id: int, inside: bool):
        for name, t in (("start_id", start_id), ("end_id", end_id)):
            if not 0 <= t < inner.vocab_size or t in inner.eos_token_ids:
                raise ValueError(f"{name} {t} is not a token the grammar's tokenizer may write")
        self.inner, self.start_id, self.end_id, self.inside = inner, start_id, end_id, inside
        self.spec, self.eos_token_ids, self.vocab_size = inner.spec, inner.eos_token_ids, inner.vocab_size
        self.words, self.eos_bits = inner.words, inner.eos_bits
        self.all_bits = _packed(range(self.vocab_size), self.words)  # [words]: every id of the tokenizer
        self.start_bits = _packed([start_id], self.words)  # [words]: the start marker only

    def new_state(self) -> "AfterThinkingState":
        """A fresh per-request state."""
        return AfterThinkingState(self, self.inner.new_state(), THINKING if self.inside else OPEN)

    def __repr__(self) -> str:
        return (f"AfterThinking({self.inner!r}, start_id={self.start_id}, end_id={self.end_id}, "
                f"inside={self.inside})")


class AfterThinkingState:
    """One request's place in ``AfterThinking``'s gate: its phase, and the wrapped grammar's state (untouched until
    the answer starts). The interface of ``ConstraintState``."""

    def __init__(self, gate: AfterThinking, inner: ConstraintState, phase: str, committed: int = 0):
        self.compiled, self.inner, self.phase, self._committed = gate, inner, phase, committed

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def num_committed(self) -> int:
        """How many tokens have been committed (thinking and answer)."""
        return self._committed

    def fork(self) -> "AfterThinkingState":
        return AfterThinkingState(self.compiled, self.inner.fork(), self.phase, self._committed)

    def _next(self, phase: str, token: int) -> str:
        """The phase after ``token`` in ``phase`` (OPEN -> ANSWER means the grammar consumes the token)."""
        gate = self.compiled
        if phase == OPEN:
            return THINKING if token == gate.start_id else ANSWER
        if phase == THINKING:
            if token == gate.end_id:
                return ANSWER
            return ENDED if token in gate.eos_token_ids else THINKING
        return phase

    def accept_tokens(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Commit ``tokens``, all or none (``ConstraintState.accept_tokens``): the thinking's freely, the answer's
        through the grammar."""
        ids = _token_ids(tokens, "tokens")
        phase, answer_from = self.phase, None
        for k, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ConstraintViolation(k, t, f"is outside the tokenizer's {self.vocab_size} ids")
            if phase == ENDED and t not in self.compiled.eos_token_ids:
                raise ConstraintViolation(k, t, "is not allowed by the grammar after an end-of-sequence token")
            nxt = self._next(phase, t)
            if phase in (OPEN, ANSWER) and nxt == ANSWER:  # the grammar's from here on (as ``tree_bitmask`` reads it)
                answer_from, phase = k, ANSWER
                break
            phase = nxt
        if answer_from is not None:
            try:
                self.inner.accept_tokens(ids[answer_from:])
            except ConstraintViolation as e:
                raise ConstraintViolation(answer_from + e.index, e.token, e.reason) from None
        self.phase, self._committed = phase, self._committed + len(ids)

    def eos_allowed(self) -> bool:
        return self.phase in (THINKING, ENDED) or self.inner.eos_allowed()

    def is_complete(self) -> bool:
        """Whether nothing but an end-of-sequence token may follow: the answer's grammar is complete, or an
        end-of-sequence token was committed inside the block."""
        return self.phase == ENDED or (self.phase == ANSWER and self.inner.is_complete())

    def is_terminated(self) -> bool:
        return self.phase == ENDED or (self.phase != THINKING and self.inner.is_terminated())

    def mask_bits(self) -> torch.Tensor:
        """The packed allowed-token mask after the committed tokens: int32 [words]."""
        return self.tree_bitmask([], [])[0]

    def mask(self, vocab: int) -> torch.Tensor:
        return unpack_bitmask(self.mask_bits(), vocab)

    def tree_masks(self, parents: Sequence[int] | torch.Tensor, tokens: Sequence[int] | torch.Tensor,
                   vocab: int) -> torch.Tensor:
        """bool [n+1, vocab]: the masks along every path of a draft tree (``ConstraintState.tree_masks``)."""
        return unpack_bitmask(self.tree_bitmask(parents, tokens), vocab)

    def tree_bitmask(self, parents: Sequence[int] | torch.Tensor,
                     tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """int32 [n+1, words]: ``tree_masks`` packed, rows of unreachable nodes all zero.

        The nodes whose tokens the grammar consumes (those after an end token, or the first answer token after the
        root in ``open``, and their answer descendants) form a forest below the grammar's state, which is the
        committed one (untouched before the answer starts); the wrapped state masks that forest in one call. The
        thinking's rows allow every token."""
        parents_l, tokens_l = _check_tree(parents, tokens)
        gate, n = self.compiled, len(tokens_l)
        phases = [self.phase] + [None] * n  # phases[r]: the phase after row r's path (None: unreachable)
        inner_of: list[int | None] = [None] * (n + 1)  # row -> the grammar's node index (0: its root) or None
        inner_parents: list[int] = []
        inner_tokens: list[int] = []
        inner_rows: list[int] = []  # the grammar's node j -> its outer node i
        if self.phase in (OPEN, ANSWER):
            inner_of[0] = 0
        for i, (p, t) in enumerate(zip(parents_l, tokens_l)):
            row, phase = p + 1, phases[p + 1]
            if phase is None or not 0 <= t < gate.vocab_size:
                continue
            nxt = self._next(phase, t)
            if phase in (OPEN, ANSWER) and nxt == ANSWER:  # the grammar consumes t (reachability decided below)
                inner_parents.append(inner_of[row] - 1)
                inner_tokens.append(t)
                inner_rows.append(i)
                inner_of[i + 1] = len(inner_tokens)
            elif nxt == ANSWER:  # the end token: the answer starts after it, at the grammar's root
                inner_of[i + 1] = 0
            elif phase == ENDED and t not in gate.eos_token_ids:
                continue
            phases[i + 1] = nxt
        inner = self.inner.tree_bitmask(inner_parents, inner_tokens)  # [m+1, words]
        reachable = [True] + [False] * n
        bits = torch.zeros((n + 1, gate.words), dtype=torch.int32)  # [n+1, words]
        view = bits.numpy()
        for r in range(n + 1):
            if r > 0:
                p, t = parents_l[r - 1] + 1, tokens_l[r - 1]
                if phases[r] is None or not reachable[p] or not (int(view[p, t >> 5]) >> (t & 31)) & 1:
                    continue
                reachable[r] = True
            phase = phases[r]
            if phase == THINKING:
                bits[r] = gate.all_bits
            elif phase == ENDED:
                bits[r] = gate.eos_bits
            else:
                bits[r] = inner[inner_of[r]]
                if phase == OPEN:
                    bits[r] |= gate.start_bits
        return bits

    def __repr__(self) -> str:
        return f"AfterThinkingState({self.compiled!r}, phase={self.phase!r}, committed={self._committed})"
