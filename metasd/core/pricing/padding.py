"""A batched verify forward priced at the shape it runs (docs/algorithms.md, "Speculation under load").

Where the scheduler's verify forward runs at fixed shapes (``core/execution/batch_runner.py``: CUDA graphs on a GPU),
a step of B rows x N tokens a row runs - and costs - the (rows, tokens) bucket it pads to: every width that fills a
bucket is free, one node more can double the price. ``padded_tokens`` turns a forward's tokens into its padded
shape's, which the allocator's forward prices read and learn from; ``bucket_grid`` is the acceptance curves' grid of
node budgets that fill a token bucket, so that the widths worth choosing are the ones the curves learn.

A ``Padding`` is the verifier's ``padded(rows, tokens a row) -> (rows, tokens a row)`` (``BatchVerifier.padded``).
Pure Python.
"""
from __future__ import annotations

from typing import Callable

Padding = Callable[[int, int], "tuple[int, int]"]


def padded_tokens(padding: Padding | None, rows: int, tokens: float) -> float:
    """The tokens of the forward ``rows`` rows x ``tokens`` tokens in all (padding to the longest row included) run
    at: the padded shape's rows x tokens a row (``tokens`` as it is without ``padding`` or rows)."""
    if padding is None or rows <= 0:
        return tokens
    per_row = max(1, -(-int(round(tokens)) // rows))  # ceil
    padded_rows, padded_per_row = padding(rows, per_row)
    return padded_rows * padded_per_row


def bucket_grid(padding: Padding, max_width: int) -> tuple[int, ...]:
    """The node budgets w in 1..max_width whose row of 1 + w tokens fills its token bucket, and ``max_width``."""
    fills = {w for w in range(1, max_width + 1) if padding(1, 1 + w)[1] == 1 + w}
    return tuple(sorted(fills | ({max_width} if max_width >= 1 else set())))


__all__ = ["Padding", "bucket_grid", "padded_tokens"]
