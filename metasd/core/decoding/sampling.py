"""Sampling parameters and the logit processing shared by verifier and drafters.

The same processing (temperature, then top-k, then top-p, then min-p - transformers' order) is applied to verifier
logits ``p`` and drafter logits ``q`` before any acceptance test, so that acceptance compares like with like.
Temperature 0 means greedy: the processed distribution is one-hot on the argmax; so does any temperature below
``GREEDY_BELOW`` (1e-5), where dividing the logits would overflow to infinities and NaN probabilities (on CUDA a
device-side assert).
"""
from __future__ import annotations

import numbers
import secrets
from dataclasses import dataclass
from typing import Sequence

import torch


#: temperatures below this act as greedy decoding (the limit of sampling as the temperature goes to 0, without
#: dividing by it)
GREEDY_BELOW = 1e-5


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
    "min_p": (lambda x: _is_real(x) and 0.0 <= x <= 1.0, "in [0, 1] (0 = off)"),
    "threads": (lambda x: _is_int(x) and x >= 1, "an integer >= 1"),
    "min_tokens": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "ignore_eos": (lambda x: isinstance(x, bool), "true or false"),
}


def check_request(names: dict[str, str] | None = None, **values) -> None:
    """Check request arguments (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ...; None =
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
    """How the verifier's distribution is sampled. ``temperature < GREEDY_BELOW`` (0 included) is greedy decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off

    def __post_init__(self):
        check_request(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> probabilities after temperature, top-k, top-p and min-p (transformers' order; vLLM applies min-p
    before top-k and top-p, which differs only where a request sets both min_p and top_p).

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
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        # min-p (Nguyen et al. 2024): drop a token less likely than min_p times the most likely one (which stays);
        # renormalising after top-k / top-p scales every probability alike, so the ratio is the same before and after
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def fresh_seed() -> int:
    """A seed for an unseeded sampled request, from the OS's entropy: ``torch.seed()`` would reseed the caller's global
    torch RNG (and so change every draw their own code makes after the request)."""
    return secrets.randbits(63)


def request_draws(params: SamplingParams, seed: int | None, device: torch.device | str,
                  seeded_sampling: str = "keyed") -> tuple["torch.Generator | None", "KeyedNoise | None"]:
    """A request's own random draws: (None, None) when it is greedy; else its generator (seeded with ``seed``, or
    from the OS's entropy) and, where it is seeded and ``seeded_sampling`` is "keyed", its ``KeyedNoise``."""
    if params.greedy:
        return None, None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else fresh_seed())
    return generator, KeyedNoise(seed, device) if seed is not None and seeded_sampling == "keyed" else None


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


#: how a seeded sampled request draws (``Engine(seeded_sampling=...)``): "keyed" - every token from Gumbel noise keyed
#: by (seed, choice, position), so the verifier alone decides it; "stream" - from the request's own generator
SEEDED_SAMPLING = ("keyed", "stream")

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of SplitMix64 (Steele, Lea & Flood 2014): a 64-bit mix in which every input bit flips each output
    bit with probability ~1/2 - nearby keys (consecutive positions) give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)  # a non-negative int64 for manual_seed


class KeyedNoise:
    """The Gumbel noise a seeded request samples with: for the token at absolute position ``t`` (its index among the
    request's tokens, prompt included) of choice ``c``, ``G_t = -log(-log U)``, ``U ~ Uniform(0, 1)^vocab`` drawn from
    a generator seeded with ``mix(seed, c, t)`` - a pure function of the three, whatever was drafted, verified or run
    beside the request (docs/architecture.md#random-streams). ``argmax(log p + G_t)`` is an exact sample of ``p``
    (the Gumbel-max trick), so a token chosen this way has the verifier's distribution and depends on nothing else.

    A few positions' vectors are kept (``keep``): a step reads the positions of its draft's depths, the next step
    mostly the same ones again."""

    def __init__(self, seed: int, device: torch.device | str = "cpu", choice: int = 0, keep: int = 32):
        self.seed, self.choice, self.device = int(seed), int(choice), torch.device(device)
        self.keep = keep
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        self._generator = torch.Generator(device=self.device)

    def key(self, position: int) -> int:
        return _splitmix64(_splitmix64(_splitmix64(self.seed) ^ self.choice) ^ int(position))

    def gumbel(self, position: int, vocab: int) -> torch.Tensor:
        """G_t: [vocab] float32 on the device."""
        k = (int(position), int(vocab))
        g = self._cache.get(k)
        if g is None:
            self._generator.manual_seed(self.key(position))
            u = torch.rand(vocab, generator=self._generator, device=self.device, dtype=torch.float32)
            g = -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 2 ** -24)))
            if len(self._cache) >= self.keep:
                self._cache.pop(min(self._cache))
            self._cache[k] = g
        return g

    def choose_rows(self, probs: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """``choose`` for every row of ``probs`` [rows, vocab], row r at ``positions[r]``, in one call: [rows] int64
        on the device (the same tokens as row-by-row ``choose``)."""
        noise = torch.stack([self.gumbel(t, probs.shape[-1]) for t in positions])  # [rows, vocab]
        return torch.argmax(torch.log(probs.float()) + noise, dim=-1)

    def choose(self, probs: torch.Tensor, position: int) -> torch.Tensor:
        """The token at ``position`` sampled from ``probs`` [vocab] with this noise: ``argmax(log probs + G_t)`` (a
        0-d int64 tensor on the device; tokens of probability 0 are never chosen)."""
        return torch.argmax(torch.log(probs.float()) + self.gumbel(position, probs.shape[-1]), dim=-1)
