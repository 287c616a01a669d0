"""Experiment files (YAML): which pools, which policy runs, which prompts, which baselines.

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
    * policy run ``{name?, policy: {name, params}, reward?, granularity?, persistent?, drafters?}``;
      unset fields take the pool's values; ``drafters`` restricts the arms; the policy's seed is the
      experiment seed;
    * ``{single: true, drafters?}``: one run per drafter of the pool, alone (method ``single:<name>``);
    * ``{oracle: true}``: per category the best single drafter in hindsight (needs a ``single`` entry).
- ``datasets``: list of ``builtin`` | a path | ``{name?, path, categories?, groups?, questions_per_group?,
  turns?}``; ``categories``, ``groups``, ``questions_per_group`` and ``turns`` (``all`` | ``first``) may
  also be set at top level as defaults for every dataset.
- ``max_new_tokens`` (128), ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``seeds`` ([0]).
- ``baselines``: ``plain`` (required: the speedup denominator), ``{type: assisted, drafter: NAME,
  params?}`` (transformers assisted generation with that pool drafter's model), ``prompt_lookup``.
  Baselines decode greedily.
- ``order``: ``interleaved`` (default: request r of every baseline and method, then request r + 1, so
  load drift on a shared machine hits all methods alike) or ``sequential`` (all requests of one method,
  then the next, as Spec-Bench does).
- ``executor``: where requests are answered - ``inprocess`` (default: this process) or ``ray`` /
  ``{type: ray, address?, workers?, cpus_per_worker?, questions_per_shard?, max_retries?}`` (Ray actors,
  ``metasd.ray_executor``; ``pip install -e '.[ray]'``). Not part of the config hash: a study started
  in-process can be resumed on Ray and back. ``metasd bench --executor/--ray-address/--workers`` override it.
- ``threads`` (torch CPU threads; default: torch's), ``warmup`` (true: one short untimed generation
  per drafter and baseline before timing), ``plots`` (true).

``load_experiment`` validates the file and everything that can be checked without loading a model -
pool files, policy names and parameters, drafter names, dataset files and their questions - and raises
``metasd.config.ConfigError`` naming the file and the field path (``runs.2.policy.params``).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .config import (
    ConfigError,
    PoolConfig,
    _check_params,
    format_validation_error,
    read_yaml_mapping,
    parse_pool_config,
    read_pool_config,
    resolve_policy_class,
)
from .datasets import Question, load_questions
from .rewards import BOUNDED_REWARDS, RewardName

BUILTIN = "builtin"
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
    persistent: bool | None = None
    drafters: list[str] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "RunSpec":
        if self.single and self.oracle:
            raise ValueError("an entry is either 'single: true' or 'oracle: true', not both")
        if self.single or self.oracle:
            kind = "single" if self.single else "oracle"
            extra = [f for f in ("policy", "reward", "granularity", "persistent") if getattr(self, f) is not None]
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
    """Where a study's requests are answered: ``inprocess`` (default) or ``ray`` (``metasd.ray_executor``)."""

    type: Literal["inprocess", "ray"] = "inprocess"
    address: str | None = None  # ray: None = start a local Ray; "auto" = the running cluster; or HOST:PORT
    workers: int | None = Field(None, ge=1)  # ray: actors (default: cluster CPUs // cpus_per_worker)
    cpus_per_worker: int | None = Field(None, ge=1)  # ray: CPUs per actor = its torch threads
    questions_per_shard: int = Field(1, ge=1)  # ray: questions (all their turns, every method) per task
    max_retries: int = Field(2, ge=0)  # ray: times a shard whose worker died is retried on a fresh one

    @model_validator(mode="after")
    def _ray_fields(self) -> "ExecutorSpec":
        if self.type == "inprocess":
            extra = [f for f in ("address", "workers", "cpus_per_worker") if getattr(self, f) is not None]
            if extra:
                raise ValueError(f"{extra} apply to the ray executor only (set 'type: ray')")
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


# ------------------------------------------------------------------------------------------- resolved


@dataclass
class Method:
    """One thing to run on every request: a policy over drafters, or one drafter alone."""

    name: str
    kind: Literal["policy", "single"]
    drafters: list[str]
    policy: RunPolicy | None
    reward: str
    granularity: str
    persistent: bool

    def settings(self) -> dict[str, Any]:
        return {"method": self.name, "kind": self.kind, "drafters": self.drafters,
                "policy": self.policy.model_dump() if self.policy else None, "reward": self.reward,
                "granularity": self.granularity, "persistent": self.persistent}


