"""The schema of experiment files (YAML): which pools, which policy runs, which prompts, which baselines.

An experiment compares ways of choosing drafters on the same requests. Example (``experiments/smoke.yaml``)::

    name: smoke
    pool: default                    # the embedded pool; or a pool YAML path; or an inline pool mapping
    datasets: [builtin]              # metasd/data/prompts.jsonl; or JSONL paths (Spec-Bench or {"prompt": ...})
    questions_per_group: 1
    max_new_tokens: 32
    runs:
      - policy: {name: ucb, params: {c: 1.0}}
        reward: throughput
        granularity: step
      - single: true                 # every drafter of the pool alone
      - oracle: true                 # best single drafter per category, in hindsight (computed, not run)
    baselines: [plain]               # transformers greedy decoding of the verifier: the speedup denominator

Top-level fields (all optional but ``runs``):

- ``name``: MLflow experiment name (default: the file name without extension); ``description``.
- ``pool`` / ``pools``: one pool, or a list of ``{name, config}``; ``config`` is ``default`` (the embedded
  pool), a pool YAML path (relative to the experiment file) or an inline pool mapping (metasd.config).
- ``runs``: a list of entries of three kinds:
    * policy run ``{name?, policy: {name, params}, reward?, granularity?, feedback?, persistent?, drafters?}``;
      unset fields take the pool's values; ``drafters`` restricts the arms; the policy's seed is the
      experiment seed;
    * ``{single: true, drafters?}``: one run per drafter of the pool, alone (method ``single:<name>``);
    * ``{oracle: true}``: per category the best single drafter in hindsight (needs a ``single`` entry).
- ``datasets``: list of ``builtin`` | ``copy_heavy`` (prompts whose answers copy their input: generated from this
  Python's standard library, ``questions_per_group`` per category, metasd.data.copy_heavy) | a path | ``{name?, path,
  categories?, groups?, questions_per_group?, turns?}``; ``categories``, ``groups``, ``questions_per_group`` and
  ``turns`` (``all`` | ``first``) may also be set at top level as defaults for every dataset.
- ``max_new_tokens`` (128), ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``min_p``, ``seeds`` ([0]).
- ``baselines``: ``plain`` (required: the speedup denominator), ``{type: assisted, drafter: NAME,
  params?}`` (transformers assisted generation with that pool drafter's model), ``prompt_lookup``.
  Baselines decode greedily, with metasd's LM-head fix on the verifier and the assistant (the strongest baselines).
- ``order``: ``interleaved`` (default: request r of every baseline and method, then request r + 1, so
  load drift on a shared machine hits all methods alike; the order of the runs rotates by one per request, so
  plain and the other baselines take every position like the methods) or ``sequential`` (all requests of one method,
  then the next, as Spec-Bench does).
- ``executor``: where requests are answered - ``inprocess`` (default: this process) or ``ray`` /
  ``{type: ray, address?, workers?, cpus_per_worker?, gpus_per_worker?, questions_per_shard?, max_retries?}`` (Ray
  actors, ``metasd.bench.ray_executor``; ``pip install -e '.[ray]'``; ``gpus_per_worker``, fractions allowed as Ray
  allows them: each worker reserves that share of a GPU and builds its pools on it). Not part of the config hash: an
  experiment started in-process can be resumed on Ray and back. ``metasd bench --executor/--ray-address/--workers/
  --gpus-per-worker`` override it.
- ``threads`` (torch CPU threads; default: torch's), ``warmup`` (true: one short untimed generation
  per drafter and baseline before timing), ``plots`` (true).

``load_experiment`` validates the file and everything that can be checked without loading a model -
pool files, policy names and parameters, drafter names, dataset files and their questions - and raises
``metasd.config.ConfigError`` naming the file and the field path (``runs.2.policy.params``).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from metasd.core.decoding.rewards import RewardName

BUILTIN = "builtin"
COPY_HEAVY = "copy_heavy"  # generated from this Python's standard library (metasd.data.copy_heavy)
Reward = RewardName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolSpec(_Strict):
    name: str | None = None
    config: str | dict[str, Any] = "default"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"config": v}
        if isinstance(v, dict) and "verifier" in v:  # an inline pool without the {name, config} wrapper
            return {"config": v}
        return v


class RunPolicy(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class RunSpec(_Strict):
    name: str | None = None
    single: bool = False
    oracle: bool = False
    policy: RunPolicy | None = None
    reward: Reward | None = None
    granularity: Literal["step", "request"] | None = None
    feedback: Literal["bandit", "full"] | None = None
    persistent: bool | None = None
    drafters: list[str] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "RunSpec":
        if self.single and self.oracle:
            raise ValueError("an entry is either 'single: true' or 'oracle: true', not both")
        if self.single or self.oracle:
            kind = "single" if self.single else "oracle"
            extra = [f for f in ("policy", "reward", "granularity", "feedback", "persistent") if getattr(self, f) is not None]
            if self.oracle and self.drafters is not None:
                extra.append("drafters")
            if extra:
                raise ValueError(f"a '{kind}: true' entry takes no {extra}")
        elif self.policy is None:
            raise ValueError("a run entry needs 'policy: {name, params}' (or 'single: true' / 'oracle: true')")
        return self


class DatasetSpec(_Strict):
    name: str | None = None
    path: str
    categories: list[str] | None = None
    groups: list[str] | None = None
    questions_per_group: int | None = Field(None, ge=1)
    turns: Literal["all", "first"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"path": v} if isinstance(v, str) else v


class _TypeShorthand(_Strict):
    """A spec that may be written as its ``type`` alone (``plain`` for ``{type: plain}``)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"type": v} if isinstance(v, str) else v


