"""The pool file's schema (YAML): the verifier, the named drafters, the policy, the reward.

Errors name the file, the field path (``drafters.1.params.k``) and the allowed values. Drafter and policy types are
looked up in their registries (``metasd.drafters``, ``metasd.policies``) or given as an import path
``package.module:ClassName`` for user classes; ``plugins`` lists modules to import first (for classes that register
themselves). ``metasd.config.build`` loads the models of a validated pool and builds its ``Engine``.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from metasd.core.decoding.drafter import cross_tokenizer_types
from metasd.core.decoding.params import Bool, Int
from metasd.core.decoding.policy import Policy, make_policy
from metasd.core.decoding.rewards import BOUNDED_REWARDS, REWARDS, RewardName
from metasd.models.devices import resolve_dtype

from .plugins import import_plugins, line_error, resolve_drafter_class, resolve_policy_class, validate_params


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Quantize = Literal["none", "int8", "int4"]
#: a llama.cpp verifier's dtype -> the GGUF type its weights are converted to (auto: bf16, the bundled cache's own)
LLAMA_CPP_DTYPES = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "fp16": "f16", "float16": "f16",
                    "fp32": "f32", "float32": "f32"}


def _known_dtype(name: str | None) -> str | None:
    """A dtype name ``resolve_dtype`` takes (``auto``, ``bf16``, ``fp32``, ...), refused here so the error names the
    field (``verifier.dtype``, ``drafters.1.dtype``) before any model loads."""
    if name is not None:
        resolve_dtype(name, "cpu")
    return name


class VerifierConfig(_Strict):
    model: str = Field(description="model reference: bundled:<name>, a local HF directory or .gguf file, or a hub id")
    dtype: str = "auto"
    _dtype_name = field_validator("dtype")(_known_dtype)
    device: str | None = None
    #: weight-only quantization of the verifier: the output is then exactly the quantized model's
    quantize: Quantize = "none"
    #: verify forwards replayed from CUDA graphs at fixed shapes: auto = where the verifier is on CUDA; on = required
    #: (refused on another device); off = eager; fixed = the fixed shapes and buffers eagerly, on any device (the path
    #: a GPU captures, checked on a CPU) (docs/architecture.md, "The execution layer")
    graphs: Literal["auto", "on", "off", "fixed"] = "auto"
    #: what runs the verifier's forwards: torch (transformers) or llama.cpp (llama-cpp-python, CPU; the model is
    #: converted to a GGUF of ``dtype`` - auto: bf16, the bundled weights - once; a ``.gguf`` model runs as it is)
    backend: Literal["torch", "llama.cpp"] = "torch"
    #: llama.cpp backend: its threads (default: torch's) and KV positions (default: the model's context, <= 8192)
    threads: int | None = Field(default=None, ge=1)
    context: int | None = Field(default=None, ge=16)

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> "VerifierConfig":
        if self.graphs == "on" and self.device is not None and not self.device.startswith("cuda"):
            raise ValueError(f"graphs: 'on' needs a CUDA device; device is {self.device!r} (use 'auto' or 'off')")
        return self

    @model_validator(mode="after")
    def _backend_settings(self) -> "VerifierConfig":
        if self.backend == "llama.cpp":
            if self.quantize != "none":
                raise ValueError("quantize applies to torch weights; with backend 'llama.cpp' give a quantized .gguf "
                                 "file as the model instead")
            if self.graphs in ("on", "fixed"):
                raise ValueError(f"graphs: {self.graphs!r} is a torch setting; backend 'llama.cpp' runs its own "
                                 "forwards")
            if self.device is not None and self.device != "cpu":
                raise ValueError(f"backend 'llama.cpp' runs on the CPU; device is {self.device!r}")
            if self.dtype not in LLAMA_CPP_DTYPES:
                raise ValueError(f"dtype {self.dtype!r} with backend 'llama.cpp': one of {sorted(LLAMA_CPP_DTYPES)}")
        elif self.threads is not None or self.context is not None:
            raise ValueError("threads and context are llama.cpp backend settings (backend: llama.cpp)")
        return self


class DrafterConfig(_Strict):
    name: str
    type: str = Field(description="registered drafter kind, or package.module:ClassName")
    model: str | None = None
    dtype: str | None = None  # default: the verifier's
    _dtype_name = field_validator("dtype")(_known_dtype)
    #: weight-only quantization of the drafter's own weights (never inherited from the verifier)
    quantize: Quantize = "none"
    checkpoint: str | None = None
    #: "shared": the drafter's tokenizer must be the verifier's (checked when the pool loads); "own": the drafter
    #: drafts in its model's own tokenizer and translates its drafts into the verifier's ids (cross-tokenizer
    #: drafting: a model of another family; types with ``cross_tokenizer``, e.g. pretrained)
    tokenizer: Literal["shared", "own"] = "shared"
    #: whether the policy chooses this entry; false: built only for the entries that draft with it (a fused drafter's)
    arm: bool = True
    params: dict[str, Any] = Field(default_factory=dict)
    #: node budgets: one arm per budget (``name@budget``), all drafting with this entry's one drafter, each cut to its
    #: first ``budget`` nodes (drafters/budgeted.py); distinct integers >= 1, sorted on load. None: one arm, no budget
    budgets: list[Int] | None = None

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, budgets: list[int] | None) -> list[int] | None:
        if budgets is None:
            return None
        if not budgets:
            raise ValueError("give at least one budget (or leave budgets out)")
        if any(b < 1 for b in budgets):
            raise ValueError(f"budgets must be integers >= 1, got {budgets}")
        if len(set(budgets)) != len(budgets):
            raise ValueError(f"budgets must be distinct, got {budgets}")
        return sorted(budgets)

    def arm_names(self) -> list[str]:
        """The names of the arms this entry gives the policy, in order (none with ``arm: false``)."""
        if not self.arm:
            return []
        return [self.name] if self.budgets is None else [f"{self.name}@{b}" for b in self.budgets]


class PolicyConfig(_Strict):
    name: str = "ucb"
    params: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = 0


class CostModelConfig(_Strict):
    """Prices of the modeled step cost behind the ``throughput`` reward (``metasd.core.pricing.cost``): bytes-equivalent
    per multiply-accumulate per row, by weight format. Left out: the calibration of the verifier's device type."""

    dense: float = Field(ge=0.0, allow_inf_nan=False)
    int8: float = Field(ge=0.0, allow_inf_nan=False)
    int4: float = Field(ge=0.0, allow_inf_nan=False)


