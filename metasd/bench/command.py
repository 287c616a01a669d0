"""``metasd bench``: the command's options and what it runs (imported by ``metasd.cli`` only when the command is
used, so the other commands start without the bench layer)."""
from __future__ import annotations

import sys


def add_bench_parser(subparsers) -> None:
    from metasd.config.tracking import DEFAULT_TRACKING_URI

    p = subparsers.add_parser(
        "bench", help="run an experiment file (policies x rewards x datasets), log to MLflow, print the results table",
        description="Run an experiment YAML (see metasd.bench.experiment), log every request to MLflow and print a "
                    "Spec-Bench-shaped results table. Ctrl-C keeps finished requests; resume with --run-id.")
    p.add_argument("experiment", help="experiment YAML, e.g. experiments/smoke.yaml")
    p.add_argument("--tracking-uri", help=f"MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else {DEFAULT_TRACKING_URI}); "
                                          "with --executor ray only this process writes to it")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--run-id", help="resume this parent run: skip requests already logged")
    g.add_argument("--resume", action="store_true", help="resume the latest parent run of the same experiment config")
    p.add_argument("--limit", type=int, help="at most N questions per dataset (quick tries)")
    p.add_argument("--threads", type=int, help="torch CPU threads (overrides the experiment's 'threads'; with --executor "
                                               "ray: CPUs and threads per worker)")
    p.add_argument("--executor", choices=["inprocess", "ray"],
                   help="where requests are answered (default: the experiment's 'executor', else inprocess); "
                        "ray needs: pip install -e '.[ray]'")
    p.add_argument("--ray-address", help="with --executor ray: 'auto' (the running cluster, e.g. after 'ray start "
                                         "--head') or HOST:PORT (default: start a local Ray on this machine)")
    p.add_argument("--workers", type=int, help="with --executor ray: worker actors, one pool copy each (default: the "
                                               "cluster's CPUs // CPUs per worker)")
    p.add_argument("--gpus-per-worker", type=float, help="with --executor ray: GPUs each worker reserves (Ray's num_gpus; "
                                                         "fractions share a GPU); its pools then run on cuda unless a "
                                                         "pool names its device (default: the experiment's, else none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_bench)


def _bench_executor(args, exp):
    """The experiment's executor with --executor / --ray-address / --workers / --gpus-per-worker applied; ValueError
    naming the flag."""
    from metasd.bench.schema import ExecutorSpec

    d = exp.config.executor.model_dump()
    if args.executor:
        d["type"] = args.executor
    for flag, key in (("ray_address", "address"), ("workers", "workers"), ("gpus_per_worker", "gpus_per_worker")):
        value = getattr(args, flag)
        if value is None:
            continue
        if d["type"] != "ray":
            raise ValueError(f"--{flag.replace('_', '-')} needs --executor ray (or 'executor: ray' in the experiment)")
        if key == "workers" and value < 1:
            raise ValueError("--workers must be >= 1")
        if key == "gpus_per_worker" and value < 0:
            raise ValueError("--gpus-per-worker must be >= 0")
        d[key] = value
    if d["type"] == "inprocess":
        d = {"type": "inprocess", "questions_per_shard": d["questions_per_shard"], "max_retries": d["max_retries"]}
    return ExecutorSpec.model_validate(d)


def _bench(args) -> int:
    from metasd.bench.experiment import load_experiment
    from metasd.bench.run import run_experiment
    from metasd.bench.runner import ExperimentInterrupted
    from metasd.bench.tracking import require_bench_extra

    require_bench_extra()  # MLflow and matplotlib come with the 'bench' extra: say so before anything loads
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be an integer >= 1, got {args.threads}")
    exp = load_experiment(args.experiment, limit=args.limit)  # errors (bad field, missing dataset) before models load
    executor = _bench_executor(args, exp)
    try:
        result = run_experiment(exp, args.tracking_uri, args.run_id, resume=args.resume, progress=not args.no_progress,
                                threads=args.threads, executor=executor)
    except ExperimentInterrupted:
        return 130
    print(result.table)
    print(f"[metasd bench] {result.generated} requests generated, {result.skipped} already logged, "
          f"{result.wall_s:.0f} s; MLflow run {result.parent_run_id} in {result.tracking_uri} "
          f"(browse: mlflow ui --backend-store-uri {result.tracking_uri})", file=sys.stderr)
    return 0