class BaselineSpec(_TypeShorthand):
    type: Literal["plain", "assisted", "prompt_lookup"]
    name: str | None = None
    drafter: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _drafter_needed(self) -> "BaselineSpec":
        if self.type == "assisted" and not self.drafter:
            raise ValueError("an assisted baseline needs 'drafter': the name of a pretrained drafter of the pool")
        if self.type != "assisted" and self.drafter:
            raise ValueError(f"a {self.type} baseline takes no drafter")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"assisted:{self.drafter}" if self.type == "assisted" else self.type


class ExecutorSpec(_TypeShorthand):
    """Where an experiment's requests are answered: ``inprocess`` (default) or ``ray`` (``metasd.bench.ray_executor``)."""

    type: Literal["inprocess", "ray"] = "inprocess"
    address: str | None = None  # ray: None = start a local Ray; "auto" = the running cluster; or HOST:PORT
    workers: int | None = Field(None, ge=1)  # ray: actors (default: cluster CPUs // cpus_per_worker)
    cpus_per_worker: int | None = Field(None, ge=1)  # ray: CPUs per actor = its torch threads
    gpus_per_worker: float | None = Field(None, ge=0)  # ray: GPUs per actor (its pools on cuda); None/0: none
    questions_per_shard: int = Field(1, ge=1)  # ray: questions (all their turns, every method) per task
    max_retries: int = Field(2, ge=0)  # ray: times a shard whose worker died is retried on a fresh one

    @model_validator(mode="after")
    def _ray_fields(self) -> "ExecutorSpec":
        if self.type == "inprocess":
            extra = [f for f in ("address", "workers", "cpus_per_worker", "gpus_per_worker") if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{extra} apply to the ray executor only (set 'type: ray')")
        g = self.gpus_per_worker
        if g is not None and abs(g * 10_000 - round(g * 10_000)) > 1e-6:  # Ray's own limit on fractional resources
            raise ValueError(f"gpus_per_worker: {g} is finer than Ray's resource precision of 0.0001")
        return self


class ExperimentConfig(_Strict):
    name: str | None = None
    description: str = ""
    pools: list[PoolSpec] = Field(default_factory=lambda: [PoolSpec()])
    runs: list[RunSpec] = Field(min_length=1)
    datasets: list[DatasetSpec] = Field(default_factory=lambda: [DatasetSpec(path=BUILTIN)])
    categories: list[str] | None = None
    groups: list[str] | None = None
    questions_per_group: int | None = Field(None, ge=1)
    turns: Literal["all", "first"] = "all"
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    baselines: list[BaselineSpec] = Field(default_factory=lambda: [BaselineSpec(type="plain")])
    threads: int | None = Field(None, ge=1)
    order: Literal["interleaved", "sequential"] = "interleaved"
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)
    warmup: bool = True
    plots: bool = True

    @model_validator(mode="before")
    @classmethod
    def _pool_shorthand(cls, v: Any) -> Any:
        if isinstance(v, dict) and "pool" in v:
            if "pools" in v:
                raise ValueError("give either 'pool' or 'pools', not both")
            v = dict(v)
            v["pools"] = [v.pop("pool")]
        return v

    @model_validator(mode="after")
    def _checks(self) -> "ExperimentConfig":
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: repeated values in {self.seeds}")
        if not any(b.type == "plain" for b in self.baselines):
            raise ValueError("baselines: 'plain' is required (it is the speedup denominator)")
        labels = [b.label for b in self.baselines]
        if len(set(labels)) != len(labels):
            raise ValueError(f"baselines: repeated names {labels}")
        if any(r.oracle for r in self.runs) and not any(r.single for r in self.runs):
            raise ValueError("runs: 'oracle: true' needs a 'single: true' entry (it picks among the single drafters)")
        return self
