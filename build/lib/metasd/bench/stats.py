"""Statistics of repeated timing runs: what a benchmark may call faster, slower or within noise.

Pure functions over the rows the benchmark scripts write (``benchmarks/speed.py``, ``benchmarks/cross_tokenizer.py``):
a row is one (prompt, repeat) ``{"question_id", "group", "repeat", "methods": {name: {"tokens", "seconds", ...}}}``
(``repeat`` missing = 0, as in results written before repeats existed; an entry with ``"error"`` is a failed run and
is never counted).

- ``rotation``: the order of methods for one (prompt, repeat): the list rotated by prompt index + repeat, so that over
  consecutive prompts every method takes every position (drift of the machine favours none).
- ``ratios``: per repeat, a method's overall tokens/s (sum of tokens / sum of seconds over the prompts) divided by
  the reference's over the same prompts in the same repeat.
- ``prompt_geomean``: per prompt the median over repeats of the paired ratio of two methods, geometric mean over
  the prompts (every prompt weighs the same, however long its output).
- ``median_range``: the median over repeats and the [min, max] of those per-repeat ratios.
- ``verdict``: "faster" / "slower" only where two methods' ranges of per-repeat ratios do not overlap, else
  "within noise" (no verdict from a single repeat).
- ``outliers``: (method, prompt, repeat) runs whose seconds exceed ``factor`` x that (method, prompt)'s median over the
  repeats that produced the same number of tokens.
"""
from __future__ import annotations

import statistics
from typing import Iterable, Sequence

FASTER, SLOWER, NOISE = "faster", "slower", "within noise"
ONE_REPEAT = "no verdict (1 repeat)"  # one run per method says nothing about its noise


def rotation(names: Sequence[str], offset: int) -> list[str]:
    """``names`` rotated left by ``offset`` (modulo its length): the timing order of one (prompt, repeat)."""
    names = list(names)
    if not names:
        return names
    k = offset % len(names)
    return names[k:] + names[:k]


def repeats(rows: Iterable[dict]) -> list[int]:
    """The repeat indices present in ``rows``, sorted."""
    return sorted({r.get("repeat", 0) for r in rows})


def _ok(row: dict, name: str) -> bool:
    e = row["methods"].get(name)
    return e is not None and "error" not in e and e.get("seconds", 0) > 0


def rate(rows: Iterable[dict], name: str) -> float | None:
    """Overall tokens/s of ``name`` over ``rows``: sum of tokens / sum of seconds (None without a finished run)."""
    entries = [r["methods"][name] for r in rows if _ok(r, name)]
    if not entries:
        return None
    return sum(e["tokens"] for e in entries) / sum(e["seconds"] for e in entries)


def rates(rows: list[dict], name: str, group: str | None = None) -> dict[int, float]:
    """repeat -> overall tokens/s of ``name`` in that repeat (only the rows of ``group`` if given)."""
    out = {}
    for rep in repeats(rows):
        rs = [r for r in rows if r.get("repeat", 0) == rep and (group is None or r["group"] == group)]
        x = rate(rs, name)
        if x is not None:
            out[rep] = x
    return out


def ratios(rows: list[dict], name: str, reference: str, group: str | None = None) -> list[float]:
    """Per repeat: ``name``'s overall tokens/s / ``reference``'s, over the prompts both finished in that repeat."""
    out = []
    for rep in repeats(rows):
        rs = [r for r in rows if r.get("repeat", 0) == rep and (group is None or r["group"] == group)
              and _ok(r, name) and _ok(r, reference)]
        if rs:
            out.append(rate(rs, name) / rate(rs, reference))
    return out


def prompt_geomean(rows: list[dict], name: str, reference: str) -> tuple[float, list[float]] | None:
    """``name`` against ``reference`` prompt by prompt: per prompt the median over repeats of the paired ratio
    (tokens/s of ``name`` / ``reference``'s on the same prompt in the same repeat), then the geometric mean of those
    medians over the prompts; with it, per repeat the geometric mean over the prompts of that repeat's ratios (the
    range). None where no prompt has both."""
    per_prompt: dict[str, dict[int, float]] = {}
    for r in rows:
        if _ok(r, name) and _ok(r, reference):
            a, b = r["methods"][name], r["methods"][reference]
            ratio = (a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
            per_prompt.setdefault(r["question_id"], {})[r.get("repeat", 0)] = ratio
    if not per_prompt:
        return None
    overall = statistics.geometric_mean([statistics.median(by_rep.values()) for by_rep in per_prompt.values()])
    reps = sorted({rep for by_rep in per_prompt.values() for rep in by_rep})
    per_repeat = [statistics.geometric_mean([by_rep[rep] for by_rep in per_prompt.values() if rep in by_rep])
                  for rep in reps]
    return overall, per_repeat


def median_range(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values`` (non-empty)."""
    if not values:
        raise ValueError("median_range of no values")
    return statistics.median(values), min(values), max(values)


def fmt_median_range(values: Sequence[float], suffix: str = "x") -> str:
    """``1.23x [1.10, 1.30]`` (one value: no range; none: ``-``)."""
    if not values:
        return "-"
    med, lo, hi = median_range(values)
    if len(values) == 1:
        return f"{med:.2f}{suffix}"
    return f"{med:.2f}{suffix} [{lo:.2f}, {hi:.2f}]"


def verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """Method A against method B from their per-repeat ratios (to the same reference): "faster" where A's range lies
    wholly above B's, "slower" wholly below, else "within noise" (touching ranges overlap); with a single repeat of
    either, ``ONE_REPEAT``: a range needs two runs."""
    if not a or not b:
        raise ValueError("verdict needs per-repeat ratios of both methods")
    if len(a) < 2 or len(b) < 2:
        return ONE_REPEAT
    if min(a) > max(b):
        return FASTER
    if max(a) < min(b):
        return SLOWER
    return NOISE


def outliers(rows: list[dict], factor: float = 1.5) -> list[dict]:
    """Runs slower than ``factor`` x the median seconds of the same (method, prompt) over the repeats that produced
    the same number of tokens: ``{"method", "question_id", "category", "group", "repeat", "tokens", "seconds",
    "median_s"}``, in row order. A (method, prompt, token count) seen in one repeat only is never flagged."""
    runs: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        for name, e in r["methods"].items():
            if "error" not in e and "seconds" in e:
                runs.setdefault((name, r["question_id"], e["tokens"]), []).append(e["seconds"])
    out = []
    for r in rows:
        for name, e in r["methods"].items():
            if "error" in e or "seconds" not in e:
                continue
            same = runs[(name, r["question_id"], e["tokens"])]
            med = statistics.median(same)
            if len(same) > 1 and e["seconds"] > factor * med:
                out.append({"method": name, "question_id": r["question_id"], "category": r.get("category"),
                            "group": r.get("group"), "repeat": r.get("repeat", 0), "tokens": e["tokens"],
                            "seconds": e["seconds"], "median_s": med})
    return out
