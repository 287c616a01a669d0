"""Traced runs compared at one machine speed: the tokens/s each run of ``benchmarks/step_breakdown.py --trace`` would
have made had the machine run it as fast as the others.

    python benchmarks/trace_speed.py new=/tmp/new_1.jsonl old=/tmp/old_1.jsonl new=/tmp/new_2.jsonl old=/tmp/old_2.jsonl

Why: on a shared 2-core VM the same work took a third longer in one run than in another (BENCHMARKS.md, "The
4-request drop measured again": two rows of 18 tokens 1.74-2.33 s against 1.18-1.32 s; tree 8's identical level
5.03-5.86 tok/s in one hour, 3.47-3.97 in the next) - more than two builds of the allocator differ. The verify
forward is the regular part of a step: its seconds are a function of its shape. So, pooled over every step of every
run (steps with a verify forward: ``verify_s`` from the trace),

    verify_s[step] = speed[run] * (c0 + c1 * forward_tokens + c2 * batch)

fitted by alternating least squares (``speeds``: the shape costs ``c`` by least squares on ``verify_s / speed``, each
run's ``speed`` the median over its steps of ``verify_s / (c0 + c1 T + c2 B)``; speeds normalised to a geometric mean
of 1). A run's **tok/s at common speed** = its tokens over its wall seconds divided by its speed: every part of its
steps (prefill, drafting, verification) rescaled by one factor, its own shapes and acceptance kept. What it removes
is drift between runs; drift inside a run, and decisions a run's timing changed, stay (repeat the runs).

A label may repeat (one per run of a build); the table gives every run, then per label the median [range] of its
runs' tok/s at common speed.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import fmt_mr, median_range  # noqa: E402


@dataclass
class TracedRun:
    """One traced run: its label, tokens committed, wall seconds (the steps' sum) and verify forwards."""

    label: str
    path: str
    tokens: int
    seconds: float
    verify: np.ndarray  # [steps, 3]: verify_s, forward_tokens, batch

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def tok_s_at(self, speed: float) -> float:
        """Its tok/s at the common speed: its seconds divided by ``speed``, its factor from ``speeds``."""
        return self.tok_s * speed


def read_trace(label: str, path: str | Path) -> TracedRun:
    """A step trace (JSON lines of ``step_breakdown.trace_steps``); a ``ValueError`` naming the file where its steps
    have no ``verify_s`` (a trace written without the phase timer) or it has no step with a verify forward."""
    tokens, seconds, verify = 0, 0.0, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            step = json.loads(line)
            tokens += sum(int(r["committed"]) for r in step["requests"])
            seconds += float(step["seconds"])
            if "verify_s" not in step:
                raise ValueError(f"{path}: line {n} has no verify_s (trace written without step_breakdown's timer)")
            if step["forward_tokens"] > 0 and step["verify_s"] > 0:
                verify.append((float(step["verify_s"]), float(step["forward_tokens"]), float(step["batch"])))
    if not verify:
        raise ValueError(f"{path}: no step with a verify forward")
    return TracedRun(label, str(path), tokens, seconds, np.asarray(verify, dtype=np.float64))


def speeds(runs: list[TracedRun], iterations: int = 20) -> tuple[np.ndarray, np.ndarray, float]:
    """([runs] speed factors, geometric mean 1; [3] shape costs c0, c1, c2; the fit's median absolute relative
    residual) - the module docstring's model."""
    s = np.ones(len(runs))
    x = np.concatenate([np.column_stack([np.ones(len(r.verify)), r.verify[:, 1], r.verify[:, 2]]) for r in runs])
    y = np.concatenate([r.verify[:, 0] for r in runs])  # [steps]
    owner = np.concatenate([np.full(len(r.verify), i) for i, r in enumerate(runs)])  # [steps] run index
    for _ in range(iterations):
        c = np.linalg.lstsq(x, y / s[owner], rcond=None)[0]
        shape = np.maximum(x @ c, 1e-9)  # [steps] a step's cost at speed 1
        s = np.array([float(np.median(y[owner == i] / shape[owner == i])) for i in range(len(runs))])
        s = s / float(np.exp(np.mean(np.log(s))))
    residual = float(np.median(np.abs(y / (s[owner] * shape) - 1.0)))
    return s, c, residual


def report(runs: list[TracedRun]) -> str:
    """The markdown tables of the module docstring."""
    s, c, residual = speeds(runs)
    lines = [f"verify seconds = speed x ({c[0]:.3f} + {c[1]:.4f} x forward tokens + {c[2]:.3f} x rows); median "
             f"|relative residual| {residual:.1%}", "",
             "| label | trace | tokens | seconds | tok/s | speed | tok/s at common speed |", "|---|---|---|---|---|---|---|"]
    common: dict[str, list[float]] = {}
    for r, f in zip(runs, s):
        at = r.tok_s_at(f)
        common.setdefault(r.label, []).append(at)
        lines.append(f"| {r.label} | {r.path} | {r.tokens} | {r.seconds:.1f} | {r.tok_s:.2f} | {f:.3f} | {at:.2f} |")
    lines += ["", "| label | runs | tok/s at common speed: median [range] |", "|---|---|---|"]
    for label, xs in common.items():
        lines.append(f"| {label} | {len(xs)} | {fmt_mr(median_range(xs))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=TRACE", help="a label and a step trace (JSON lines)")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"{spec!r}: expected LABEL=TRACE")
        runs.append(read_trace(label, path))
    if len(runs) < 2:
        ap.error("give at least two traced runs to compare")
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
