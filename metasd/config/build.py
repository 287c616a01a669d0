"""Building an engine from a pool file: read and validate it, check its model references and quantization before
anything loads, load each model once (``ModelCache``), build each drafter and the policy, compose the ``Engine``."""
from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Any

from metasd.core import engine as _engine
from metasd.core.pricing.cost import CostModel
from metasd.core.decoding.drafter import BuildContext
from metasd.core.engine import Engine
from metasd.core.decoding.policy import Policy, make_policy
from metasd.core.execution.verifier import Verifier
from metasd.drafters.budgeted import NoSpeculation, budget_arms
from metasd.models import (ModelLoadError, check_model_reference, check_quantize, load_model, load_model_shape,
                           resolve_device, resolve_dtype, resolve_model)

from .files import ConfigError, read_yaml_mapping, validate_config
from .plugins import resolve_drafter_class, resolve_policy_class
from .schema import LLAMA_CPP_DTYPES, PolicyConfig, PoolConfig, VerifierConfig

DEFAULT_POOL = "default.yaml"
#: the embedded default where the verifier runs on CUDA: fixed-shape drafting and verifying, replayed from CUDA graphs
GPU_DEFAULT_POOL = "gpu_default.yaml"
#: the embedded pools a ``--pool`` may name instead of a path
EMBEDDED_POOLS = {"default": DEFAULT_POOL, "gpu_default": GPU_DEFAULT_POOL}


def default_pool_path(device: str | None = None) -> Path:
    """The embedded default pool for ``device`` (default: where a pool's verifier runs without a ``device``: CUDA
    where it is available): on CUDA ``configs/gpu_default.yaml`` (the bundled Qwen pair: a suffix + 0.5B static-tree
    cascade, drafting loop and verify forwards captured), elsewhere ``configs/default.yaml`` (a suffix + int4 0.5B
    dynamic-tree cascade)."""
    cuda = resolve_device(device).type == "cuda"
    return embedded_pool_path("gpu_default" if cuda else "default")


def embedded_pool_path(name: str) -> Path:
    """The file of an embedded pool named in ``EMBEDDED_POOLS``."""
    return Path(str(resources.files("metasd.configs") / EMBEDDED_POOLS[name]))


def default_pool_choice(device: str | None = None) -> str:
    """What ``default_pool_path`` chose and why, for a log line."""
    path = default_pool_path(device)
    if path.name == GPU_DEFAULT_POOL:
        return f"the embedded GPU default pool (configs/{path.name}: CUDA is here; --pool default for the CPU one)"
    return f"the embedded default pool (configs/{path.name}: no CUDA device; --pool gpu_default for the GPU one)"


def pool_argument(pool: str | None) -> str | None:
    """A ``--pool`` value as a file: an embedded pool's name (``EMBEDDED_POOLS``) unless a file of that name exists."""
    if pool in EMBEDDED_POOLS and not Path(pool).exists():
        return str(embedded_pool_path(pool))
    return pool


#: ``metasd serve``'s pool when none is given: the default cascade as budget arms with adaptive speculation
DEFAULT_SERVE_POOL = "pools/serve_adaptive.yaml"


def default_serve_pool_path() -> Path:
    """The embedded pool ``metasd serve`` runs without ``--pool`` (``configs/pools/serve_adaptive.yaml``: the default
    pool's cascade as budget arms, sized to the load by adaptive speculation)."""
    return Path(str(resources.files("metasd.configs") / DEFAULT_SERVE_POOL))


def read_pool_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PoolConfig:
    """Parse and validate a pool file (default: the embedded one for the device, ``default_pool_path``, logged);
    ``overrides`` replace top-level keys."""
    if path is None:  # chosen by the device the verifier runs on (an override may name it)
        verifier = (overrides or {}).get("verifier")
        device = verifier.get("device") if isinstance(verifier, dict) else None
        logging.getLogger("metasd").info("pool: %s", default_pool_choice(device))
        path = default_pool_path(device)
    path = Path(path)
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
        """(model, tokenizer); ``drafter``: a quantized drafter keeps its dense weights for many-row inputs (never a
        verifier: ``metasd.models.quantize``)."""
        prefill_copy = drafter and quantize != "none"
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


