"""Pool configuration files (YAML): the verifier, the named drafters, the policy, the reward.

``load_pool(path)`` validates a file with the pydantic models below and builds an ``Engine``. Errors name
the file, the field path (``drafters.1.params.k``) and the allowed values. Drafter and policy types are
looked up in their registries (``metasd.drafters``, ``metasd.policies``) or given as an import path
``package.module:ClassName`` for user classes; ``plugins`` lists modules to import first (for classes
that register themselves).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .config_files import (ConfigError, expand_env_path, format_validation_error,  # noqa: F401  (public names of
                           read_yaml_mapping, validate_config)  # metasd.config, used by callers of it)
from .drafter import DRAFTERS, BuildContext, Drafter
from .policy import POLICIES, Policy
from .rewards import BOUNDED_REWARDS, REWARDS, RewardName

DEFAULT_POOL = "default.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Quantize = Literal["none", "int8", "int4"]


class VerifierConfig(_Strict):
    model: str = Field(description="model reference: bundled:<name>, a local HF directory or .gguf file, or a hub id")
    dtype: str = "auto"
    device: str | None = None
    #: weight-only quantization of the verifier: the output is then exactly the quantized model's
    quantize: Quantize = "none"


class DrafterConfig(_Strict):
    name: str
    type: str = Field(description="registered drafter kind, or package.module:ClassName")
    model: str | None = None
    dtype: str | None = None  # default: the verifier's
    #: weight-only quantization of the drafter's own weights (never inherited from the verifier)
    quantize: Quantize = "none"
    checkpoint: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class PolicyConfig(_Strict):
    name: str = "ucb"
    params: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = 0


class CostModelConfig(_Strict):
    """Prices of the modeled step cost behind the ``throughput`` reward (``metasd.cost``): bytes-equivalent per
    multiply-accumulate per row, by weight format. Left out: the calibration of the verifier's device type."""

    dense: float = Field(ge=0.0, allow_inf_nan=False)
    int8: float = Field(ge=0.0, allow_inf_nan=False)
    int4: float = Field(ge=0.0, allow_inf_nan=False)


class PoolConfig(_Strict):
    """A pool: one verifier, named drafters (arms), and how the policy chooses among them."""

    verifier: VerifierConfig
    drafters: list[DrafterConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    reward: RewardName = "throughput"
    granularity: Literal["step", "request"] = "step"
    persistent: bool = False  # keep policy state across requests
    categories: list[str] = Field(default_factory=list)  # category one-hot layout for contextual policies
    plugins: list[str] = Field(default_factory=list)
    cost_model: CostModelConfig | None = None  # the throughput reward's prices (default: the device's calibration)

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, drafters: list[DrafterConfig]) -> list[DrafterConfig]:
        names = [d.name for d in drafters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"drafter names must be unique; repeated: {dup}")
        return drafters

    @model_validator(mode="after")
    def _types_exist(self) -> "PoolConfig":
        """Drafter types and policy names exist; every ``params`` mapping is valid for its class (names, types,
        ranges: ``Drafter.Params``; built-in policies are constructed once, without any model). All problems
        are reported together, each under its own field path (``drafters.0.params.k``)."""
        errors: list[dict[str, Any]] = []
        try:
            _import_plugins(self.plugins)
        except ValueError as e:
            errors.append(_line_error(("plugins",), str(e).removeprefix("plugins: "), self.plugins))
        for i, d in enumerate(self.drafters):
            where = f"drafters.{i}.type"
            try:
                cls = resolve_drafter_class(d.type, where=where)
            except ValueError as e:
                errors.append(_line_error(("drafters", i, "type"), str(e).removeprefix(f"{where}: "), d.type))
                continue
            for fld, noun in (("model", "a model reference"), ("checkpoint", "a checkpoint")):
                rule, given = getattr(cls, f"{fld}_field", None), getattr(d, fld) is not None
                if rule == "required" and not given:
                    errors.append(_line_error(("drafters", i, fld), f"drafter type {d.type!r} needs {noun}", None))
                elif rule == "never" and given:
                    errors.append(_line_error(("drafters", i, fld), f"drafter type {d.type!r} takes no {fld}", getattr(d, fld)))
            d.params = _validate_params(cls, d.params, ("drafters", i, "params"), errors,
                                        skip=("self", "name", "model", "tokenizer", "model_ref"))
        try:
            cls = resolve_policy_class(self.policy.name, where="policy.name")
        except ValueError as e:
            errors.append(_line_error(("policy", "name"), str(e).removeprefix("policy.name: "), self.policy.name))
        else:
            n_before = len(errors)
            _validate_params(cls, self.policy.params, ("policy", "params"), errors, skip=("self", "n_arms", "seed"))
            if len(errors) == n_before and cls.__module__.startswith("metasd.policies."):
                self._probe_policy(cls, errors)
        if self.reward not in REWARDS:  # guarded by Literal; kept for user-registered rewards
            errors.append(_line_error(("reward",), f"unknown {self.reward!r}; choose one of {sorted(REWARDS)}", self.reward))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _probe_policy(self, cls: type[Policy], errors: list[dict[str, Any]]) -> None:
        """Build a built-in policy as ``build_engine`` will (cheap: no model) so that a bad value, or a policy that
        needs rewards in [0, 1] with an unbounded reward, is refused now and not after the models load."""
        try:
            probe = cls(max(len(self.drafters), 1), seed=self.policy.seed, **self.policy.params)
        except (TypeError, ValueError) as e:
            errors.append(_line_error(("policy", "params"), str(e), self.policy.params))
            return
        # the engine uses the policy only with several drafters, and checks the reward then (Engine._check_policy)
        if len(self.drafters) > 1 and self.reward not in BOUNDED_REWARDS and getattr(probe, "requires_bounded_rewards", False):
            errors.append(_line_error(("reward",), f"policy {self.policy.name!r} (as configured) needs rewards in [0, 1]; "
                                      f"{self.reward!r} is unbounded: use one of {sorted(BOUNDED_REWARDS)}",
                                      self.reward))


