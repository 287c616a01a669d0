"""Regret of an adaptive serving configuration against the best fixed configuration in hindsight, per concurrency
level, from a ``benchmarks/serve_load.py`` result - printed as tables and, with ``--mlflow``, logged to MLflow.

    python benchmarks/serve_regret.py benchmarks/results/serve_load_run2.json --candidate adaptive \\
        --fixed metasd-off metasd chain2 chain4 tree8 tree16 --reference transformers --mlflow sqlite:///mlflow.db

What it computes from the rows' output tok/s (one value per server, level and repeat; repeats are interleaved, so
repeat r of two servers ran close in time and their ratio is paired):

- per level c, each server's **median over repeats**; the **best fixed configuration in hindsight** best(c) is the
  fixed one with the highest median at that level;
- the candidate's **ratio to best(c)**: median [min-max] of the per-repeat ratios candidate_r / best(c)_r, and its
  verdict by the ranges of the two servers' values ("faster" / "slower" only where they do not overlap); regret(c) =
  1 - the median ratio (negative: the candidate beat every fixed configuration at that level);
- the **best single fixed configuration**: the one whose geometric mean over levels of median / best(c) median is
  highest (the configuration one would pick without adapting), and the candidate's geometric mean of its per-level
  ratios to that configuration;
- per level, the candidate against ``--reference`` (``transformers serve --continuous-batching``).

``--mlflow URI`` logs one parent run (parameters: the result's command and arguments; metrics: the regret and ratios
per level with step = concurrency, the geometric means; artifacts: the regret plot, the tables, the result JSON) and
one nested run per server (median, min and max tok/s per level, step = concurrency).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import _by, fmt_mr, median_range, paired_ratio  # noqa: E402

KEY = "output_tok_s"


@dataclass
class LevelRegret:
    """One concurrency level: the best fixed configuration in hindsight and the candidate against it."""

    concurrency: int
    medians: dict[str, float]  # server -> median output tok/s over repeats
    best: str  # the fixed configuration with the highest median
    ratio: tuple[float, float, float] | None  # candidate / best per repeat: (median, min, max)
    verdict: str  # the candidate's values against best's, by their ranges
    reference_ratio: tuple[float, float, float] | None = None  # candidate / reference per repeat
    reference_verdict: str = "-"

    @property
    def regret(self) -> float | None:
        """1 - the candidate's median ratio to the best fixed configuration (0: as good; < 0: better)."""
        return None if self.ratio is None else 1.0 - self.ratio[0]


@dataclass
class RegretReport:
    """``hindsight``'s result: per level, and over all levels."""

    candidate: str
    fixed: list[str]
    reference: str | None
    levels: list[LevelRegret]
    best_single: str | None = None  # the fixed configuration with the best geometric mean of per-level ratios
    single_geomeans: dict[str, float] = field(default_factory=dict)  # fixed config -> geomean of median / best median
    candidate_geomean_vs_single: float | None = None  # geomean over levels of candidate median / best_single median
    candidate_geomean_vs_best: float | None = None  # geomean over levels of candidate median / best(c) median


def _values(rows, server: str, c: int) -> dict[int, float]:
    """{repeat: output tok/s} of (server, c), repeats without a value left out."""
    return {k: v for k, v in _by(rows, server, c, KEY).items() if v is not None}


