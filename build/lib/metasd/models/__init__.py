"""Models: loading verifiers and drafters from a reference, the bundled-model cache, devices and dtypes, weight-only
quantization, packed checkpoint weights and reduced draft vocabularies. Builds on ``metasd.core``; knows nothing of
pool files, experiments or training.

>>> from metasd.models import load_model
>>> model, tokenizer = load_model("bundled:qwen2.5-coder-0.5b-instruct", quantize="int4")
"""
from metasd.core.decoding.tokens import (TokenizerMismatchError, check_tokenizers_compatible, config_eos_ids,
                                         eos_token_ids)

from .bundled import bundled_status, cache_dir, needs_preparing, prepare_bundled
from .catalog import BUNDLED, BUNDLED_PREFIX, BundledModel, bundled_names
from .devices import cpu_has_native_bf16, resolve_device, resolve_dtype
from .errors import ModelLoadError
from .gguf import load_gguf
from .loading import (ModelSource, check_model_reference, context_length, load_model, load_model_shape, load_tokenizer,
                      local_config_dir, resolve_model)
from .quantize import QuantizedLinear, check_quantize, quantize_model

__all__ = [
    "BUNDLED", "BUNDLED_PREFIX", "BundledModel", "ModelLoadError", "ModelSource", "QuantizedLinear",
    "TokenizerMismatchError", "bundled_names", "bundled_status", "cache_dir", "check_model_reference", "check_quantize",
    "check_tokenizers_compatible", "config_eos_ids", "context_length", "cpu_has_native_bf16", "eos_token_ids", "load_gguf", "load_model",
    "load_model_shape", "load_tokenizer", "local_config_dir", "needs_preparing", "prepare_bundled", "quantize_model", "resolve_device", "resolve_dtype", "resolve_model",
]
