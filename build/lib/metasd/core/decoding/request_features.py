"""Cheap request features for contextual policies (``metasd.policies.LinUCB``).

``request_features(prompt_ids, category, categories)`` returns a float64 vector of length
``3 + len(categories)``:

====== ================================================================================================
index  feature
====== ================================================================================================
0      bias, always 1.0 (LinUCB's ``context=None`` stands for ``[1, 0, ..., 0]``)
1      ``log1p(prompt_len) / 10`` (about 0.7 for a 1,000-token prompt)
2      prompt n-gram self-overlap: the fraction of the prompt's 3-grams (token trigrams at positions
       0..len-3) that already occurred at an earlier position in the prompt; 0.0 for prompts shorter
       than 4 tokens. High for repetitive prompts (code edits, extraction), where copying drafters shine.
3..    one-hot of ``category`` over ``categories`` (in that order); all zeros if ``category`` is None or
       not in ``categories``
====== ================================================================================================

Everything is O(prompt_len) and needs only the token ids, so it can run before the first step.

Per step, a contextual policy reads these followed by ``step_features`` (``3 + len(categories) + 2 + n_arms`` values
in all):

====== ================================================================================================
index  step feature
====== ================================================================================================
0      ``min(longest lookup match / 8, 1)``: the longest suffix of the context a lookup drafter (n-gram, suffix)
       could continue from now (0 without one)
1      a tracked model drafter's probability of its own next token (0 without one)
2..    each arm's recent acceptance (exponential average, weight 0.3, of accepted / drafted depth; starts at 0.5)
====== ================================================================================================

Under a batched scheduler a caller appends ``load_features`` last (``3 + len(categories) + 2 + n_arms + 2`` values):

====== ================================================================================================
index  load feature (bias-free: the request features carry the bias)
====== ================================================================================================
-2     ``log2(1 + running) / 4``: the requests in the batch (0.25 alone, ~1.0 at 15); ``running_from_features``
       inverts it, so a policy can bucket the load exactly (``load_level``, ``policies/per_load.py``)
-1     ``log2(1 + forward_tokens) / 10``: the tokens of the batch's last verifier forward (``B * N`` with padding;
       ~1.0 at 1,023) - the last one, since this step's is not known before its drafts are
====== ================================================================================================

``load_level(running)`` buckets the load: level 0 for 1 request, then 2, 3-4, 5-8, 9-16, 17+ (``LOAD_LEVELS`` are the
buckets' upper bounds).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

NGRAM = 3
N_BASE_FEATURES = 3  # bias, length, overlap


def n_features(categories: Sequence[str]) -> int:
    """Length of the vector ``request_features`` returns for this category list."""
    return N_BASE_FEATURES + len(categories)


def ngram_self_overlap(prompt_ids: Sequence[int] | np.ndarray, n: int = NGRAM) -> float:
    """Fraction of the prompt's ``n``-grams that occur at an earlier position in the prompt."""
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    count = ids.size - n + 1
    if count < 2:
        return 0.0
    bits = 63 // n
    if ids.min() >= 0 and ids.max() < (1 << bits):
        # pack each n-gram into one int64 (exact for ids < 2**21 with n = 3): 1-D unique is ~10x faster
        keys = np.zeros(count, dtype=np.int64)
        for j in range(n):
            keys = (keys << bits) | ids[j : j + count]
        n_unique = np.unique(keys).size
    else:
        grams = np.lib.stride_tricks.sliding_window_view(ids, n)  # (count, n)
        n_unique = np.unique(grams, axis=0).shape[0]
    # every n-gram beyond the first occurrence of its value "occurred earlier"
    return (count - n_unique) / count


def request_features(
    prompt_ids: Sequence[int] | np.ndarray,
    category: str | None,
    categories: Sequence[str],
) -> np.ndarray:
    """Feature vector of one request; layout in the module docstring."""
    categories = list(categories)
    if len(set(categories)) != len(categories):
        raise ValueError(f"request_features: categories must be distinct, got {categories}")
    prompt_len = int(np.asarray(prompt_ids).size)
    out = np.zeros(n_features(categories), dtype=np.float64)
    out[0] = 1.0
    out[1] = math.log1p(prompt_len) / 10.0
    out[2] = ngram_self_overlap(prompt_ids)
    if category is not None and category in categories:
        out[N_BASE_FEATURES + categories.index(category)] = 1.0
    return out


__all__ = ["NGRAM", "N_BASE_FEATURES", "n_features", "ngram_self_overlap", "request_features", "step_features",
           "LOAD_LEVELS", "N_LOAD_FEATURES", "load_features", "load_level", "running_from_features"]


def step_features(longest_match: int, confidence: float, recent_acceptance: Sequence[float]) -> np.ndarray:
    """The per-step part of a contextual policy's features (module docstring): [2 + n_arms] float64."""
    return np.array([min(longest_match / 8.0, 1.0), float(confidence), *recent_acceptance], dtype=np.float64)


#: upper bounds of the load levels: level 0 = 1 running request, 1 = 2, 2 = 3-4, 3 = 5-8, 4 = 9-16, 5 = 17+
LOAD_LEVELS: tuple[int, ...] = (1, 2, 4, 8, 16)
#: how many values ``load_features`` returns
N_LOAD_FEATURES = 2


def load_features(running: int, forward_tokens: int) -> np.ndarray:
    """The load part of a contextual policy's features (module docstring): [2] float64,
    ``[log2(1 + running) / 4, log2(1 + forward_tokens) / 10]``; no bias (the request features carry it)."""
    if isinstance(running, bool) or int(running) != running or running < 0:
        raise ValueError(f"load_features: running must be an integer >= 0, got {running!r}")
    if isinstance(forward_tokens, bool) or int(forward_tokens) != forward_tokens or forward_tokens < 0:
        raise ValueError(f"load_features: forward_tokens must be an integer >= 0, got {forward_tokens!r}")
    return np.array([math.log2(1 + running) / 4.0, math.log2(1 + forward_tokens) / 10.0], dtype=np.float64)


def running_from_features(value: float) -> int:
    """The running-request count ``load_features`` encoded as ``value`` (its first entry): ``round(2**(4 v) - 1)``;
    ``ValueError`` when ``value`` is not such an encoding (off by more than 1e-6 from one)."""
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > 16:
        raise ValueError(f"running_from_features: {value!r} is not log2(1 + running) / 4")
    running = round(2.0 ** (4.0 * value) - 1.0)
    if abs(math.log2(1 + running) / 4.0 - value) > 1e-6:
        raise ValueError(f"running_from_features: {value!r} is not log2(1 + running) / 4 for an integer running "
                         f"(did the caller append load_features last?)")
    return int(running)


def load_level(running: int, levels: Sequence[int] = LOAD_LEVELS) -> int:
    """The load bucket of ``running`` requests: the index of the first bound in ``levels`` (ascending upper bounds)
    that is ``>= running``, else ``len(levels)``. With the default bounds: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3,
    9-16 -> 4, 17+ -> 5 (0 running counts as level 0)."""
    if isinstance(running, bool) or int(running) != running or running < 0:
        raise ValueError(f"load_level: running must be an integer >= 0, got {running!r}")
    for level, bound in enumerate(levels):
        if running <= bound:
            return level
    return len(levels)
