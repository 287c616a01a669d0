"""Summaries of ``metasd bench`` runs: speedups, regret and the results table, from request records.

Pure functions of the per-request records the runner logs (``metasd.bench.runner``): no MLflow, no torch, so a
experiment can be re-summarized from its ``requests.jsonl`` artifacts.

Speedup (Spec-Bench's ``speed.py``, docs/algorithms.md#speedup): a question's speed is its new tokens over
its wall time summed over its turns (prefill included); a group's speedup = mean question speed of the
method / mean question speed of plain decoding over the same questions (and turns). Mean tokens per step
= committed tokens / steps, bonus token included (plain = 1.00; for transformers baselines a step is one
verifier forward).

Cumulative regret against the best fixed drafter in hindsight (request level, MetaSD's stopping-time
form lifted to wall time). For a policy run pi and each single-drafter run d of the same pool, dataset
and seed, on request r let n_pi(r) be the policy's new tokens, T_x(r) wall seconds and S_x(r) steps.
The cost of d for the policy's work is C_d(r) = n_pi(r) * T_d(r) / n_d(r) (seconds the drafter alone
needs for as many tokens; equal to T_d(r) when both produce the same tokens, as greedy lossless decoding
does). The best fixed drafter in hindsight is d* = argmin_d sum_r C_d(r) over all requests of the run,
and the cumulative regret after request R is sum_{r<=R} (T_pi(r) - C_{d*}(r)) seconds. The steps form
replaces T by S (steps to generate the request's tokens: MetaSD's stopping-time regret), with its own
d*. Negative regret means the policy beat every fixed drafter.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

from metasd.data import GROUP_ORDER

OVERALL = "overall"
#: the per-column figures of ``summarize`` that are logged as MLflow metrics
SUMMARY_METRICS = ("speedup", "median_speedup", "tokens_per_step", "tokens_per_second")


def table_columns(groups: Iterable[str]) -> list[str]:
    present = set(groups)
    return [g for g in GROUP_ORDER if g in present] + sorted(present - set(GROUP_ORDER)) + [OVERALL]


def _units(records: list[dict], plain: dict[tuple[str, int], dict]) -> dict[tuple, dict]:
    """Question units (seed, question) with the method's and plain's totals over their common turns."""
    units: dict[tuple, dict] = {}
    for r in records:
        p = plain.get((r["question_id"], r["turn"]))
        if p is None:
            continue
        u = units.setdefault((r.get("seed"), r["question_id"]), dict(
            group=r["group"], category=r["category"], tokens=0, seconds=0.0, committed=0, steps=0,
            p_tokens=0, p_seconds=0.0))
        u["tokens"] += r["new_tokens"]
        u["seconds"] += r["wall_s"]
        u["committed"] += r["committed"]
        u["steps"] += r["steps"]
        u["p_tokens"] += p["new_tokens"]
        u["p_seconds"] += p["wall_s"]
    return units


def summarize(records: list[dict], plain_records: list[dict], key: str = "group") -> dict[str, dict[str, float]]:
    """Per group (or ``key="category"``) and overall: speedup (ratio of mean speeds, Spec-Bench's), the median
    of per-question speedups (robust to one disturbed request), mean tokens per step, tokens/s, questions."""
    plain = {(p["question_id"], p["turn"]): p for p in plain_records}
    by_col: dict[str, list[dict]] = {}
    for u in _units(records, plain).values():
        if u["seconds"] <= 0 or u["p_seconds"] <= 0:
            continue
        by_col.setdefault(u[key], []).append(u)
        by_col.setdefault(OVERALL, []).append(u)
    out = {}
    for col, us in by_col.items():
        speed = sum(u["tokens"] / u["seconds"] for u in us) / len(us)
        p_speed = sum(u["p_tokens"] / u["p_seconds"] for u in us) / len(us)
        steps = sum(u["steps"] for u in us)
        ratios = sorted((u["tokens"] / u["seconds"]) / (u["p_tokens"] / u["p_seconds"]) for u in us)
        mid = len(ratios) // 2
        median = ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])
        out[col] = dict(speedup=speed / p_speed if p_speed > 0 else float("nan"), median_speedup=median,
                        tokens_per_step=sum(u["committed"] for u in us) / steps if steps else float("nan"),
                        tokens_per_second=speed, questions=len(us))
    return out


def overloaded(records: list[dict], limit: float = 1.0) -> int:
    """Requests that ended while the machine's 1-minute load average exceeded ``limit`` per core."""
    return sum(1 for r in records if r.get("machine_load", 0.0) > limit)


def plain_outliers(plain_records: list[dict], factor: float = 2.0) -> list[str]:
    """Question ids whose plain decoding ran more than ``factor`` times slower (tokens/s) than the median
    plain request: a request disturbed by another process inflates every speedup measured against it."""
    speeds = {}
    for p in plain_records:
        if p["wall_s"] > 0 and p["new_tokens"] > 0:
            speeds.setdefault(str(p["question_id"]), []).append(p["new_tokens"] / p["wall_s"])
    if len(speeds) < 3:
        return []
    per_q = {q: sum(v) / len(v) for q, v in speeds.items()}
    ordered = sorted(per_q.values())
    median = ordered[len(ordered) // 2]
    return sorted(q for q, s in per_q.items() if s * factor < median)


def oracle_records(singles: dict[str, list[dict]], plain_records: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Best single drafter per category in hindsight (highest speedup on that category): its records."""
    best: dict[str, tuple[float, str]] = {}
    for name, recs in singles.items():
        for cat, s in summarize(recs, plain_records, key="category").items():
            if cat != OVERALL and (cat not in best or s["speedup"] > best[cat][0]):
                best[cat] = (s["speedup"], name)
    choice = {cat: name for cat, (_, name) in sorted(best.items())}
    recs = [r for name, rs in singles.items() for r in rs if choice.get(r["category"]) == name]
    return recs, choice


def cumulative_regret(policy: list[dict], singles: dict[str, list[dict]], cost: str = "wall_s") -> tuple[list[float], str | None]:
    """Cumulative regret of a policy run against the best fixed drafter in hindsight (module docstring).

    cost: ``"wall_s"`` (seconds) or ``"steps"``. Requests missing in a single run are left out.
    Returns (cumulative regret per request in the policy's order, the best fixed drafter d*).
    """
    idx = {name: {(r["question_id"], r["turn"]): r for r in rs} for name, rs in singles.items()}
    rows = [r for r in sorted(policy, key=lambda r: r["index"])
            if all((r["question_id"], r["turn"]) in d for d in idx.values())]
    if not rows or not idx:
        return [], None

    def c(name: str, r: dict) -> float:
        s = idx[name][(r["question_id"], r["turn"])]
        return r["new_tokens"] * s[cost] / s["new_tokens"] if s["new_tokens"] else s[cost]

    best = min(idx, key=lambda n: sum(c(n, r) for r in rows))
    out, acc = [], 0.0
    for r in rows:
        acc += r[cost] - c(best, r)
        out.append(acc)
    return out, best


def _fmt_cell(s: dict | None) -> str:
    if not s or not math.isfinite(s["speedup"]):
        return "-"
    return f"{s['speedup']:.2f}x / {s['tokens_per_step']:.2f}"


def results_table(summary: dict[str, Any], title: str = "") -> str:
    """Spec-Bench-shaped Markdown: rows = methods, columns = category groups + overall."""
    cols = summary["columns"]
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += ["Cells: speedup over plain decoding of the verifier on the same requests / mean tokens per step "
              "(bonus token included; plain = 1.00).", ""]
    lines.append("| method | " + " | ".join(cols) + " |")
    lines.append("| --- | " + " | ".join("---:" for _ in cols) + " |")
    for method, per in summary["methods"].items():
        lines.append(f"| {method} | " + " | ".join(_fmt_cell(per.get(c)) for c in cols) + " |")
    plain = summary["methods"].get("plain", {}).get(OVERALL)
    notes = []
    if plain:
        notes.append(f"plain decoding: {plain['tokens_per_second']:.2f} tokens/s over {plain['questions']} questions")
    medians = [f"{m} {per[OVERALL]['median_speedup']:.2f}x" for m, per in summary["methods"].items()
               if m != "plain" and per.get(OVERALL) and math.isfinite(per[OVERALL].get("median_speedup", float("nan")))]
    if medians:
        notes.append("median of per-question speedups, overall: " + ", ".join(medians))
    if summary.get("plain_outliers"):
        notes.append("**plain decoding ran over 2x slower than its median on questions "
                     f"{', '.join(summary['plain_outliers'])}**: their speedups are inflated (another process on the "
                     "machine?); trust the medians, or rerun on an idle machine")
    if summary.get("overloaded"):
        notes.append(f"**{summary['overloaded']} requests ended while the machine's load exceeded its cores** "
                     "(1-minute load average per core > 1): their timings are slowed by other work")
    if summary.get("oracle_choice"):
        notes.append("oracle = best single drafter per Spec-Bench category (finer than the columns' groups) in "
                     "hindsight: " + ", ".join(f"{c}: {n}" for c, n in summary["oracle_choice"].items()))
    notes.append("baselines (plain, assisted, prompt lookup): transformers' generate with metasd's LM-head fix on the "
                 "verifier and the assistant (the strongest baselines; as shipped, assisted generation is slower)")
    notes.append("multi-turn questions: each method answers later turns after its own earlier answers (Spec-Bench)")
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"