@dataclass
class ResolvedPool:
    name: str
    config: PoolConfig
    base_dir: Path | None
    source: str
    methods: list[Method]


@dataclass
class ResolvedDataset:
    name: str
    path: Path
    turns: str
    questions: list[Question]

    @property
    def n_requests(self) -> int:
        return sum(1 if self.turns == "first" else len(q.turns) for q in self.questions)


@dataclass
class Experiment:
    config: ExperimentConfig
    name: str
    source: str
    base_dir: Path
    pools: list[ResolvedPool]
    datasets: list[ResolvedDataset]
    oracle: bool

    def resolved_dict(self, questions: bool = True) -> dict[str, Any]:
        """The experiment with pools expanded to their full validated configs (for logging and hashing)."""
        d = self.config.model_dump(mode="json")
        d.pop("executor")  # how, not what: logged as parent-run tags, left out of the config hash
        d["name"] = self.name
        d["pools"] = [{"name": p.name, "source": p.source, "config": p.config.model_dump(mode="json"),
                       "methods": [m.settings() for m in p.methods]} for p in self.pools]
        d["datasets"] = [{"name": ds.name, "path": str(ds.path), "turns": ds.turns, "sha256": _file_sha(ds.path),
                          **({"questions": len(ds.questions)} if questions else {})} for ds in self.datasets]
        return d

    def config_hash(self) -> str:
        """Identifies the experiment for resuming: the resolved config and the dataset files' contents
        (not the question count, so a resume may change ``--limit``)."""
        blob = json.dumps(self.resolved_dict(questions=False), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def builtin_prompts_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("metasd") / "data" / "prompts.jsonl"))


def load_experiment(source: str | Path | dict[str, Any] | ExperimentConfig, base_dir: str | Path | None = None,
                    limit: int | None = None) -> Experiment:
    """Validate an experiment (file path, mapping or model) and resolve pools, methods and questions.

    No model is loaded. ``limit`` keeps at most that many questions of each dataset.
    Raises ``ConfigError`` naming the file and the field path.
    """
    if isinstance(source, ExperimentConfig):
        cfg, where, base, default_name = source, "<experiment>", Path(base_dir or "."), "experiment"
    elif isinstance(source, dict):
        where, base, default_name = "<experiment>", Path(base_dir or "."), "experiment"
        cfg = _validate(source, where)
    else:
        path = Path(source)
        raw = read_yaml_mapping(path, "experiment file")
        where, base, default_name = str(path), path.resolve().parent, path.stem
        cfg = _validate(raw, where)
    base = base.resolve()

    def fail(loc: str, msg: str) -> None:
        raise ConfigError(f"{where}: invalid experiment\n  {loc}: {msg}")

    pools = []
    for i, spec in enumerate(cfg.pools):
        pools.append(_resolve_pool(i, spec, cfg, base, where, fail))
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        fail("pools", f"pool names must be unique, got {names} (give each a 'name')")

    datasets = []
    for i, spec in enumerate(cfg.datasets):
        datasets.append(_resolve_dataset(i, spec, cfg, base, fail, limit))
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        fail("datasets", f"dataset names must be unique, got {names} (give each a 'name')")

    return Experiment(cfg, cfg.name or default_name, where, base, pools, datasets, any(r.oracle for r in cfg.runs))


def _validate(raw: dict[str, Any], where: str) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        text = format_validation_error(e, where, "experiment")
        # model-level checks say "field: message"; show them under that field, not under "(top level)"
        text = re.sub(r"^  (\(top level\)|[\w.]+): ([a-z_][\w.]*): ", r"  \2: ", text, flags=re.M)
        raise ConfigError(text) from None