class ProfileConfig(_Strict):
    """How ``metasd serve`` profiles the verifier's forward cost at start (``metasd.core.pricing.forward_profile``)."""

    #: forward sizes timed (tokens in all, padding included); None: profile_forward's default
    token_counts: list[Int] | None = None
    max_seconds: float = Field(5.0, gt=0.0, allow_inf_nan=False)  # the profiling's time budget

    @field_validator("token_counts")
    @classmethod
    def _counts(cls, counts: list[int] | None) -> list[int] | None:
        if counts is not None and (not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts)):
            raise ValueError(f"token_counts must be distinct integers >= 1, at least one, got {counts}")
        return counts


class ServingConfig(_Strict):
    """How ``metasd serve``'s scheduler speculates under load (docs/serving.md#adaptive-speculation): with
    ``adaptive``, each step's drafts are sized by the step allocator from the profiled forward cost and the arms'
    acceptance curves, and the policy sees the load (``metasd.core.batching.adaptive``)."""

    adaptive: Bool = False
    max_width: Int = Field(48, ge=0)  # most draft nodes per request per step
    price_drafting: Bool = False  # the allocator charges each arm's learnt drafting cost (AdaptiveSpeculation)
    #: how a step's drafting is priced (the allocator's and the reward's): its wall time in units of the profiled
    #: one-token forward ("measured"), or the engine meter's model of the drafters' forwards ("modeled")
    draft_cost: Literal["measured", "modeled"] = "measured"
    #: a step drafts only where the allocation's expected goodput is >= min_gain x a plain step's
    min_gain: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    #: while a request's model drafter has its prompt still to read, the allocator may let its arm's lookups draft
    #: alone (a cascade's suffix decoding: no catch-up); needs price_drafting
    defer_catch_up: Bool = False
    #: a probe's padded verify forward costs at most probe_stall x the forward of the step it replaces (every running
    #: request waits for it); null (the default): no bound (metasd.core.batching.probes)
    probe_stall: float | None = Field(None, ge=1.0, allow_inf_nan=False)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)

    @field_validator("defer_catch_up")
    @classmethod
    def _priced(cls, defer: bool, info) -> bool:
        if defer and not info.data.get("price_drafting", False):
            raise ValueError("defer_catch_up: true needs price_drafting: true (the catch-up it defers is priced only "
                             "then)")
        return defer