def _import_plugins(modules: list[str]) -> None:
    importlib.import_module("metasd.drafters")
    importlib.import_module("metasd.policies")
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"plugins: cannot import {mod!r}: {e}") from None


def _import_path(ref: str, where: str):
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot import {ref!r}: {e}") from None


def _resolve_class(name: str, where: str, registry: dict[str, type], base: type, what: str, package: str) -> type:
    importlib.import_module(package)  # registers the built-in classes
    if ":" in name:
        cls = _import_path(name, where)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{where}: {name!r} is not a {base.__module__}.{base.__name__} subclass")
        return cls
    if name not in registry:
        raise ValueError(f"{where}: unknown {what} {name!r}; registered: {sorted(registry)} "
                         "(or give package.module:ClassName)")
    return registry[name]


def resolve_drafter_class(kind: str, where: str = "type") -> type[Drafter]:
    """A registered drafter ``kind`` or a ``package.module:ClassName`` import path -> the Drafter class."""
    return _resolve_class(kind, where, DRAFTERS, Drafter, "drafter type", "metasd.drafters")


def resolve_policy_class(name: str, where: str = "policy.name") -> type[Policy]:
    """A registered policy name or a ``package.module:ClassName`` import path -> the Policy class."""
    return _resolve_class(name, where, POLICIES, Policy, "policy", "metasd.policies")


def check_param_names(cls: type, params: dict[str, Any], where: str, skip: tuple[str, ...]) -> None:
    """Refuse ``params`` names that ``cls.__init__`` does not take (a class with ``**kwargs`` takes any)."""
    sig = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = [p for p in sig.parameters if p not in skip]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no parameter(s) {unknown}; accepted: {accepted}")


def params_model(cls: type) -> type[BaseModel] | None:
    """The ``Params`` model that describes ``cls``'s parameters: declared on the class itself, or inherited
    together with an unchanged ``__init__`` (a subclass with its own constructor and no ``Params`` of its own,
    e.g. a plugin, falls back to the check of names against its ``__init__``)."""
    for owner in cls.__mro__:
        if "Params" in owner.__dict__:
            model = owner.__dict__["Params"]
            if owner is cls or cls.__init__ is owner.__init__:
                return model if isinstance(model, type) and issubclass(model, BaseModel) else None
            return None
    return None


