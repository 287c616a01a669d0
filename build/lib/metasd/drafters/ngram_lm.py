"""A Witten-Bell interpolated n-gram language model over token ids: the block drafter's ``ngram`` lattice rescoring
(drafters/block.py; docs/algorithms.md#block-drafters-and-lattice-rescoring)."""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Sequence


class NGramLM:
    """Counts of n-grams (orders 1..n) with Witten-Bell interpolation down to a uniform distribution.

    P(x | h) = (c(h, x) + T(h) P(x | h')) / (c(h) + T(h)), h' = h without its oldest token, T(h) = distinct
    continuations of h; an unseen context falls back to h'. ``base`` (e.g. a corpus model) adds its
    counts to this model's (T over the union of continuations).
    """

    def __init__(self, order: int = 3, vocab_size: int = 1, base: "NGramLM | None" = None):
        if order < 1:
            raise ValueError(f"NGramLM: order must be >= 1, got {order}")
        self.order, self.vocab_size, self.base = order, max(int(vocab_size), 1), base
        self.counts: list[dict[tuple, dict[int, int]]] = [defaultdict(dict) for _ in range(order)]
        self.totals: list[dict[tuple, int]] = [defaultdict(int) for _ in range(order)]
        self.tokens: list[int] = []

    def reset(self) -> None:
        for c, t in zip(self.counts, self.totals):
            c.clear()
            t.clear()
        self.tokens = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens and count the n-grams that end on them."""
        seq = self.tokens
        for x in tokens:
            seq.append(int(x))
            j = len(seq) - 1
            for o in range(1, self.order + 1):
                if j - o + 1 < 0:
                    break
                ctx = tuple(seq[j - o + 1:j])
                row = self.counts[o - 1][ctx]
                row[seq[j]] = row.get(seq[j], 0) + 1
                self.totals[o - 1][ctx] += 1

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the counted sequence equal ``tokens`` (append when it extends it, else recount)."""
        n = len(self.tokens)
        if len(tokens) >= n and list(tokens[:n]) == self.tokens:
            self.extend(tokens[n:])
        else:
            self.reset()
            self.extend(tokens)

    def _stats(self, o: int, ctx: tuple, x: int) -> tuple[int, int, int]:
        """(c(ctx, x), c(ctx), T(ctx)) over this model and its base."""
        row = self.counts[o - 1].get(ctx)
        brow = self.base.counts[o - 1].get(ctx) if self.base is not None and o <= self.base.order else None
        if not brow:
            return (row.get(x, 0), self.totals[o - 1][ctx], len(row)) if row else (0, 0, 0)
        b_tot = self.base.totals[o - 1][ctx]
        if not row:
            return brow.get(x, 0), b_tot, len(brow)
        return (row.get(x, 0) + brow.get(x, 0), self.totals[o - 1][ctx] + b_tot,
                len(row.keys() | brow.keys()))

    def logprob(self, history: Sequence[int], x: int) -> float:
        p = 1.0 / self.vocab_size
        hist = tuple(history[len(history) - (self.order - 1):]) if self.order > 1 else ()
        for o in range(1, self.order + 1):
            if o - 1 > len(hist):
                break
            ctx = hist[len(hist) - (o - 1):] if o > 1 else ()
            c, total, types = self._stats(o, ctx, x)
            if total == 0:
                break  # longer contexts containing this one are unseen too
            p = (c + types * p) / (total + types)
        return math.log(p)

    @classmethod
    def from_text_file(cls, path: str | Path, tokenizer, order: int, vocab_size: int) -> "NGramLM":
        """A corpus model: the file's text tokenized (no special tokens), counted once."""
        if tokenizer is None:
            raise ValueError("an n-gram corpus file needs the verifier's tokenizer")
        lm = cls(order, vocab_size)
        lm.extend(tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace"), add_special_tokens=False))
        return lm