def _geomean(xs: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs and all(x > 0 for x in xs) else None


def hindsight(rows: list[dict], candidate: str, fixed: list[str], reference: str | None = None) -> RegretReport:
    """The candidate against the best fixed configuration in hindsight at every level where the candidate and at
    least one fixed configuration have values (see the module docstring)."""
    if candidate in fixed:
        raise ValueError(f"the candidate {candidate!r} is also among the fixed configurations")
    present = {r["server"] for r in rows}
    missing = [s for s in [candidate, *fixed] if s not in present]
    if missing:
        raise ValueError(f"no rows for server(s) {missing}; the result has {sorted(present)}")
    levels = []
    for c in sorted({r["concurrency"] for r in rows}):
        medians = {}
        for s in [candidate, *fixed] + ([reference] if reference else []):
            mr = median_range(_values(rows, s, c).values())
            if mr is not None:
                medians[s] = mr[0]
        fixed_here = [s for s in fixed if s in medians]
        if candidate not in medians or not fixed_here:
            continue
        best = max(fixed_here, key=lambda s: medians[s])
        ratio, v = paired_ratio(rows, candidate, c, best, c, KEY)
        level = LevelRegret(c, medians, best, ratio, v)
        if reference and reference in medians:
            level.reference_ratio, level.reference_verdict = paired_ratio(rows, candidate, c, reference, c, KEY)
        levels.append(level)
    report = RegretReport(candidate, list(fixed), reference, levels)
    complete = [lv for lv in levels if all(s in lv.medians for s in fixed)]
    for s in fixed:
        g = _geomean([lv.medians[s] / lv.medians[lv.best] for lv in complete])
        if g is not None:
            report.single_geomeans[s] = g
    if report.single_geomeans:
        report.best_single = max(report.single_geomeans, key=report.single_geomeans.get)
        report.candidate_geomean_vs_single = _geomean(
            [lv.medians[candidate] / lv.medians[report.best_single] for lv in complete])
        report.candidate_geomean_vs_best = _geomean([lv.medians[candidate] / lv.medians[lv.best] for lv in complete])
    return report


def tables(report: RegretReport) -> str:
    """Markdown: per level the medians, best(c), the candidate's ratio and regret; then the geometric means."""
    servers = [report.candidate, *report.fixed] + ([report.reference] if report.reference else [])
    head = ("| c | " + " | ".join(servers) + f" | best fixed | {report.candidate} / best [range] | regret |"
            + (f" {report.candidate} / {report.reference} [range] |" if report.reference else ""))
    lines = [head, "|---" * (len(servers) + 4 + bool(report.reference)) + "|"]
    for lv in report.levels:
        cells = [f"{lv.medians[s]:.2f}" if s in lv.medians else "-" for s in servers]
        row = (f"| {lv.concurrency} | " + " | ".join(cells) + f" | {lv.best} | {fmt_mr(lv.ratio)}x {lv.verdict} | "
               + (f"{lv.regret:+.1%}" if lv.regret is not None else "-") + " |")
        if report.reference:
            row += f" {fmt_mr(lv.reference_ratio)}x {lv.reference_verdict} |" if lv.reference_ratio else " - |"
        lines.append(row)
    lines += ["", "| fixed configuration | geometric mean over levels of its median / the level's best |", "|---|---|"]
    lines += [f"| {s}{' (best single)' if s == report.best_single else ''} | {g:.3f} |"
              for s, g in sorted(report.single_geomeans.items(), key=lambda kv: -kv[1])]
    if report.candidate_geomean_vs_single is not None:
        lines += ["", f"{report.candidate}: geometric mean over levels of its median / {report.best_single}'s "
                      f"{report.candidate_geomean_vs_single:.3f}; / each level's best fixed "
                      f"{report.candidate_geomean_vs_best:.3f}"]
    return "\n".join(lines)


def arm_shares(rows: list[dict], server: str) -> dict[int, dict[str, float]]:
    """Per level, the share of the server's steps each arm took, over all repeats (from each completion's ``metasd``
    record: its ``selection_counts``); levels whose records name no arm are left out."""
    out = {}
    for c in sorted({r["concurrency"] for r in rows if r["server"] == server}):
        counts: dict[str, int] = {}
        for r in rows:
            if r["server"] == server and r["concurrency"] == c:
                for q in r.get("requests", []):
                    for arm, n in ((q.get("metasd") or {}).get("selection_counts") or {}).items():
                        counts[arm] = counts.get(arm, 0) + n
        total = sum(counts.values())
        if total:
            out[c] = {arm: n / total for arm, n in sorted(counts.items())}
    return out


def arm_table(rows: list[dict], server: str) -> str:
    """Markdown: the arms' shares of the server's steps per level (``arm_shares``); empty when no record names one."""
    shares = arm_shares(rows, server)
    arms = sorted({a for s in shares.values() for a in s})
    if not arms:
        return ""
    lines = ["| c | " + " | ".join(f"{server}: {a}" for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
    lines += [f"| {c} | " + " | ".join(f"{s.get(a, 0.0):.0%}" for a in arms) + " |" for c, s in shares.items()]
    return "\n".join(lines)


def regret_plot(report: RegretReport, path: str | Path) -> Path:
    """Every configuration's median tok/s as a share of the level's best fixed configuration, per concurrency (the
    best in hindsight is the line at 1.0; the candidate's distance below it is its regret)."""
    from metasd.bench.plots import ratio_by_level

    series = {s: [(lv.concurrency, lv.medians[s] / lv.medians[lv.best]) for lv in report.levels if s in lv.medians]
              for s in [report.candidate, *report.fixed] + ([report.reference] if report.reference else [])}
    return ratio_by_level(series, path, highlight=report.candidate,
                          ylabel="median output tok/s / best fixed configuration at that level",
                          title=f"{report.candidate} against the best fixed configuration in hindsight")


def log_mlflow(report: RegretReport, result: dict, result_path: Path, tracking_uri: str, experiment: str,
               workdir: Path) -> str:
    """Log the report to MLflow (module docstring); returns the parent run's id."""
    import mlflow

    from metasd.bench.tracking import flatten_params, mlflow_params
    from metasd.config.tracking import artifact_location

    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        experiment, artifact_location=artifact_location(tracking_uri, experiment))
    parent = client.create_run(exp_id, run_name=f"{result_path.stem}: {report.candidate} regret",
                               tags={"metasd.kind": "serve_load_regret", "metasd.result": str(result_path)})
    pid = parent.info.run_id
    params = flatten_params({"command": result.get("command"), "date": result.get("date"),
                             "machine": result.get("machine"), "args": result.get("args"),
                             "candidate": report.candidate, "fixed": report.fixed, "reference": report.reference})
    client.log_batch(pid, params=mlflow_params(params))
    for lv in report.levels:
        step = lv.concurrency
        if lv.ratio is not None:
            client.log_metric(pid, "regret_vs_best_fixed", lv.regret, step=step)
            client.log_metric(pid, "ratio_vs_best_fixed", lv.ratio[0], step=step)
            client.log_metric(pid, "ratio_vs_best_fixed_min", lv.ratio[1], step=step)
            client.log_metric(pid, "ratio_vs_best_fixed_max", lv.ratio[2], step=step)
        if lv.reference_ratio is not None:
            client.log_metric(pid, "ratio_vs_reference", lv.reference_ratio[0], step=step)
    if report.candidate_geomean_vs_single is not None:
        client.log_metric(pid, "geomean_ratio_vs_best_single", report.candidate_geomean_vs_single)
        client.log_metric(pid, "geomean_ratio_vs_best_fixed", report.candidate_geomean_vs_best)
    for s, g in report.single_geomeans.items():
        client.log_metric(pid, f"single_geomean.{s}", g)
    client.set_tag(pid, "best_single", report.best_single or "-")
    rows = result["rows"]
    for s in [report.candidate, *report.fixed] + ([report.reference] if report.reference else []):
        child = client.create_run(exp_id, run_name=s, tags={"mlflow.parentRunId": pid, "metasd.server": s})
        cid = child.info.run_id
        for c in sorted({r["concurrency"] for r in rows if r["server"] == s}):
            mr = median_range(_values(rows, s, c).values())
            if mr is not None:
                for name, v in zip(("tok_s_median", "tok_s_min", "tok_s_max"), mr):
                    client.log_metric(cid, name, v, step=c)
        client.set_terminated(cid)
    workdir.mkdir(parents=True, exist_ok=True)
    plot = regret_plot(report, workdir / "regret_by_concurrency.png")
    table = workdir / "regret_tables.md"
    table.write_text(tables(report) + "\n")
    for path in (plot, table, result_path):
        client.log_artifact(pid, str(path))
    client.set_terminated(pid)
    return pid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a serve_load.py result JSON")
    p.add_argument("--candidate", required=True, help="the adaptive configuration's server name")
    p.add_argument("--fixed", nargs="+", required=True, help="the fixed configurations' server names")
    p.add_argument("--reference", help="also compare the candidate with this server (transformers)")
    p.add_argument("--mlflow", metavar="URI", help="log to this MLflow tracking URI (e.g. sqlite:///mlflow.db)")
    p.add_argument("--experiment", default="serve_load", help="MLflow experiment name")
    p.add_argument("--workdir", type=Path, default=Path("serve_regret_artifacts"),
                   help="where the plot and tables are written before they are logged")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.result.is_file():
        raise SystemExit(f"error: result file {args.result} does not exist")
    result = json.loads(args.result.read_text())
    try:
        report = hindsight(result["rows"], args.candidate, args.fixed, args.reference)
    except ValueError as e:
        raise SystemExit(f"error: {args.result}: {e}") from None
    print(tables(report))
    arms = arm_table(result["rows"], args.candidate)
    if arms:
        print("\n" + arms)
    if args.mlflow:
        from metasd.config.tracking import resolve_tracking_uri

        pid = log_mlflow(report, result, args.result, resolve_tracking_uri(args.mlflow), args.experiment, args.workdir)
        print(f"\nlogged to {args.mlflow}, experiment {args.experiment!r}, run {pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
