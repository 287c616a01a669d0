"""MLflow side of ``metasd bench``: the tracking URI, parameters, and the parent and nested runs of an experiment.

``BenchStore`` opens (or resumes) one invocation's MLflow experiment and parent run and ends the runs;
``NestedRun`` is one nested run with its request records, rewritten as the ``requests.jsonl`` artifact after
every request (a resumed invocation reads them back). What is logged where is the runner's choice
(``metasd.bench.runner``, whose docstring describes the layout); this module only writes it.

Faults it survives (``tests/test_faults.py``):

- a process killed at any point (SIGKILL): ``requests.jsonl`` is the commit point of a request (MLflow
  publishes artifacts atomically), its per-request metrics are journaled in ``request_metrics.jsonl`` before it
  and logged after it, and a resumed run re-logs the metrics of committed requests that lack them
  (``NestedRun._relog_missing_metrics``), so every request ends up with one record and one set of metrics;
- several ``metasd bench`` processes writing to one SQLite store: creating / migrating the database and
  finding-or-creating the MLflow experiment happen under a file lock beside the database, and every MLflow
  call is retried, boundedly and with backoff, while SQLite says ``database is locked`` (both in
  ``metasd.bench.store_guard``); each starts its own parent run, and a ``--resume`` / ``--run-id`` of a parent run
  that another live process is writing is refused (``RunInUseError``, ``BenchStore._claim``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .experiment import Experiment, ResolvedPool

from metasd.config.tracking import artifact_location, require_extra

from .store_guard import (LOCKED_RETRIES, OWNER_TAG, RetryingClient, RunInUseError, StoreBusyError,  # noqa: F401
                          call_with_retry, owner_alive, owner_token, store_lock)

logger = logging.getLogger(__name__)

#: tag set on a parent run once its params and config files are logged (a resume completes them otherwise)
PARAMS_TAG = "metasd.params_logged"
REQUESTS_ARTIFACT = "requests.jsonl"
#: per-request metrics as logged, one JSON line per request, uploaded before the record (see the module docstring)
METRICS_ARTIFACT = "request_metrics.jsonl"
_MAX_PARAM_LEN = 6000


# ------------------------------------------------------------------------------------------ parameters


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """A resolved experiment (nested dicts and lists) -> ``{"a.b": value}`` MLflow parameters.

    Not ``metasd.training.common.flatten`` (a trainer's config: dicts of scalars), on purpose: a resolved
    experiment nests lists of dicts (pools, drafters, methods), so here those are expanded by index
    (``drafters.0.name``), an empty dict is kept as ``"{}"``, other values are JSON (``null``, ``true``,
    ``[1, 2]``; the trainers' is Python's ``str``: ``None``, ``True``) and nothing is cut here
    (``mlflow_params`` cuts at 6000 characters, the trainers' at 500). One copy for both would change the
    values one of them logs, so both stay.
    """
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        if not obj and prefix:
            out[prefix] = "{}"
        for k, v in obj.items():
            out.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten_params(v, f"{prefix}.{i}"))
    else:
        value = obj if isinstance(obj, str) else json.dumps(obj, default=str)
        out[prefix] = value
    return out


_KEY_BAD = re.compile(r"[^\w\-. /:]")


def metric_key(s: str) -> str:
    """A param or metric name MLflow accepts: other characters become ``_``, at most 250 characters."""
    return _KEY_BAD.sub("_", s)[:250]


def require_bench_extra(what: str = "metasd bench") -> None:
    """``MissingExtraError`` naming the ``bench`` extra unless MLflow and matplotlib (its logging and figures) are
    installed: checked before an experiment loads any model."""
    require_extra("bench", what, "mlflow", "matplotlib")


def mlflow_params(d: dict[str, Any]) -> list:
    from mlflow.entities import Param

    return [Param(metric_key(k), v if len(v) <= _MAX_PARAM_LEN else v[: _MAX_PARAM_LEN - 3] + "...") for k, v in d.items()]


def package_versions() -> dict[str, str]:
    import mlflow
    import torch
    import transformers

    from metasd import __version__

    return {"version.metasd": __version__, "version.torch": torch.__version__,
            "version.transformers": transformers.__version__, "version.mlflow": mlflow.__version__,
            "version.python": sys.version.split()[0]}


def git_params() -> dict[str, str]:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return {}
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return {"git.commit": commit.stdout.strip(), "git.dirty": str(bool(dirty.stdout.strip()))}
    except (OSError, subprocess.SubprocessError):
        return {}


def model_params(pool: ResolvedPool) -> dict[str, str]:
    """The pool's model references, with the sha256 of bundled ones."""
    from metasd.models.bundled import BUNDLED, BUNDLED_PREFIX

    refs = {"verifier": pool.config.verifier.model}
    refs.update({d.name: d.model for d in pool.config.drafters if d.model})
    out = {}
    for who, ref in refs.items():
        out[f"model.{pool.name}.{who}"] = ref
        if ref.startswith(BUNDLED_PREFIX) and ref[len(BUNDLED_PREFIX):] in BUNDLED:
            out[f"model.{pool.name}.{who}.sha256"] = str(BUNDLED[ref[len(BUNDLED_PREFIX):]].sha256)
    return out


# ---------------------------------------------------------------------------------------------- runs


class BenchStore:
    """One invocation's MLflow experiment, parent run and nested runs (``NestedRun``), new or resumed."""

    def __init__(self, tracking_uri: str):
        from mlflow import MlflowClient

        from mlflow.exceptions import MlflowException

        self.uri = tracking_uri
        try:
            with store_lock(tracking_uri):  # opening a new store creates / migrates its tables
                self.client = RetryingClient(MlflowClient(tracking_uri), tracking_uri)
                self.client.search_experiments(max_results=1)
        except MlflowException as e:  # a store MLflow cannot open: the user's --tracking-uri, named
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"--tracking-uri {tracking_uri}: MLflow cannot open this store: {first}") from None
        self.records: dict[str, list[dict]] = {}  # nested-run key -> request records
        self.run_ids: dict[str, str] = {}  # nested-run key -> MLflow run id
        self.active: set[NestedRun] = set()  # nested runs not finished yet (ended as KILLED on Ctrl-C)

    def open(self, exp: Experiment, config_hash: str, workdir: Path, resume_run_id: str | None, resume: bool) -> None:
        """Find or create the MLflow experiment, then resume the parent run (``resume_run_id``, or with
        ``resume`` the latest one of the same config) or start one and log its params and config files."""
        self.workdir = workdir
        with store_lock(self.uri):  # two processes starting the same experiment: one creates it
            found_exp = self.client.get_experiment_by_name(exp.name)
            if found_exp is None:
                self.experiment_id = self.client.create_experiment(
                    exp.name, artifact_location=artifact_location(self.uri, exp.name))
            else:
                self.experiment_id = found_exp.experiment_id
        parent = None
        if resume and not resume_run_id:
            found = self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.`metasd.config_hash` = '{config_hash}' and tags.`metasd.kind` = 'experiment'",
                order_by=["attributes.start_time DESC"], max_results=1)
            parent = found[0] if found else None
            if parent is None:
                print(f"[metasd bench] nothing to resume for {exp.name!r} (config {config_hash}): starting a new run",
                      file=sys.stderr)
        elif resume_run_id:
            from mlflow.exceptions import MlflowException

            try:
                parent = self.client.get_run(resume_run_id)
            except MlflowException as e:
                raise ValueError(f"no MLflow run {resume_run_id!r} in {self.uri}: {e}") from None
            if parent.info.experiment_id != self.experiment_id:
                raise ValueError(f"run {resume_run_id} belongs to another MLflow experiment, not {exp.name!r}")
            old = parent.data.tags.get("metasd.config_hash")
            if old != config_hash:
                raise ValueError(f"run {resume_run_id} was started from a different experiment config (hash {old}, now "
                                 f"{config_hash}); start a new run instead of resuming")
        self.resumed = parent is not None
        if parent is None:
            run = self.client.create_run(self.experiment_id, run_name=f"{exp.name} {time.strftime('%Y-%m-%d %H:%M')}",
                                         tags={"metasd.kind": "experiment", "metasd.config_hash": config_hash,
                                               "metasd.experiment_file": exp.source, OWNER_TAG: owner_token()})
            self.parent_id = run.info.run_id
            self._log_parent_params(exp)
        else:
            self.parent_id = parent.info.run_id
            self._claim(parent.info.run_id)
            self.client.update_run(self.parent_id, status="RUNNING")
            if parent.data.tags.get(PARAMS_TAG) != "1":  # killed between creating the run and logging its params
                self._log_parent_params(exp, present=parent.data.params)
        children = self.client.search_runs([self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self.parent_id}'",
                                           max_results=50000)
        self.children = {r.data.tags["metasd.key"]: r for r in children if "metasd.key" in r.data.tags}

    def _claim(self, run_id: str) -> None:
        """Record this process as the writer of a resumed parent run, refusing one that another live process
        on this host is writing (two writers would generate and log the same requests twice). A writer killed
        with SIGKILL leaves its token behind; its process is gone, so the run is claimed."""
        with store_lock(self.uri):  # two resumers at once: one claims, the other sees the claim
            run = self.client.get_run(run_id)
            owner = run.data.tags.get(OWNER_TAG, "")
            if run.info.status == "RUNNING" and owner and owner_alive(owner):
                raise RunInUseError(
                    f"MLflow run {run_id} in {self.uri} is being written by another metasd bench process "
                    f"(host:pid {owner.rsplit(':', 1)[0]}); wait for it to end, or run without --resume / --run-id "
                    f"to start a new run")
            self.client.set_tag(run_id, OWNER_TAG, owner_token())

    def _log_parent_params(self, exp: Experiment, present: dict[str, str] | None = None) -> None:
        """Params and config files of the parent run, then the ``PARAMS_TAG`` that says they are complete.
        ``present``: params a killed earlier invocation already logged (MLflow params cannot change, so only
        the missing ones are added)."""
        params = flatten_params(exp.resolved_dict())
        for pool in exp.pools:
            params.update(model_params(pool))
        params.update(package_versions())
        params.update(git_params())
        batch = [p for p in mlflow_params(params) if p.key not in (present or {})]
        for i in range(0, len(batch), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.parent_id, params=batch[i:i + 100])
        d = self.workdir
        (d / "resolved_config.json").write_text(json.dumps(exp.resolved_dict(), indent=1, default=str))
        self.client.log_artifact(self.parent_id, str(d / "resolved_config.json"), "config")
        if Path(exp.source).is_file():
            self.client.log_artifact(self.parent_id, exp.source, "config")
        self.client.set_tag(self.parent_id, PARAMS_TAG, "1")

    def load_records(self, run_id: str, artifact: str = REQUESTS_ARTIFACT) -> list[dict]:
        """The JSON lines of a run's ``artifact`` (``[]`` when no request of the run has finished yet)."""
        from mlflow.artifacts import download_artifacts
        from mlflow.exceptions import MlflowException

        quiet = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
        try:
            local = call_with_retry(self.uri, "download_artifacts", download_artifacts, run_id=run_id, artifact_path=artifact,
                                    dst_path=str(self.workdir / "dl" / run_id), tracking_uri=self.uri)
        except (MlflowException, OSError):  # no request finished in that run yet
            return []
        finally:
            if quiet is None:
                os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
            else:
                os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = quiet
        with open(local) as f:
            return [json.loads(line) for line in f if line.strip()]

    def log_metrics(self, run_id: str, metrics: dict[str, float | None], step: int = 0) -> None:
        """One batch at ``step``; names through ``metric_key``, None and non-finite values left out."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(metric_key(k), float(v), ts, step)
                                               for k, v in _finite(metrics).items()])

    def log_series(self, run_id: str, key: str, steps: list[int], values: list[float]) -> None:
        """One metric over many steps, in one batch."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(key, v, ts, i) for i, v in zip(steps, values)])

    def stop(self, status: str) -> None:
        """End every unfinished nested run and the parent run with ``status`` (KILLED, FAILED)."""
        for nested in list(self.active):
            nested.end(status)
        self.client.set_terminated(self.parent_id, status)


