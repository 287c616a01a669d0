"""Sampling parameters and the logit processing shared by verifier and drafters.

The same processing (temperature, then top-k, then top-p) is applied to verifier logits ``p`` and drafter
logits ``q`` before any acceptance test, so that acceptance compares like with like. Temperature 0 means
greedy: the processed distribution is one-hot on the argmax.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


#: request arguments: (test, allowed values as shown in errors and in ``metasd generate --help``)
REQUEST_LIMITS = {
    "max_new_tokens": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "temperature": (lambda x: _is_real(x) and x >= 0, ">= 0 (0 = greedy)"),
    "top_p": (lambda x: _is_real(x) and 0.0 < x <= 1.0, "in (0, 1]"),
    "top_k": (lambda x: _is_int(x) and x >= 0, ">= 0 (0 = off)"),
    "threads": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
}


def check_request(names: dict[str, str] | None = None, **values) -> None:
    """Check request arguments (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``threads``; None =
    not given) against ``REQUEST_LIMITS`` before any work is done; ``ValueError`` naming every bad one, as
    ``names`` spells it (the CLI: ``--top-p``), with its allowed values. Used by ``SamplingParams`` (so by
    ``Engine.generate`` / ``stream``) and by ``metasd generate`` before it loads any model."""
    names = names or {}
    bad = []
    for key, value in values.items():
        ok, allowed = REQUEST_LIMITS[key]
        if value is not None and not ok(value):
            bad.append(f"{names.get(key, key)} must be {allowed}, got {value!r}")
    if bad:
        raise ValueError("; ".join(bad))


@dataclass(frozen=True)
class SamplingParams:
    """How the verifier's distribution is sampled. ``temperature == 0`` is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        check_request(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> probabilities after temperature, top-k and top-p.

    logits: [..., vocab] (any float dtype); returns float32 probabilities [..., vocab].
    Greedy returns the one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def fit_vocab(q: torch.Tensor, width: int) -> torch.Tensor:
    """Draft probabilities q [..., v] over the first v ids of a vocabulary of ``width`` ids -> [..., width]: zeros for
    the ids past v (a drafter whose q covers only a prefix of the verifier's ids). Wider q is an error."""
    if q.shape[-1] == width:
        return q
    if q.shape[-1] > width:
        raise ValueError(f"draft probabilities cover {q.shape[-1]} token ids, the verifier's vocabulary only {width}")
    return torch.nn.functional.pad(q, (0, width - q.shape[-1]))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from probabilities [..., vocab] -> [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