def _line_error(loc: tuple, message: str, value: Any) -> dict[str, Any]:
    """One pydantic line error (for ``ValidationError.from_exception_data``) at ``loc`` with our own message."""
    return {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}


def _validate_params(cls: type, params: dict[str, Any], loc: tuple, errors: list[dict[str, Any]],
                     skip: tuple[str, ...]) -> dict[str, Any]:
    """``params`` checked against ``cls``'s ``Params`` model (names, types, ranges) or, without one, their names
    against its ``__init__``. Problems are appended to ``errors`` under ``loc``; returns the validated values of
    the keys that were given (defaults are left to the class), or ``params`` unchanged."""
    model = params_model(cls)
    if model is None:
        try:
            check_param_names(cls, params, ".".join(map(str, loc)), skip)
        except ValueError as e:
            errors.append(_line_error(loc, str(e).partition(": ")[2], params))
        return params
    try:
        checked = model.model_validate(params).model_dump(exclude_unset=True)
        return {k: checked[k] for k in params}  # the user's keys in the user's order
    except ValidationError as err:
        allowed = list(model.model_fields)
        for e in err.errors():
            if e["type"] == "extra_forbidden":
                name = str(e["loc"][-1])
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(_line_error(loc + e["loc"], f"{cls.__name__} has no parameter {name!r}{hint}; "
                                                          f"allowed: {', '.join(allowed)}", e["input"]))
            else:
                errors.append({"type": e["type"], "loc": loc + e["loc"], "input": e["input"], "ctx": e.get("ctx", {})})
        return params


def default_pool_path() -> Path:
    """The embedded default pool (``configs/default.yaml``: the bundled Qwen pair, the 0.5B drafter in int4)."""
    return Path(str(resources.files("metasd.configs") / DEFAULT_POOL))


def read_pool_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PoolConfig:
    """Parse and validate a pool file (default: the embedded one); ``overrides`` replace top-level keys."""
    path = Path(path) if path is not None else default_pool_path()
    raw = read_yaml_mapping(path, "pool config")
    raw.update(overrides or {})
    return parse_pool_config(raw, source=str(path))


def parse_pool_config(raw: dict[str, Any], source: str = "<pool>") -> PoolConfig:
    return validate_config(PoolConfig, raw, source, "pool config")


class ModelCache:
    """Loads each (model reference, dtype, quantization) once, so arms with the same settings share weights.

    A model is quantized only through its own key: an arm asking for int8 weights gets its own copy and
    never changes the bf16 weights another arm (or the verifier) uses.
    """

    def __init__(self, device: str | None):
        self.device = device
        self._models: dict[tuple[str, str, str, bool], Any] = {}

    def load(self, ref: str, dtype: str, quantize: str = "none", drafter: bool = False):
        """(model, tokenizer); ``drafter``: an int4 drafter keeps int8 copies for prefills (never a verifier)."""
        from .models import load_model

        prefill_copy = drafter and quantize == "int4"
        key = (ref, str(dtype), quantize, prefill_copy)
        if key not in self._models:
            self._models[key] = load_model(ref, dtype=dtype, device=self.device, quantize=quantize,
                                           prefill_copy=prefill_copy)
        return self._models[key]

    def put(self, ref: str, dtype: str, loaded, quantize: str = "none") -> None:
        """Register an already loaded (model, tokenizer) pair (benchmarks reuse models they loaded)."""
        self._models[(ref, str(dtype), quantize, False)] = loaded


def check_quantization(config: PoolConfig) -> None:
    """Every ``quantize`` of a pool against its device and dtype, before any model is loaded."""
    from .models import resolve_device, resolve_dtype
    from .quantize import check_quantize

    device = resolve_device(config.verifier.device)
    check_quantize(config.verifier.quantize, name=f"verifier {config.verifier.model!r}", field="verifier.quantize",
                   dtype=resolve_dtype(config.verifier.dtype, device), device=device)
    for i, d in enumerate(config.drafters):
        check_quantize(d.quantize, name=f"drafter {d.name!r}", field=f"drafters.{i}.quantize",
                       dtype=resolve_dtype(d.dtype or config.verifier.dtype, device), device=device)