def _finite(metrics: dict[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


class NestedRun:
    """One nested MLflow run and its request records (the JSONL is rewritten as an artifact per request).

    Each request is written in three steps, so that a process killed between any two leaves a state that a
    resumed run completes without loss or duplicates: (1) its metrics are journaled in ``request_metrics.jsonl``,
    (2) its record is appended to ``requests.jsonl`` - the commit point: a resumed run skips exactly the
    requests found there -, (3) its metrics are logged. A resumed run drops journal lines of uncommitted requests
    (they are generated again) and logs the journaled metrics of committed requests that lack them.
    """

    def __init__(self, store: BenchStore, key: str, method: str, name: str, kind: str, params: dict[str, str],
                 drafters: list[str]):
        self.store, self.key, self.method, self.kind, self.drafters = store, key, method, kind, drafters
        client = store.client
        existing = store.children.get(key)
        self.records: list[dict] = []
        self.journal: dict[tuple, dict] = {}  # (question_id, turn) -> {"index", "metrics"} as logged
        if existing is not None:
            self.run_id = existing.info.run_id
            self.records = store.load_records(self.run_id)
            self.finished = existing.info.status == "FINISHED"
            committed = {(r["question_id"], r["turn"]) for r in self.records}
            self.journal = {(m["question_id"], m["turn"]): m for m in store.load_records(self.run_id, METRICS_ARTIFACT)
                            if (m["question_id"], m["turn"]) in committed}
        else:
            run = client.create_run(store.experiment_id, run_name=name, tags={
                "mlflow.parentRunId": store.parent_id, "metasd.key": key, "metasd.kind": kind, "metasd.method": method,
                "metasd.pool": params.get("pool", ""), "metasd.dataset": params.get("dataset", ""),
                "metasd.seed": params.get("seed", "")})
            self.run_id = run.info.run_id
            client.log_batch(self.run_id, params=mlflow_params(params))
            self.finished = False
        if not self.finished:
            store.active.add(self)
        self.done = {(r["question_id"], r["turn"]): r for r in self.records}
        self.path = store.workdir / f"{len(store.run_ids)}" / REQUESTS_ARTIFACT
        self.metrics_path = self.path.with_name(METRICS_ARTIFACT)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        store.run_ids[key] = self.run_id
        store.records[key] = self.records
        if existing is not None and self.journal:
            self._relog_missing_metrics()

    def _write(self) -> None:
        with open(self.path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")

    def _write_journal(self) -> None:
        with open(self.metrics_path, "w") as f:
            for m in self.journal.values():
                f.write(json.dumps(m) + "\n")

    def _relog_missing_metrics(self) -> None:
        """Log the journaled metrics of committed requests whose metrics never reached the store (the process
        was killed between committing the record and logging them). One metric history read per probe key."""
        steps: dict[str, set[int]] = {}
        relogged = 0
        for r in self.records:
            entry = self.journal.get((r["question_id"], r["turn"]))
            metrics = _finite(entry["metrics"]) if entry else {}
            if not metrics:
                continue
            probe = metric_key(next(iter(metrics)))
            if probe not in steps:
                steps[probe] = {m.step for m in self.store.client.get_metric_history(self.run_id, probe)}
            if entry["index"] not in steps[probe]:
                self.store.log_metrics(self.run_id, metrics, entry["index"])
                relogged += 1
        if relogged:
            logger.warning("%s: logged the metrics of %d request(s) whose process was killed before logging them",
                           self.key, relogged)

    def start(self) -> None:
        self.store.client.update_run(self.run_id, status="RUNNING")
        self.store.active.add(self)

    def add(self, rec: dict, metrics: dict[str, float | None]) -> None:
        """Append a request record, rewrite the artifact and log its metrics at step = request index."""
        qkey = (rec["question_id"], rec["turn"])
        self.journal[qkey] = {"question_id": rec["question_id"], "turn": rec["turn"], "index": rec["index"],
                              "metrics": _finite(metrics)}
        self._write_journal()
        self.store.client.log_artifact(self.run_id, str(self.metrics_path))  # (1) journal
        self.records.append(rec)
        self.done[qkey] = rec
        self._write()
        self.store.client.log_artifact(self.run_id, str(self.path))  # (2) commit
        self.store.log_metrics(self.run_id, metrics, rec["index"])  # (3)

    def log_json(self, obj: Any, name: str) -> None:
        p = self.path.parent / name
        p.write_text(json.dumps(obj, indent=1, default=str))
        self.store.client.log_artifact(self.run_id, str(p))

    def end(self, status: str = "FINISHED") -> None:
        self.store.client.set_terminated(self.run_id, status)
        self.finished = status == "FINISHED"
        self.store.active.discard(self)