def _resolve_pool(i: int, spec: PoolSpec, cfg: ExperimentConfig, base: Path, where: str, fail) -> ResolvedPool:
    loc = f"pools.{i}.config"
    if isinstance(spec.config, dict):
        pool = parse_pool_config(dict(spec.config), source=f"{where}: {loc} (inline pool)")
        name, pool_base, source = spec.name or f"pool{i}", base, "inline"
    elif spec.config == "default":
        pool = read_pool_config(None)
        name, pool_base, source = spec.name or "default", None, "default"
    else:
        path = Path(spec.config).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            fail(loc, f"pool file {path} does not exist")
        pool = read_pool_config(path)
        name, pool_base, source = spec.name or path.stem, path.resolve().parent, str(path)

    drafters = [d.name for d in pool.drafters]
    methods: list[Method] = []
    for j, run in enumerate(cfg.runs):
        rloc = f"runs.{j}"
        for k, d in enumerate(run.drafters or []):
            if d not in drafters:
                fail(f"{rloc}.drafters.{k}", f"pool {name!r} has no drafter {d!r}; its drafters: {drafters}")
        if run.oracle:
            continue
        if run.single:
            for d in run.drafters or drafters:
                methods.append(Method(f"single:{d}", "single", [d], None, pool.reward, "step", False))
            continue
        arms = run.drafters or drafters
        if not arms:
            fail(rloc, f"pool {name!r} has no drafters to choose among")
        try:
            cls = resolve_policy_class(run.policy.name, where=f"{rloc}.policy.name")
            _check_params(cls, run.policy.params, f"{rloc}.policy.params", skip=("self", "n_arms", "seed"))
        except ValueError as e:
            field_path, _, msg = str(e).partition(": ")
            fail(field_path, msg)
        try:
            probe = cls(max(len(arms), 1), seed=0, **run.policy.params)  # parameter values (cheap, no model)
        except (TypeError, ValueError) as e:
            fail(f"{rloc}.policy.params", str(e))
        reward = run.reward or pool.reward
        try:  # a policy that needs rewards in [0, 1] fails on tokens/s at the first step: say so now
            probe.update(probe.select(None), 0.5 if reward in BOUNDED_REWARDS else 50.0, None)
        except ValueError as e:
            fail(f"{rloc}.reward" if run.reward else rloc, f"policy {run.policy.name!r} cannot take reward {reward!r}"
                 f"{' (tokens/s, unbounded)' if reward == 'throughput' else ''}: {e}")
        granularity = run.granularity or pool.granularity
        persistent = pool.persistent if run.persistent is None else run.persistent
        default = f"{run.policy.name}-{reward}-{granularity}" + ("-persistent" if persistent else "")
        if run.drafters:
            default += "[" + ",".join(run.drafters) + "]"
        methods.append(Method(run.name or default, "policy", list(arms), run.policy, reward, granularity, persistent))
    labels = [m.name for m in methods] + [b.label for b in cfg.baselines] + (["oracle"] if any(r.oracle for r in cfg.runs) else [])
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        fail("runs", f"method names must be unique within a pool; repeated: {dup} (give entries a 'name')")
    for j, b in enumerate(cfg.baselines):
        if b.type == "assisted":
            match = [d for d in pool.drafters if d.name == b.drafter]
            if not match:
                fail(f"baselines.{j}.drafter", f"pool {name!r} has no drafter {b.drafter!r}; its drafters: {drafters}")
            if not match[0].model:
                fail(f"baselines.{j}.drafter", f"drafter {b.drafter!r} has no model (assisted generation needs a small LM)")
    return ResolvedPool(name, pool, pool_base, source, methods)


def _resolve_dataset(i: int, spec: DatasetSpec, cfg: ExperimentConfig, base: Path, fail, limit) -> ResolvedDataset:
    loc = f"datasets.{i}"
    if spec.path == BUILTIN:
        path, name = builtin_prompts_path(), spec.name or BUILTIN
    else:
        path = Path(spec.path).expanduser()
        path = path if path.is_absolute() else base / path
        name = spec.name or path.stem
        if not path.is_file():
            fail(f"{loc}.path", f"dataset {path} does not exist" + (
                f" (relative paths are resolved against the experiment file's folder {base})" if not Path(spec.path).is_absolute() else ""))
    per_group = spec.questions_per_group or cfg.questions_per_group
    try:
        questions = load_questions(path, groups=spec.groups or cfg.groups, per_group=per_group,
                                   categories=spec.categories or cfg.categories)
    except (ValueError, FileNotFoundError) as e:
        fail(loc, str(e))
    if limit is not None:
        questions = questions[:limit]
    if not questions:
        fail(loc, f"no questions selected from {path} (check categories / groups)")
    ids = [q.question_id for q in questions]
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        fail(loc, f"{path}: repeated question ids {dup[:5]}")
    return ResolvedDataset(name, path, spec.turns or cfg.turns, questions)
