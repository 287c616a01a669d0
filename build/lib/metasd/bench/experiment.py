"""Experiment files resolved: ``load_experiment`` validates a file against ``metasd.bench.schema`` (the
format is documented there) and everything that can be checked without loading a model - pool files,
policy names and parameters, drafter names, dataset files and their questions - into an ``Experiment``,
raising ``metasd.config.ConfigError`` naming the file and the field path (``runs.2.policy.params``).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from metasd.config import (ConfigError, PoolConfig, format_validation_error, parse_pool_config, read_pool_config,
                           read_yaml_mapping, resolve_policy_class)
from metasd.core.decoding.policy import make_policy
from metasd.data import Question, load_questions
from .schema import BUILTIN, COPY_HEAVY, DatasetSpec, ExperimentConfig, PoolSpec, RunPolicy
from metasd.core.decoding.rewards import BOUNDED_REWARDS, REWARDS

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
    feedback: str = "bandit"

    def settings(self) -> dict[str, Any]:
        return {"method": self.name, "kind": self.kind, "drafters": self.drafters,
                "policy": self.policy.model_dump() if self.policy else None, "reward": self.reward,
                "granularity": self.granularity, "persistent": self.persistent, "feedback": self.feedback}


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


def copy_heavy_path(per_category: int, seed: int = 0) -> Path:
    """The copy-heavy prompt set as a JSONL file, generated once per Python version, seed and size into the model
    cache's ``datasets/`` folder (``metasd.data.copy_heavy``: built from this Python's standard library)."""
    from metasd.data.copy_heavy import build_copy_heavy, python_tag, write_jsonl
    from metasd.models import cache_dir

    path = cache_dir() / "datasets" / f"copy_heavy-{python_tag()}-seed{seed}-{per_category}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        write_jsonl(build_copy_heavy(per_category, seed), tmp)
        tmp.replace(path)
    return path


def builtin_prompts_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("metasd.data") / "prompts.jsonl"))


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

    def unique(field: str, items: list) -> list:
        names = [x.name for x in items]
        if len(set(names)) != len(names):
            fail(field, f"{field[:-1]} names must be unique, got {names} (give each a 'name')")
        return items

    pools = unique("pools", [_resolve_pool(i, spec, cfg, base, where, fail) for i, spec in enumerate(cfg.pools)])
    datasets = unique("datasets", [_resolve_dataset(i, spec, cfg, base, fail, limit) for i, spec in enumerate(cfg.datasets)])

    return Experiment(cfg, cfg.name or default_name, where, base, pools, datasets, any(r.oracle for r in cfg.runs))


def _validate(raw: dict[str, Any], where: str) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        text = format_validation_error(e, where, "experiment", ExperimentConfig)
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

    drafters = pool.arm_names  # the arms (one per budget of an entry with budgets; entries only drafted with are not)
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
        except ValueError as e:
            field_path, _, msg = str(e).partition(": ")
            fail(field_path, msg)
        try:  # the policy's own parameter check (names, types, ranges), as the run will build it: cheap, no model
            probe = make_policy(cls, max(len(arms), 1), seed=0, **run.policy.params)
        except (TypeError, ValueError) as e:
            fail(f"{rloc}.policy.params", str(e))
        reward = run.reward or pool.reward
        try:  # a policy that needs rewards in [0, 1] fails on tokens/s at the first step: say so now
            probe.update(probe.select(None), 0.5 if reward in BOUNDED_REWARDS else 50.0, None)
        except ValueError as e:
            fail(f"{rloc}.reward" if run.reward else rloc, f"policy {run.policy.name!r} cannot take reward {reward!r}"
                 f"{' (tokens/s, unbounded)' if reward == 'throughput' else ''}: {e}")
        granularity = run.granularity or pool.granularity
        feedback = run.feedback or pool.feedback
        if feedback == "full" and not REWARDS[reward].counterfactual_values:
            fail(f"{rloc}.feedback" if run.feedback else rloc, f"feedback 'full' needs a reward other arms can be scored "
                 f"by without running them (throughput or block_efficiency), not {reward!r}")
        persistent = pool.persistent if run.persistent is None else run.persistent
        default = f"{run.policy.name}-{reward}-{granularity}" + ("-full" if feedback == "full" else "") + \
            ("-persistent" if persistent else "")
        if run.drafters:
            default += "[" + ",".join(run.drafters) + "]"
        methods.append(Method(run.name or default, "policy", list(arms), run.policy, reward, granularity, persistent,
                              feedback))
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
    elif spec.path == COPY_HEAVY:
        try:
            path = copy_heavy_path(spec.questions_per_group or cfg.questions_per_group or 4)
        except ValueError as e:
            fail(f"{loc}.path", str(e))
        name = spec.name or COPY_HEAVY
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
