"""Figures of an experiment (matplotlib, Agg backend): each function writes one PNG and returns its path.

They take plain Python data (the runner's summaries and per-request records), so they can be redrawn from
the ``requests.jsonl`` artifacts of an MLflow run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup_bars(speedups: Mapping[str, Mapping[str, float]], columns: Sequence[str], path: str | Path,
                 title: str = "") -> Path:
    """Grouped bars: one group per column (category group + overall), one bar per method; line at 1.0."""
    methods = list(speedups)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(columns) * max(1, len(methods)) / 3 + 3), 4.2))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(columns))]
        ys = [speedups[m].get(col, float("nan")) for col in columns]
        ax.bar(xs, ys, width, label=m)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(columns)), columns)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(title or "speedup per category group")
    ax.legend(fontsize=7, ncols=2 if len(methods) > 6 else 1)
    return _save(fig, path)


def drafter_choice(requests: Sequence[Mapping], drafters: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Per request (one panel each), the drafter chosen at each step; marker size = tokens committed."""
    n = max(1, len(requests))
    fig, axes = plt.subplots(n, 1, figsize=(8, 1.2 + 1.3 * n), squeeze=False)
    index = {d: i for i, d in enumerate(drafters)}
    for ax, rec in zip(axes[:, 0], requests):
        arms = [index.get(d, -1) for d in rec.get("drafter_per_step", [])]
        taus = rec.get("tokens_per_step", [])
        ax.scatter(range(len(arms)), arms, s=[8 + 10 * t for t in taus], c=taus, cmap="viridis", vmin=1)
        ax.step(range(len(arms)), arms, where="mid", lw=0.5, color="grey")
        ax.set_yticks(range(len(drafters)), drafters)
        ax.set_ylim(-0.5, len(drafters) - 0.5)
        ax.set_title(f"{rec.get('question_id')} turn {rec.get('turn')} ({rec.get('category')})", fontsize=8)
    axes[-1, 0].set_xlabel("step (marker size and colour: tokens per step, bonus included)")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def cumulative_regret(series: Mapping[str, Sequence[float]], path: str | Path, ylabel: str, title: str = "") -> Path:
    """Cumulative regret per request index, one line per method."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in series.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", ms=3, label=name)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("request")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "cumulative regret vs the best fixed drafter in hindsight")
    ax.legend(fontsize=7)
    return _save(fig, path)


def acceptance_histograms(taus: Mapping[str, Sequence[int]], path: str | Path, title: str = "") -> Path:
    """Share of steps committing tau tokens (tau = accepted drafts + bonus), one panel per method."""
    methods = [m for m, t in taus.items() if t]
    n = max(1, len(methods))
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, m in zip(axes.flat, methods):
        t = list(taus[m])
        top = max(t)
        counts = [t.count(k) / len(t) for k in range(1, top + 1)]
        ax.bar(range(1, top + 1), counts)
        ax.set_xticks(range(1, top + 1))
        ax.set_title(f"{m}\nmean {sum(t) / len(t):.2f} over {len(t)} steps", fontsize=8)
        ax.set_xlabel("tokens per step (bonus included)", fontsize=7)
        ax.set_ylabel("share of steps", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def ratio_by_level(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, highlight: str | None = None,
                   ylabel: str = "ratio", title: str = "") -> Path:
    """One line per method through its (level, ratio) points on a log2 level axis (concurrency), a line at 1.0; the
    ``highlight`` method drawn thick and on top (``benchmarks/serve_regret.py``'s regret plot)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in series.items():
        if not points:
            continue
        xs, ys = zip(*sorted(points))
        thick = name == highlight
        ax.plot(xs, ys, marker="o", ms=5 if thick else 3, lw=2.6 if thick else 1.0, zorder=3 if thick else 2,
                label=name, color="black" if thick else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    levels = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(levels, [str(int(x)) if float(x).is_integer() else str(x) for x in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title or "ratio per level", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)
