"""``metasd bench``: experiment files (schema and resolution), prompt sets answered by transformers baselines and by
pool methods, executors (in this process or on Ray workers), MLflow tracking, results tables and plots. Builds on
``metasd.config`` and everything below it.

>>> from metasd.bench import run_experiment
>>> result = run_experiment("experiments/smoke.yaml")
"""
from .experiment import Experiment, load_experiment
from .run import run_experiment
from .runner import ExperimentInterrupted, ExperimentResult, ExperimentRunner

__all__ = ["Experiment", "ExperimentInterrupted", "ExperimentResult", "ExperimentRunner", "load_experiment", "run_experiment"]
