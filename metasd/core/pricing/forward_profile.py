"""A measured cost model of one forward of a model as a function of the tokens it runs over, profiled on the machine
it serves on (docs/algorithms.md#profiled-forward-cost).

``profile_forward`` times forwards of a Hugging Face causal LM over n new tokens after a KV cache of ``context``
tokens, for a few n, and returns a ``ForwardProfile``: the median seconds at each n. ``ForwardProfile.cost(n)``
reads it as a price in units of a one-token forward (one plain decode step), through a monotone piecewise-linear fit,
so that a scheduler can weigh a bigger verify against the tokens it is expected to commit under the load it sees.

"Tokens" of a profile are the *total* tokens of one forward, padding included: the batched verifier
(``metasd.core.execution.batch_verifier``) runs [B, N] (B rows, N = 1 + the longest draft, shorter rows padded), which
is B * N tokens of work whatever the drafts' lengths; ``rows=B`` profiles exactly that shape, [rows, n // rows].

The same function profiles a drafter's model: ``profile_forward(drafter_model, (1, 2, 4, 8))`` prices its forwards in
units of its own one-token forward; ``drafter.seconds_for(n) / verifier.seconds_for(1)`` puts them in the verifier's
units.
"""
from __future__ import annotations

import bisect
import itertools
import math
import numbers
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel

from ..execution.clock import now
from ..execution.kv_cache import cache_kwargs, crop_to
from ..execution.static_cache import StaticKVCache, new_cache

#: A measured time may fall below an earlier (fewer-token) one by noise, but not below this fraction of it: a forward
#: over more tokens that takes less than half the time of one over fewer is a broken measurement (a warm-up that
#: landed in the first timed point, a clock read before the device finished), not noise.
FALL_TOLERANCE = 0.5
#: times a count whose successor took under half its seconds is timed again, at most, while the stall lasts (a stall
#: of ~10 s once outlasted one retime and failed a server's start)
RETIMES = 3

_KEYS = ("tokens", "seconds", "name", "meta")


