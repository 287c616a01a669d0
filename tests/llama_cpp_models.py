"""Shared by the llama.cpp backend's tests: the extra's presence (``require_llama_cpp``) and tiny torch models
converted by llama.cpp's own converter to f32 GGUFs without a vocabulary (``gguf_of``)."""
from __future__ import annotations

import os

import pytest


def require_llama_cpp() -> None:
    """Skip the calling module where the ``llama-cpp`` extra is absent - except under ``METASD_REQUIRE_LLAMA_CPP=1``
    (``.ci/run`` installs the extra), where its absence fails the module."""
    if os.environ.get("METASD_REQUIRE_LLAMA_CPP") == "1":
        import llama_cpp  # noqa: F401
    else:
        pytest.importorskip("llama_cpp", reason="the llama-cpp extra (llama-cpp-python) is not installed")


def gguf_of(model, tmp_path_factory, name: str):
    """``model`` saved and converted by llama.cpp's converter to an f32 GGUF without a vocabulary."""
    from metasd.models.llama_cpp_source import convert_to_gguf

    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder / "hf")
    return convert_to_gguf(folder / "hf", folder / f"{name}.gguf", "f32", vocab=False)