def build_verifier(config: VerifierConfig, models: ModelCache):
    """The verifier of a pool's ``verifier`` entry: a ``Verifier`` over the torch model, or - ``backend: llama.cpp`` -
    a ``LlamaCppVerifier`` over a GGUF of the same weights (converted once; a ``.gguf`` model as it is)."""
    if config.backend == "torch":
        v_model, v_tok = models.load(config.model, config.dtype, config.quantize)
        return Verifier(v_model, v_tok, name=config.model, graphs=config.graphs)
    from metasd.core.execution.llama_cpp_verifier import LlamaCppVerifier, llama_cpp_module
    from metasd.models.llama_cpp_source import converted_gguf

    llama_cpp_module()  # the extra's absence named before any model loads or converts
    src = resolve_model(config.model)
    if src.kind == "hub":
        raise ConfigError(f"verifier.model {config.model!r}: backend 'llama.cpp' runs a bundled model, a local model "
                          "directory or a .gguf file")
    shape, tokenizer = load_model_shape(config.model, "bf16" if config.dtype == "auto" else config.dtype)
    if src.kind == "gguf":
        gguf = Path(src.path) / src.gguf_file
    else:
        # a bundled model's GGUF carries its tokenizer (llama.cpp's own tools run it too); a local directory's none,
        # so that any tokenizer converts: metasd tokenizes with the Hugging Face tokenizer and feeds llama.cpp ids
        bundled = src.kind == "bundled"
        gguf = converted_gguf(config.model if bundled else str(src.path), LLAMA_CPP_DTYPES[config.dtype], vocab=bundled)
    return LlamaCppVerifier(gguf, shape, tokenizer, name=config.model, threads=config.threads, context=config.context)


def build_engine(config: PoolConfig, base_dir: Path | None = None, models: ModelCache | None = None, **engine_kwargs):
    """Load the models of a validated pool config and compose the engine."""
    try:
        check_quantization(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    models = models or ModelCache(config.verifier.device)
    verifier = build_verifier(config.verifier, models)
    drafters = []  # the arms the policy chooses among
    built: dict[str, Any] = {}  # every entry, by name (entries that others draft with included)
    for i, d in enumerate(config.drafters):
        cls = resolve_drafter_class(d.type, where=f"drafters.{i}.type")
        checkpoint = d.checkpoint
        if checkpoint and base_dir is not None and not Path(checkpoint).is_absolute():
            checkpoint = str((base_dir / checkpoint).resolve())
        dtype = d.dtype or config.verifier.dtype
        def load(ref, quantize=None, _dtype=dtype, _quantize=d.quantize):
            return models.load(ref, _dtype, _quantize if quantize is None else quantize, drafter=True)

        if cls.verifier_weights and verifier.backend != "torch":
            raise ConfigError(f"drafters.{i} ({d.name!r}): type {d.type!r} reads the verifier's torch weights, which "
                              f"the {config.verifier.backend} backend does not have (use verifier: {{backend: torch}})")
        build = BuildContext(verifier=verifier, model=d.model, checkpoint=checkpoint, load_model=load,
                             quantize=d.quantize, tokenizer=d.tokenizer, pool=dict(built), base_dir=base_dir)
        try:
            drafter = cls.from_config(d.name, dict(d.params), build)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"drafters.{i} ({d.name!r}): {e}") from e
        built[d.name] = drafter
        if d.arm and d.budgets is not None:  # one arm per budget, all drafting with this one drafter
            drafters.extend(budget_arms(drafter, d.budgets))
        elif d.arm:
            drafters.append(drafter)
    if config.no_speculation_arm:
        drafters.append(NoSpeculation())
    policy = make_policy_from_config(config.policy, len(drafters))
    if config.cost_model is not None:
        engine_kwargs.setdefault("cost_model", CostModel(config.cost_model.model_dump()))
    return Engine(verifier, drafters, policy if len(drafters) > 1 else None, granularity=config.granularity,
                  reward=config.reward, persistent_policy=config.persistent, categories=config.categories,
                  feedback=config.feedback, **engine_kwargs)


def make_policy_from_config(policy: PolicyConfig, n_arms: int) -> Policy:
    cls = resolve_policy_class(policy.name)
    try:
        return make_policy(cls, max(n_arms, 1), seed=policy.seed, **policy.params)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"policy ({policy.name!r}): {e}") from e


def load_pool(path: str | Path | None = None, overrides: dict[str, Any] | None = None, **engine_kwargs):
    """Read a pool file (default: the embedded default pool) and build its ``Engine``."""
    config = read_pool_config(path, overrides)
    base = Path(path).resolve().parent if path is not None else None
    if engine_kwargs.get("models") is None:  # a caller's own ModelCache may hold models under any name
        check_model_references(config, str(path) if path is not None else "default pool", base)
    return build_engine(config, base, **engine_kwargs)


_engine.set_pool_loader(load_pool)  # Engine.from_config reads pool files through this layer
