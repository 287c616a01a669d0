"""Compiling a ``Constraint`` for a tokenizer, with llguidance (an optional dependency: ``metasd[structured]``).

Two costs are cached by ``ConstraintCompiler``: converting a Hugging Face tokenizer into llguidance's token trie
(about 2 s for a 150k-token vocabulary, once per tokenizer and set of end-of-sequence ids) and building a grammar's
matcher (1-5 ms per constraint). A ``CompiledConstraint`` then hands out per-request matchers by copying a template
(microseconds); ``ConstraintState`` (``state.py``) wraps one.
"""
from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from .backend import ConstraintError, llguidance_module
from .spec import Constraint
from .state import ConstraintState

def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int in int32's range (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32 if j == 31 else 0)


class CompiledConstraint:
    """A ``Constraint`` compiled for one tokenizer: the grammar, the tokenizer's token trie and a template matcher.

    ``vocab_size``: the ids the grammar knows, ``[0, vocab_size)`` (the tokenizer's); a model whose logits are wider
    gets the extra ids disallowed (``ConstraintState.mask``). ``eos_token_ids``: the tokens that end the text, allowed
    exactly where the text is complete. Immutable and shared between requests; ``new_state()`` gives each request
    its own ``ConstraintState``.
    """

    def __init__(self, spec: Constraint, ll_tokenizer: Any, eos_token_ids: tuple[int, ...],
                 special_ids: tuple[int, ...] | None = None):
        llg = llguidance_module()
        self.spec = spec
        self.grammar = spec.grammar()
        self.eos_token_ids = eos_token_ids
        self.vocab_size = int(ll_tokenizer.vocab_size)
        self.words = (self.vocab_size + 31) // 32  # int32 words of one packed mask row
        self._ll_tokenizer = ll_tokenizer
        template = llg.LLMatcher(ll_tokenizer, self.grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(spec.field_name, f"does not compile to a grammar: {template.get_error().strip()}")
        self._template = template
        self.eos_bits = torch.zeros(self.words, dtype=torch.int32)  # [words]: the end-of-sequence tokens only
        for t in eos_token_ids:
            self.eos_bits[t >> 5] |= _bit(t & 31)
        #: the special tokens other than end-of-sequence (Qwen's ``<tool_call>``, ...): llguidance's mask can allow one
        #: where its text fits the grammar, yet refuses to consume it unless the grammar names it as a token; a mask
        #: keeps such a token only where the matcher would consume it (``ConstraintState._fill``)
        self.special_ids = tuple(t for t in (special_token_ids(ll_tokenizer) if special_ids is None else special_ids)
                                 if t not in eos_token_ids)
        self.new_state().mask_bits()  # the first mask builds lexer states later matchers reuse (ms), paid here once

    def new_matcher(self) -> Any:
        """A fresh llguidance ``LLMatcher`` at the start of the text (a copy of the template)."""
        return self._template.deep_copy()

    def new_state(self) -> ConstraintState:
        """A fresh per-request state: nothing committed yet."""
        return ConstraintState(self)

    def __repr__(self) -> str:
        return (f"CompiledConstraint({self.spec!r}, vocab_size={self.vocab_size}, "
                f"eos_token_ids={list(self.eos_token_ids)})")


def special_token_ids(ll_tokenizer: Any) -> tuple[int, ...]:
    """The ids llguidance treats as special tokens (every added token of a Hugging Face tokenizer)."""
    return tuple(t for t in range(int(ll_tokenizer.vocab_size)) if ll_tokenizer.is_special_token(t))


class _TokenizerEntry:
    """One tokenizer's llguidance trie, its special tokens and its compiled constraints (least recently used
    first)."""

    def __init__(self, tokenizer: Any, ll_tokenizer: Any):
        self.tokenizer = tokenizer  # held, so that its id() is not reused while the entry lives
        self.ll_tokenizer = ll_tokenizer
        self.special_ids = special_token_ids(ll_tokenizer)
        self.compiled: OrderedDict[str, CompiledConstraint] = OrderedDict()


class ConstraintCompiler:
    """Compiles constraints for tokenizers, cached per (tokenizer, end-of-sequence ids, constraint).

    Keeps the ``max_tokenizers`` most recently used tokenizers and, for each, its ``max_grammars`` most recently used
    constraints (requests' schemas are arbitrary, so the cache is bounded). Thread-safe; a tokenizer's first compile
    converts its vocabulary (seconds for a large one) while holding the lock. Tokenizers: Hugging Face fast
    tokenizers (byte-level BPE like Qwen's or GPT-2's, or SentencePiece-style with byte fallback).
    """

    def __init__(self, max_tokenizers: int = 8, max_grammars: int = 256):
        if max_tokenizers < 1 or max_grammars < 1:
            raise ValueError("max_tokenizers and max_grammars must be >= 1")
        self.max_tokenizers = max_tokenizers
        self.max_grammars = max_grammars
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], _TokenizerEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.conversions = 0  # tokenizers converted (cache misses), for tests and logs
        self.compiles = 0  # constraints compiled (cache misses)

    def compile(self, tokenizer: Any, spec: Constraint,
                eos_token_ids: Sequence[int] | None = None) -> CompiledConstraint:
        """``spec`` compiled for ``tokenizer``; ``eos_token_ids``: the tokens that end the generation (default the
        tokenizer's ``eos_token_id``; pass every stop id of the model, e.g. Qwen's ``<|im_end|>`` and
        ``<|endoftext|>``, or the grammar will never allow the others). ConstraintError names the field at fault."""
        if not isinstance(spec, Constraint):
            raise TypeError(f"spec must be a Constraint, got {type(spec).__name__}")
        with self._lock:
            entry, eos = self._entry(tokenizer, eos_token_ids)
            compiled = entry.compiled.get(spec.key)
            if compiled is not None:
                entry.compiled.move_to_end(spec.key)
                return compiled
            compiled = CompiledConstraint(spec, entry.ll_tokenizer, eos, entry.special_ids)
            self.compiles += 1
            entry.compiled[spec.key] = compiled
            while len(entry.compiled) > self.max_grammars:
                entry.compiled.popitem(last=False)
            return compiled

    def clear(self) -> None:
        """Forget every tokenizer and compiled constraint."""
        with self._lock:
            self._entries.clear()

    def _entry(self, tokenizer: Any, eos_token_ids: Sequence[int] | None) -> tuple[_TokenizerEntry, tuple[int, ...]]:
        eos = _eos_ids(tokenizer, eos_token_ids)
        key = (id(tokenizer), eos)
        entry = self._entries.get(key)
        if entry is not None and entry.tokenizer is tokenizer:
            self._entries.move_to_end(key)
            return entry, eos
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
        if size is not None and max(eos) >= size:
            raise ConstraintError("eos_token_ids", f"{[t for t in eos if t >= size]} are outside the tokenizer's "
                                                   f"{size} ids")
        llg = llguidance_module()
        try:
            ll_tokenizer = llg.hf.from_tokenizer(tokenizer, eos_token=list(eos))
        except Exception as e:  # a tokenizer llguidance cannot read (slow, or no decoder it knows)
            raise ConstraintError("tokenizer", f"llguidance cannot use this {type(tokenizer).__name__} "
                                               f"(it needs a fast byte-level or byte-fallback tokenizer): {e}") from e
        bad = [t for t in eos if t >= ll_tokenizer.vocab_size]
        if bad:
            raise ConstraintError("eos_token_ids", f"{bad} are outside the tokenizer's {ll_tokenizer.vocab_size} ids")
        self.conversions += 1
        entry = self._entries[key] = _TokenizerEntry(tokenizer, ll_tokenizer)
        while len(self._entries) > self.max_tokenizers:
            self._entries.popitem(last=False)
        return entry, eos


def _eos_ids(tokenizer: Any, eos_token_ids: Sequence[int] | None) -> tuple[int, ...]:
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ConstraintError("eos_token_ids", "the tokenizer has no eos_token_id: pass the model's stop token ids")
        eos_token_ids = [eos]
    elif isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]
    try:
        ids = [operator.index(t) for t in eos_token_ids if not isinstance(t, bool)]
    except TypeError:
        ids = []
    if not ids or len(ids) != len(eos_token_ids) or min(ids) < 0:
        raise ConstraintError("eos_token_ids", f"must be a non-empty list of token ids >= 0, got {eos_token_ids!r}")
    return tuple(sorted(set(ids)))


#: the process-wide compiler behind ``compile_constraint``
DEFAULT_COMPILER = ConstraintCompiler()


def compile_constraint(tokenizer: Any, spec: Constraint,
                       eos_token_ids: Sequence[int] | None = None) -> CompiledConstraint:
    """``DEFAULT_COMPILER.compile(tokenizer, spec, eos_token_ids)``: cached per (tokenizer, eos ids, spec)."""
    return DEFAULT_COMPILER.compile(tokenizer, spec, eos_token_ids)