def _refers_to(kind: str) -> str:
    """The ``params`` key a drafter type names other entries by ('' when it has none or is unknown)."""
    try:
        return resolve_drafter_class(kind).refers_to or ""
    except ValueError:
        return ""


def select_entries(entries: list[dict], names: list[str]) -> list[dict]:
    """The pool-file entries (mappings) that keep only the ``names`` entries as arms: each one with ``arm: true``,
    after the entries it drafts with (a ``fused`` entry's ``arms``, recursively) kept as ``arm: false`` parts, in a
    valid order. Unknown names are the caller's to refuse."""
    by_name = {d.get("name"): d for d in entries if isinstance(d, dict)}
    out: dict[str, dict] = {}

    def add(name: str, arm: bool) -> None:
        entry = by_name[name]
        parts = (entry.get("params") or {}).get(_refers_to(str(entry.get("type")))) or []
        for part in parts if isinstance(parts, list) else []:
            if part in by_name and part not in out:
                add(part, False)
        arm = arm or (name in out and out[name]["arm"])
        out[name] = {k: v for k, v in entry.items() if arm or k != "budgets"}  # a part is no arm: no budgets
        out[name]["arm"] = arm

    for name in names:
        add(name, True)
    return list(out.values())


class PoolConfig(_Strict):
    """A pool: one verifier, named drafters (arms), and how the policy chooses among them."""

    verifier: VerifierConfig
    drafters: list[DrafterConfig] = Field(default_factory=list)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    reward: RewardName = "throughput"
    granularity: Literal["step", "request"] = "step"
    #: bandit: the policy learns from the chosen arm; full: also from what the others would have earned (counterfactuals)
    feedback: Literal["bandit", "full"] = "bandit"
    persistent: bool = False  # keep policy state across requests
    categories: list[str] = Field(default_factory=list)  # category one-hot layout for contextual policies
    plugins: list[str] = Field(default_factory=list)
    cost_model: CostModelConfig | None = None  # the throughput reward's prices (default: the device's calibration)
    #: add an arm "none" after the drafters' arms: an empty draft, i.e. plain decoding for that step
    no_speculation_arm: Bool = False
    #: the server's scheduler (``metasd serve``); ``metasd generate`` ignores it
    serving: ServingConfig = Field(default_factory=ServingConfig)

    @field_validator("drafters")
    @classmethod
    def _unique_names(cls, drafters: list[DrafterConfig]) -> list[DrafterConfig]:
        names = [d.name for d in drafters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"drafter names must be unique; repeated: {dup}")
        return drafters

    @property
    def arm_names(self) -> list[str]:
        """The arms the policy chooses among, in order: each ``arm: true`` entry (one per budget with ``budgets``), in
        file order, then "none" with ``no_speculation_arm``."""
        return [n for d in self.drafters for n in d.arm_names()] + (["none"] if self.no_speculation_arm else [])

    @property
    def n_arms(self) -> int:
        """Arms the policy chooses among (``arm_names``)."""
        return len(self.arm_names)

    @model_validator(mode="after")
    def _types_exist(self) -> "PoolConfig":
        """Drafter types and policy names exist; every ``params`` mapping is valid for its class (names, types,
        ranges: ``Drafter.Params``; built-in policies are constructed once, without any model). All problems
        are reported together, each under its own field path (``drafters.0.params.k``)."""
        errors: list[dict[str, Any]] = []
        try:
            import_plugins(self.plugins)
        except ValueError as e:
            errors.append(line_error(("plugins",), str(e).removeprefix("plugins: "), self.plugins))
        for i, d in enumerate(self.drafters):
            where = f"drafters.{i}.type"
            try:
                cls = resolve_drafter_class(d.type, where=where)
            except ValueError as e:
                errors.append(line_error(("drafters", i, "type"), str(e).removeprefix(f"{where}: "), d.type))
                continue
            for fld, noun in (("model", "a model reference"), ("checkpoint", "a checkpoint")):
                rule, given = getattr(cls, f"{fld}_field", None), getattr(d, fld) is not None
                if rule == "required" and not given:
                    errors.append(line_error(("drafters", i, fld), f"drafter type {d.type!r} needs {noun}", None))
                elif rule == "never" and given:
                    errors.append(line_error(("drafters", i, fld), f"drafter type {d.type!r} takes no {fld}", getattr(d, fld)))
            if d.tokenizer == "own" and not cls.cross_tokenizer:
                errors.append(line_error(("drafters", i, "tokenizer"),
                                         f"drafter type {d.type!r} cannot draft with a tokenizer of its own; types that "
                                         f"can: {', '.join(cross_tokenizer_types())}", d.tokenizer))
            d.params = validate_params(cls, d.params, ("drafters", i, "params"), errors,
                                        skip=("self", "name", "model", "tokenizer", "model_ref"))
            referred = d.params.get(cls.refers_to) if cls.refers_to else None
            if isinstance(referred, list):
                earlier = [e.name for e in self.drafters[:i]]
                missing = [n for n in referred if n not in earlier]
                if missing:
                    errors.append(line_error(("drafters", i, "params", cls.refers_to),
                                             f"{missing} are not earlier entries of the pool (entries before it: "
                                             f"{earlier})", referred))
        try:
            cls = resolve_policy_class(self.policy.name, where="policy.name")
        except ValueError as e:
            errors.append(line_error(("policy", "name"), str(e).removeprefix("policy.name: "), self.policy.name))
        else:
            n_before = len(errors)
            validate_params(cls, self.policy.params, ("policy", "params"), errors, skip=("self", "n_arms", "seed"))
            if len(errors) == n_before and cls.__module__.startswith("metasd.policies."):
                self._probe_policy(cls, errors)
        unused = [d.name for d in self.drafters if not d.arm and not any(
            d.name in (e.params.get(_refers_to(e.type)) or []) for e in self.drafters)]
        if unused:
            errors.append(line_error(("drafters",), f"entries {unused} have arm: false and no entry drafts with them",
                                     unused))
        for i, d in enumerate(self.drafters):
            if d.budgets is not None and not d.arm:
                errors.append(line_error(("drafters", i, "budgets"), "budgets makes the entry one arm per budget; it "
                                         "cannot be given with arm: false", d.budgets))
        names = self.arm_names
        repeated = sorted({n for n in names if names.count(n) > 1} - {"none"})
        if repeated:
            errors.append(line_error(("drafters",), f"arm names must be unique; repeated: {repeated} (an entry "
                                     f"'name' with budgets gives the arms 'name@budget')", repeated))
        if self.no_speculation_arm:
            reserved = [i for i, d in enumerate(self.drafters) if d.name == "none"]
            for i in reserved:
                errors.append(line_error(("drafters", i, "name"), "'none' is the no-speculation arm's name (the pool "
                                         "sets no_speculation_arm: true); rename this entry", "none"))
        if not any(d.arm for d in self.drafters) and self.drafters:
            errors.append(line_error(("drafters",), "no entry is an arm (arm: false on every one)", None))
        if self.feedback == "full" and self.reward in REWARDS and not REWARDS[self.reward].counterfactual_values:
            errors.append(line_error(("feedback",), f"feedback 'full' needs a reward other arms can be scored by without "
                                     f"running them (throughput or block_efficiency); reward is {self.reward!r}",
                                     self.feedback))
        if self.reward not in REWARDS:  # guarded by Literal; kept for user-registered rewards
            errors.append(line_error(("reward",), f"unknown {self.reward!r}; choose one of {sorted(REWARDS)}", self.reward))
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def _probe_policy(self, cls: type[Policy], errors: list[dict[str, Any]]) -> None:
        """Build a built-in policy as ``build_engine`` will (cheap: no model) so that a bad value, or a policy that
        needs rewards in [0, 1] with an unbounded reward, is refused now and not after the models load."""
        try:
            probe = make_policy(cls, max(self.n_arms, 1), seed=self.policy.seed, **self.policy.params)
        except (TypeError, ValueError) as e:
            errors.append(line_error(("policy", "params"), str(e), self.policy.params))
            return
        # the engine uses the policy only with several drafters, and checks the reward then (Engine._check_policy)
        if self.n_arms > 1 and self.reward not in BOUNDED_REWARDS and getattr(probe, "requires_bounded_rewards", False):
            errors.append(line_error(("reward",), f"policy {self.policy.name!r} (as configured) needs rewards in [0, 1]; "
                                      f"{self.reward!r} is unbounded: use one of {sorted(BOUNDED_REWARDS)}",
                                      self.reward))
