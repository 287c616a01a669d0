"""GGUF files as plain transformers models: every weight dequantized at load, the GGUF quantizer dropped."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def gguf_quantization_config():
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_gguf(path: Path, dtype: torch.dtype):
    """Load a GGUF file as a plain (dequantized) transformers model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, **gguf_quantization_config()
    )
    drop_gguf_quantizer(model)
    return model, tok


def drop_gguf_quantizer(model) -> None:
    """A dequantized GGUF model is a plain dense model: drop the GGUF quantizer so it behaves (and saves) as one."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    if getattr(model, "quantization_method", None) is not None:
        with contextlib.suppress(AttributeError):
            model.quantization_method = None