def check_model_references(config: PoolConfig, source: str = "<pool>", base_dir: Path | None = None) -> None:
    """Every model reference of a pool (``verifier.model``, ``drafters.i.model``) can be loaded - a known
    ``bundled:`` name, an existing model directory or .gguf file, or a hub id (not looked up) - and every
    ``drafters.i.checkpoint`` exists (relative to ``base_dir``, as ``build_engine`` resolves it). Cheap: nothing
    is loaded, downloaded or assembled. A ``ConfigError`` naming ``source`` and each bad field otherwise."""
    from .models import ModelLoadError, check_model_reference

    refs = [("verifier.model", config.verifier.model)]
    refs += [(f"drafters.{i}.model", d.model) for i, d in enumerate(config.drafters) if d.model is not None]
    lines = []
    for where, ref in refs:
        try:
            check_model_reference(ref)
        except ModelLoadError as e:
            lines.append(f"  {where}: {e}")
    for i, d in enumerate(config.drafters):
        if d.checkpoint:
            path = Path(d.checkpoint).expanduser()
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            if not path.exists():
                lines.append(f"  drafters.{i}.checkpoint: {str(path)!r} does not exist")
    if lines:
        raise ConfigError("\n".join([f"{source}: invalid pool config", *lines]))


def build_engine(config: PoolConfig, base_dir: Path | None = None, models: ModelCache | None = None, **engine_kwargs):
    """Load the models of a validated pool config and compose the engine."""
    from .engine import Engine
    from .verifier import Verifier

    try:
        check_quantization(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    models = models or ModelCache(config.verifier.device)
    v_model, v_tok = models.load(config.verifier.model, config.verifier.dtype, config.verifier.quantize)
    verifier = Verifier(v_model, v_tok, name=config.verifier.model)
    drafters = []
    for i, d in enumerate(config.drafters):
        cls = resolve_drafter_class(d.type, where=f"drafters.{i}.type")
        checkpoint = d.checkpoint
        if checkpoint and base_dir is not None and not Path(checkpoint).is_absolute():
            checkpoint = str((base_dir / checkpoint).resolve())
        dtype = d.dtype or config.verifier.dtype
        def load(ref, quantize=None, _dtype=dtype, _quantize=d.quantize):
            return models.load(ref, _dtype, _quantize if quantize is None else quantize, drafter=True)

        build = BuildContext(verifier=verifier, model=d.model, checkpoint=checkpoint, load_model=load,
                             quantize=d.quantize)
        try:
            drafter = cls.from_config(d.name, dict(d.params), build)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"drafters.{i} ({d.name!r}): {e}") from e
        drafters.append(drafter)
    policy = make_policy_from_config(config.policy, len(drafters))
    if config.cost_model is not None:
        from .cost import CostModel

        engine_kwargs.setdefault("cost_model", CostModel(config.cost_model.model_dump()))
    return Engine(verifier, drafters, policy if len(drafters) > 1 else None, granularity=config.granularity,
                  reward=config.reward, persistent_policy=config.persistent, categories=config.categories,
                  **engine_kwargs)


def make_policy_from_config(policy: PolicyConfig, n_arms: int) -> Policy:
    cls = resolve_policy_class(policy.name)
    try:
        return cls(max(n_arms, 1), seed=policy.seed, **policy.params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"policy ({policy.name!r}): {e}") from e


def load_pool(path: str | Path | None = None, overrides: dict[str, Any] | None = None, **engine_kwargs):
    """Read a pool file (default: the embedded default pool) and build its ``Engine``."""
    config = read_pool_config(path, overrides)
    base = Path(path).resolve().parent if path is not None else None
    if engine_kwargs.get("models") is None:  # a caller's own ModelCache may hold models under any name
        check_model_references(config, str(path) if path is not None else "default pool", base)
    return build_engine(config, base, **engine_kwargs)
