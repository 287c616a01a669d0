"""vLLM's ``bad_words``: words a request never generates, each banned as the token sequences it encodes to.

A word is tokenised twice, as vLLM does - as it is written (leading spaces dropped) and after one space (how a
byte-level tokenizer spells it inside a sentence) - keeping the spaced form where it starts with another token but
has as many. A sequence ``w_1 .. w_L`` is banned by masking ``w_L`` at every position whose last ``L - 1`` generated
tokens are ``w_1 .. w_{L-1}`` (a one-token word: at every position). Only generated tokens count as that prefix, not
the prompt's (vLLM's rule).

Under speculation each row of the verifier's logits is masked by its own context - the committed tokens, then the
draft node's ancestors - as the other processing is (processing.py), so the output is plain decoding's with the same
words banned.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .vocab_row import VocabRow

#: the most bad words one request may name (vLLM's ``MAX_NUM_BAD_WORDS``)
MAX_BAD_WORDS = 128


def bad_word_sequences(words: Sequence[str] | None, tokenizer, model: str = "the verifier") -> list[tuple[int, ...]]:
    """The token sequences ``words`` ban (module docstring), without repeats; ``ValueError`` naming ``bad_words`` for
    a value that is not a list of non-empty strings, more than ``MAX_BAD_WORDS`` words, or no tokenizer."""
    if not words:
        return []
    if isinstance(words, (str, bytes)) or not isinstance(words, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {type(words).__name__}")
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(words)}")
    if tokenizer is None:
        raise ValueError(f"bad_words: {model} has no tokenizer to encode them with")
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words[{i}] must be a non-empty string, got {word!r}")
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return list(dict.fromkeys(s for s in out if s))


class BadWords:
    """One request's banned sequences and the generated tokens their prefixes are matched against; ``apply`` masks a
    draft's rows, ``commit`` records the tokens a step committed."""

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.single = sorted({s[0] for s in sequences if len(s) == 1})  # banned at every position
        self.multi = [(s[:-1], s[-1]) for s in sequences if len(s) > 1]  # (prefix, last token)
        self.width = max((len(prefix) for prefix, _ in self.multi), default=0)  # generated tokens a prefix may span
        self.recent: list[int] = []  # the last ``width`` generated tokens
        self._single_row = VocabRow(dict.fromkeys(self.single, True), False, torch.bool)

    def apply(self, logits: torch.Tensor, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """logits: [rows, vocab], row r after the committed tokens then ``paths[r]`` (a draft's rows: ``Draft.paths``);
        the rows with every token that would complete a banned sequence there at -inf (a new tensor where anything
        is masked). Ids past the rows' width (a drafter's narrower vocabulary) are never drawn there: left out."""
        width = logits.shape[-1]
        if self.single:
            logits = logits.float().masked_fill(self._single_row.like(logits), float("-inf"))  # [rows, vocab]
        if self.multi:
            banned = []
            for r, path in enumerate(paths):
                context = (self.recent + list(path))[-self.width:]  # the last generated tokens before row r
                banned += [(r, last) for prefix, last in self.multi if last < width and len(context) >= len(prefix)
                           and tuple(context[len(context) - len(prefix):]) == prefix]
            if banned:
                rows, columns = zip(*banned)
                logits = logits.float().clone()
                logits[torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device)] = \
                    float("-inf")
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        if self.width:
            self.recent = (self.recent + [int(t) for t in tokens])[-self.width:]
