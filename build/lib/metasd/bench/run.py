"""``metasd bench``'s entry point: validate an experiment, then answer it with the executor it names - in this process
(``ExperimentRunner``) or on Ray workers (``RayRunner``) - logging to MLflow the same way."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .experiment import Experiment, load_experiment
from .ray_executor import RayRunner, import_ray
from .runner import ExperimentResult, ExperimentRunner
from .schema import ExecutorSpec, ExperimentConfig
from metasd.config.tracking import resolve_tracking_uri


def run_experiment(path_or_config: str | Path | dict | ExperimentConfig | Experiment, tracking_uri: str | None = None,
                   resume_run_id: str | None = None, *, resume: bool = False, limit: int | None = None,
                   progress: bool = True, threads: int | None = None, executor: ExecutorSpec | str | dict | None = None,
                   worker_setup: Callable[[], None] | None = None) -> ExperimentResult:
    """Run an experiment and log it to MLflow; return ids, the results table and the request records.

    tracking_uri: see ``resolve_tracking_uri``. resume_run_id: continue that parent run, skipping
    requests already logged; ``resume=True``: continue the latest parent run of the same config.
    limit: at most that many questions per dataset. Ctrl-C raises ``ExperimentInterrupted`` (a
    ``KeyboardInterrupt``) after ending the runs as KILLED; its ``run_id`` resumes.
    executor: ``inprocess`` / ``ray`` / an ``ExecutorSpec`` (default: the experiment's ``executor``);
    worker_setup: called once in each Ray worker as it starts (tests inject faults with it).
    The experiment is validated, and its datasets read, before any model is loaded.
    """
    exp = path_or_config if isinstance(path_or_config, Experiment) else load_experiment(path_or_config, limit=limit)
    uri = resolve_tracking_uri(tracking_uri)
    spec = exp.config.executor if executor is None else ExecutorSpec.model_validate(executor)
    if spec.type == "ray":
        import_ray()  # a missing extra fails here, before any MLflow run is opened
        if threads and spec.cpus_per_worker is None:  # --threads: each worker's CPUs and torch threads
            spec = spec.model_copy(update={"cpus_per_worker": threads})
        return RayRunner(exp, uri, resume_run_id, resume, progress, threads, spec=spec, setup=worker_setup).run()
    return ExperimentRunner(exp, uri, resume_run_id, resume, progress, threads).run()