class ProfileError(ValueError):
    """A nonsense forward profile; the message starts with the field at fault (``"seconds[2]: ..."``)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_counts(counts: Any, field_name: str) -> tuple[int, ...]:
    """Token counts: >= 2 integers >= 1, strictly increasing. Raises ProfileError naming ``field_name``."""
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise ProfileError(f"{field_name}: must be a list of token counts, got {counts!r}")
    for i, t in enumerate(counts):
        if not _is_int(t) or t < 1:
            raise ProfileError(f"{field_name}[{i}]: must be an integer >= 1, got {t!r}")
    counts = tuple(int(t) for t in counts)
    if len(counts) < 2:
        raise ProfileError(f"{field_name}: at least 2 points, got {len(counts)}")
    if any(b <= a for a, b in zip(counts, counts[1:])):
        raise ProfileError(f"{field_name}: must be strictly increasing, got {list(counts)}")
    return counts


@dataclass(frozen=True)
class ForwardProfile:
    """Measured median seconds of one forward over ``tokens[i]`` new tokens (total tokens of the forward, padding
    included: rows * tokens per row) is ``seconds[i]``.

    tokens:  strictly increasing token counts, >= 2 of them, each >= 1
    seconds: finite seconds > 0, one per count; they may dip by noise as tokens grow, never below ``FALL_TOLERANCE``
             of an earlier point
    name:    what was profiled (a model's name), for logs
    meta:    how it was measured: device, dtype, context, rows, repeats, warmup, threads (JSON values)

    Validated on construction (``ProfileError`` naming the field); ``cost(n)`` is the fitted price of a forward over
    n tokens in units of a one-token forward.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    name: str = ""
    meta: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        tokens = _check_counts(self.tokens, "tokens")
        seconds = self.seconds
        if isinstance(seconds, (str, bytes)) or not isinstance(seconds, Sequence):
            raise ProfileError(f"seconds: must be a list of seconds, got {seconds!r}")
        if len(seconds) != len(tokens):
            raise ProfileError(f"seconds: {len(seconds)} values for {len(tokens)} token counts "
                               f"(tokens: {list(tokens)})")
        for i, s in enumerate(seconds):
            if not _is_real(s) or not math.isfinite(s) or s <= 0:
                raise ProfileError(f"seconds[{i}]: must be a finite number > 0, got {s!r}")
        seconds = tuple(float(s) for s in seconds)
        top = 0  # index of the running maximum of seconds[:i]
        for i in range(1, len(seconds)):
            if seconds[i] < FALL_TOLERANCE * seconds[top]:
                raise ProfileError(
                    f"seconds[{i}]: {seconds[i]:.6g} s at {tokens[i]} tokens is less than {FALL_TOLERANCE:g} x "
                    f"{seconds[top]:.6g} s at {tokens[top]} tokens: times fall as tokens grow (a broken measurement, "
                    f"not noise)")
            if seconds[i] > seconds[top]:
                top = i
        if not isinstance(self.name, str):
            raise ProfileError(f"name: must be a string, got {self.name!r}")
        if not isinstance(self.meta, Mapping) or not all(isinstance(k, str) for k in self.meta):
            raise ProfileError(f"meta: must be a dict with string keys, got {self.meta!r}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "meta", dict(self.meta))

    @property
    def fitted_seconds(self) -> tuple[float, ...]:
        """The running maximum of ``seconds`` (m_i = max_{j <= i} s_j): the measured points made non-decreasing, so
        that a dip by noise never makes more tokens look cheaper. Equal to ``seconds`` where they already rise."""
        return tuple(itertools.accumulate(self.seconds, max))

    def seconds_for(self, n: float) -> float:
        """Fitted seconds of a forward over ``n`` tokens: the piecewise-linear interpolation of (tokens_i, m_i), m the
        running maximum (``fitted_seconds``); below the first point m_0; beyond the last, the line through the last
        segment (slope (m_k - m_{k-1}) / (t_k - t_{k-1}) >= 0). Non-decreasing in n."""
        if not _is_real(n) or not math.isfinite(n) or n < 0:
            raise ValueError(f"n: must be a finite number of tokens >= 0, got {n!r}")
        t, m = self.tokens, self.fitted_seconds
        if n <= t[0]:
            return m[0]
        i = bisect.bisect_left(t, n)  # t[i-1] < n <= t[i]; i == len(t): beyond the last point
        if i == len(t):
            slope = (m[-1] - m[-2]) / (t[-1] - t[-2])
            return m[-1] + slope * (n - t[-1])
        slope = (m[i] - m[i - 1]) / (t[i] - t[i - 1])
        # clamped to [m_{i-1}, m_i]: rounding must not lift a point above the next segment's start
        return min(m[i - 1] + slope * (n - t[i - 1]), m[i])

    def cost(self, n: float) -> float:
        """Fitted price of a forward over ``n`` tokens in units of a one-token forward (one plain decode step):
        seconds_for(n) / seconds_for(1), so ``cost(1) == 1`` and plain decoding costs 1.0 per token."""
        return self.seconds_for(n) / self.seconds_for(1)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``json.dumps`` takes it); ``from_dict`` reads it back."""
        return {"name": self.name, "tokens": list(self.tokens), "seconds": list(self.seconds), "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Any) -> "ForwardProfile":
        """The profile ``to_dict`` wrote, validated again: ProfileError naming the missing, unknown or bad key."""
        if not isinstance(d, Mapping):
            raise ProfileError(f"profile: must be a dict with keys {list(_KEYS)}, got {type(d).__name__}")
        for key in d:
            if key not in _KEYS:
                raise ProfileError(f"{key}: unknown key (a profile has {list(_KEYS)})")
        for key in ("tokens", "seconds"):
            if key not in d:
                raise ProfileError(f"{key}: missing")
        return cls(tokens=d["tokens"], seconds=d["seconds"], name=d.get("name", ""), meta=d.get("meta", {}))

    def describe(self) -> str:
        """One line for logs: the name, how it was measured, and each point as ms and cost."""
        how = ", ".join(f"{k} {self.meta[k]}" for k in ("backend", "device", "dtype", "context", "rows")
                       if k in self.meta)
        points = ", ".join(f"{t} tok {s * 1e3:.3g} ms ({self.cost(t):.2f}x)" for t, s in zip(self.tokens, self.seconds))
        notes = "".join(f"; {k} {', '.join(map(str, self.meta[k]))} tok" for k in ("skipped", "retimed", "reduced")
                        if self.meta.get(k))
        return f"forward profile {self.name or '?'}" + (f" ({how})" if how else "") + f": {points}{notes}"


def _check_arg(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _checked_counts(token_counts: Sequence[int], context: int, repeats: int, warmup: int) -> tuple[int, ...]:
    """The arguments every profile takes, checked (ValueError naming the one at fault); the token counts."""
    try:
        counts = _check_counts(token_counts, "token_counts")
    except ProfileError as e:
        raise ValueError(str(e)) from None
    _check_arg(_is_int(context) and context >= 1, f"context: must be an integer >= 1, got {context!r}")
    _check_arg(_is_int(repeats) and repeats >= 1, f"repeats: must be an integer >= 1, got {repeats!r}")
    _check_arg(_is_int(warmup) and warmup >= 0, f"warmup: must be an integer >= 0, got {warmup!r}")
    return counts


@torch.inference_mode()
def profile_forward(model: PreTrainedModel, token_counts: Sequence[int] = (1, 4, 16, 64, 256), *, rows: int = 1,
                    context: int = 256, repeats: int = 3, warmup: int = 1, max_seconds: float | None = 5.0,
                    mask: bool = True, prefill: bool = False, name: str | None = None,
                    seed: int = 0) -> ForwardProfile:
    """Time forwards of ``model`` (a transformers causal LM, on its own device) over n new tokens for each n of
    ``token_counts``, after a KV cache of ``context`` positions per row, and return their median seconds.

    n is the total tokens of the forward, padding included: input ids [rows, n // rows] (``rows`` = B of the batched
    verifier's [B, N]; every n must be a multiple of rows). Every forward computes logits at every position, as a
    verify does; ``mask``: pass an explicit 4-D boolean causal mask and position ids, as the batched verifier does
    (``batch_inputs``), else none, as ``Verifier.verify`` of a chain. After each forward the cache is cropped back to
    ``context``.

    The context's cache: by default random keys and values of the model's cache shape ([rows, kv heads, context,
    head dim] per layer; attention costs the same whatever they hold), which saves a prefill of ``context`` tokens
    (4 s of the 1.5B verifier on one CPU core); ``prefill=True`` runs that prefill instead (one row, repeated across
    rows), for a model whose cache is not one [rows, kv heads, positions, head dim] tensor pair per layer.

    Per n in increasing order: ``warmup`` untimed forwards, then ``repeats`` timed ones, the device synchronised
    before each clock read (``metasd.core.execution.clock.now``); the profile keeps their median. ``max_seconds`` bounds
    the time of these forwards: before a count (from the third on) its forwards are predicted from the line through the
    last two medians; if they would take the profile past the budget, the count is timed once after at most one
    warm-up (``meta["reduced"]``) where that fits, else it and every larger count are skipped (``meta["skipped"]``:
    the fit extrapolates beyond the last measured count, which is linear where forwards are slow, compute-bound).
    A prediction, so the profile may overshoot the budget by one count's forwards (the line through two memory-bound
    points misses the knee: the 1.5B verifier on one CPU core predicts 1.5 s for 16 tokens, which take 4.3 s;
    ``meta["seconds_spent"]`` says what it took). None measures every count.

    The model is left as it was found: its own caches untouched (the profile builds its own), in training mode again
    if it was (it runs in eval mode); the ids and random cache come from a local generator seeded with ``seed``, so
    the global random state is untouched. Raises ValueError naming the argument at fault (rows < 1, n not a multiple
    of rows, a context beyond the model's positions, ...)."""
    _check_arg(_is_int(rows) and rows >= 1, f"rows: must be an integer >= 1, got {rows!r}")
    counts = _checked_counts(token_counts, context, repeats, warmup)
    for i, n in enumerate(counts):
        _check_arg(n % rows == 0, f"token_counts[{i}]: {n} tokens do not split into rows={rows} rows "
                                  f"(a forward runs [rows, n // rows])")
    _check_arg(max_seconds is None or (_is_real(max_seconds) and max_seconds > 0),
               f"max_seconds: must be a number > 0 or None, got {max_seconds!r}")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    longest = context + counts[-1] // rows
    limit = getattr(cfg, "max_position_embeddings", None)
    _check_arg(not limit or longest <= limit,
               f"context: {context} + {counts[-1] // rows} new tokens per row exceed the model's {limit} positions")
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, longest), generator=gen)  # [1, context + max n / rows]

    was_training = model.training
    model.eval()
    try:
        if prefill:
            cache = new_cache(model, longest)
            model(input_ids=ids[:, :context].to(device), **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
            if rows > 1:
                cache.batch_repeat_interleave(rows)  # every row the same context
        else:
            cache = _random_cache(model, cfg, rows, context, gen)
            cache.reserve(longest)  # no timed forward grows the buffers

        def timed(n: int) -> float:
            inputs = _forward_inputs(ids, rows, context, n // rows, mask, device)
            start = now(device)
            model(**inputs, **cache_kwargs(model, cache), use_cache=True)  # logits [rows, n // rows, vocab]
            elapsed = now(device) - start
            crop_to(cache, context)
            return elapsed

        medians, spent, notes = _measure(counts, timed, repeats, warmup, max_seconds, device)
    finally:
        if was_training:
            model.train()
    meta = {"device": str(device), "dtype": str(model.dtype).removeprefix("torch."), "context": context, "rows": rows,
            "repeats": repeats, "warmup": warmup, "mask": mask, "prefill": prefill, "seconds_spent": round(spent, 3),
            **notes}
    if device.type == "cpu":
        meta["threads"] = torch.get_num_threads()
    if name is None:
        name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    return ForwardProfile(tokens=counts[: len(medians)], seconds=tuple(medians), name=name, meta=meta)


def _measure(counts: Sequence[int], timed: Callable[[int], float], repeats: int, warmup: int,
             max_seconds: float | None, device: torch.device) -> tuple[list[float], float, dict[str, list[int]]]:
    """``profile_forward``'s loop over the counts: per n, ``warmup`` untimed then ``repeats`` timed calls of
    ``timed(n)`` (seconds); counts predicted to take the profile past ``max_seconds`` skipped. A count whose median
    breaks the profile's shape against the count before it, m - dearer per token than m (``s(n) / n > s(m) / m``: a
    bigger forward amortizes its fixed cost, so only a stall of the machine makes it dearer per token) or under half
    m's seconds (then m is timed again, up to ``RETIMES`` times while that lasts) - is timed once more, the lower
    median kept: one stall while profiling
    (one seen on this VM: 16 tokens at 6.4x one token's seconds, where every other start measured 1.0-1.1x) would
    price every wide draft of the server's life. A count whose ``warmup + repeats`` forwards are predicted past the
    budget is timed once, after at most one warm-up, where that fits (``reduced``): one measured point prices its
    width better than the line through two narrower ones (a 5-s profile of the 1.5B on a 2-core CPU with AMX timed 1, 4
    and 16 tokens, flat, and priced 64 and 256 along that flat line where they cost 1.7x and 3.4x). (medians, seconds
    spent, notes: the non-empty of ``skipped``, ``retimed`` - counts timed again - and ``reduced``, and the seconds of
    the first warm-up forward, ``first_forward_s``, which the budget does not charge: a process's first forward pays
    its one-off set-up - 2.1-5.9 s for the 1.5B on a CPU with AMX with its weights out of the page cache, after which
    a 5-s budget timed 1 and 4 tokens only)."""
    spent, medians, skipped, retimed, reduced = 0.0, [], [], [], []

    def median_of(n: int, warmups: int, timings: int) -> float:
        nonlocal spent
        t0 = now(device)
        for _ in range(warmups):
            timed(n)
        out = statistics.median(timed(n) for _ in range(timings))
        spent += now(device) - t0
        return out

    calls = {n: (warmup, repeats) for n in counts}  # per count: its untimed and timed forwards
    if warmup:  # the first warm-up, uncharged: the process's first forward pays one-off set-up (kernels, buffers)
        t0 = now(device)
        timed(counts[0])
        first = now(device) - t0
        calls[counts[0]] = (warmup - 1, repeats)
    for k, n in enumerate(counts):
        if max_seconds is not None and k >= 2:
            (n0, s0), (n1, s1) = zip(counts[k - 2: k], medians[k - 2: k])
            predicted = s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (n - n1)  # the line through the last two points
            if spent + predicted * (warmup + repeats) > max_seconds:
                once = (min(warmup, 1), 1)  # once, after at most one warm-up: a measured point beats the line
                if spent + predicted * sum(once) > max_seconds:
                    skipped = list(counts[k:])
                    break
                calls[n] = once
                reduced.append(n)
        medians.append(median_of(n, *calls[n]))
        if k == 0:
            continue
        m = counts[k - 1]
        if medians[k] / n > medians[k - 1] / m:  # this count stalled
            retimed.append(n)
            medians[k] = min(medians[k], median_of(n, *calls[n]))
        else:  # the count before it stalled: timed again while it does (else the profile is rejected as broken)
            for _ in range(RETIMES):
                if medians[k] >= medians[k - 1] / 2:
                    break
                if m not in retimed:
                    retimed.append(m)
                medians[k - 1] = min(medians[k - 1], median_of(m, *calls[m]))
    notes = {"skipped": skipped, "retimed": retimed, "reduced": reduced}
    if warmup:
        notes["first_forward_s"] = round(first, 3)
    return medians, spent, {k: v for k, v in notes.items() if v}


def profile_llama_cpp(verifier, token_counts: Sequence[int] = (1, 4, 16, 64, 256), *, context: int = 256,
                      repeats: int = 3, warmup: int = 1, max_seconds: float | None = 5.0,
                      seed: int = 0) -> ForwardProfile:
    """``profile_forward`` for a ``LlamaCppVerifier``: the median seconds of its forwards over n new tokens (one
    ``llama_decode``, logits at every position, ``LlamaCppVerifier.timed_forward``) after a prefill of ``context``
    random tokens; the verifier's cache is empty afterwards. Arguments as ``profile_forward``'s."""
    counts = _checked_counts(token_counts, context, repeats, warmup)
    _check_arg(context + counts[-1] <= verifier.context_length and counts[-1] <= verifier.batch_tokens,
               f"token_counts: {counts[-1]} tokens after a context of {context} exceed the llama.cpp context "
               f"({verifier.context_length} positions, {verifier.batch_tokens} a forward)")
    gen = torch.Generator().manual_seed(seed)
    verifier.prefill(torch.randint(0, verifier.vocab_size, (context,), generator=gen))
    try:
        medians, spent, notes = _measure(counts, verifier.timed_forward, repeats, warmup, max_seconds,
                                         torch.device("cpu"))
    finally:
        verifier.reset()
    meta = {"device": "cpu", "backend": "llama.cpp", "gguf": verifier.gguf.name, "context": context, "rows": 1,
            "repeats": repeats, "warmup": warmup, "threads": verifier.threads, "seconds_spent": round(spent, 3),
            **notes}
    return ForwardProfile(tokens=counts[: len(medians)], seconds=tuple(medians), name=verifier.name, meta=meta)


def _random_cache(model: PreTrainedModel, cfg: Any, rows: int, context: int, gen: torch.Generator) -> StaticKVCache:
    """A cache of ``context`` positions per row holding random keys and values: per layer [rows, kv heads, context,
    head dim] in the model's dtype, on its device (the shapes a prefill would leave in a full-attention decoder)."""
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    cache = new_cache(model, context + 1)
    for layer in range(int(cfg.num_hidden_layers)):
        k, v = (torch.randn(rows, kv_heads, context, head_dim, generator=gen).to(model.device, model.dtype)
                for _ in range(2))  # [rows, kv_heads, context, head_dim]
        cache.update(k, v, layer)
    return cache


def _forward_inputs(ids: torch.Tensor, rows: int, context: int, per_row: int, mask: bool,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Keyword inputs of one timed forward: ids [rows, per_row] (the tokens after the context, the same in every row)
    and, with ``mask``, position ids [rows, per_row] and the causal 4-D mask [rows, 1, per_row, context + per_row]
    that ``batch_inputs`` builds for a chain (each query sees the context, the new tokens before it and itself)."""
    new = ids[:, context: context + per_row].expand(rows, per_row)  # [rows, per_row]
    out = {"input_ids": new.contiguous().to(device)}
    if mask:
        pos = (context + torch.arange(per_row)).expand(rows, per_row)  # [rows, per_row]
        causal = torch.ones(per_row, per_row, dtype=torch.bool).tril()  # [per_row, per_row]
        seen = torch.ones(per_row, context, dtype=torch.bool)  # [per_row, context]
        full = torch.cat([seen, causal], dim=1)  # [per_row, context + per_row]
        out["position_ids"] = pos.contiguous().to(device)
        out["attention_mask"] = full[None, None].expand(rows, 1, per_row, context + per_row).contiguous().to(device)
    return out
