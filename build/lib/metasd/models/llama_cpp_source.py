"""llama.cpp's source and GGUF conversion: what the llama.cpp verifier backend and the llama.cpp benchmarks share.

- ``fetch_source`` downloads the ``llama-cpp-python`` sdist of ``LLAMA_CPP_PYTHON_VERSION`` (the package registry is
  the one source this project may reach; the sdist vendors llama.cpp's source, its ``convert_hf_to_gguf.py`` and
  ``gguf-py`` included) and unpacks it under ``llama_cpp_dir()``, once;
- ``converted_gguf`` converts a model's cached safetensors (a bundled model, prepared, or a local HF directory) with
  llama.cpp's own ``convert_hf_to_gguf.py`` - the very weights metasd's torch runs load - once, cached by name;
- ``convert_to_gguf`` is the conversion itself; ``vocab=False`` writes no tokenizer (``tokenizer.ggml.model =
  "none"`` and the vocabulary size only): metasd tokenizes with the model's Hugging Face tokenizer and hands llama.cpp
  token ids, so a model whose pre-tokenizer the converter does not know still runs.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from metasd.models.bundled import BUNDLED_PREFIX, cache_dir, prepared_dir

__all__ = ["LLAMA_CPP_PYTHON_VERSION", "LlamaCppError", "convert_to_gguf", "converted_gguf", "fetch_source",
           "llama_cpp_dir", "run_logged", "source_dir"]

#: the llama-cpp-python release whose vendored llama.cpp is built and whose converter is run (the backend's extra pins
#: the same release)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Run as ``python -c`` with argv [source dir, converter arguments...]: the converter, its model class given a
# ``set_vocab`` that writes no tokenizer (metasd feeds llama.cpp token ids from the Hugging Face tokenizer).
_NO_VOCAB_DRIVER = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion
import convert_hf_to_gguf

_model_class = conversion.get_model_class

def _without_vocab(name, mmproj=False):
    cls = _model_class(name, mmproj)
    if mmproj:
        return cls

    class WithoutVocab(cls):
        model_arch = cls.model_arch

        def set_vocab(self):
            self.gguf_writer.add_tokenizer_model("none")
            self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

    return WithoutVocab

convert_hf_to_gguf.get_model_class = _without_vocab
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


class LlamaCppError(RuntimeError):
    """llama.cpp's source could not be fetched, a conversion or tool failed, or a tool printed what could not be
    read."""


def llama_cpp_dir() -> Path:
    """Where the llama.cpp source, build and GGUF files live: ``<metasd cache>/llama.cpp``."""
    return cache_dir() / "llama.cpp"


def source_dir(root: Path | None = None) -> Path:
    """llama.cpp's source tree inside the unpacked sdist (``fetch_source`` puts it there)."""
    root = Path(root) if root is not None else llama_cpp_dir()
    return root / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"


def run_logged(cmd: list[str], log: Path, **kwargs) -> None:
    """Run ``cmd`` with its output appended to ``log``; a failure names the command and the log."""
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode != 0:
        raise LlamaCppError(f"{Path(cmd[0]).name} failed (exit {done.returncode}); see {log}")


def fetch_source(root: Path | None = None) -> Path:
    """llama.cpp's source directory, downloaded (``pip download`` of the sdist) and unpacked once."""
    root = Path(root) if root is not None else llama_cpp_dir()
    src = source_dir(root)
    if (src / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / "sdist"
    run_logged([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "--no-binary", "llama-cpp-python", "--no-deps", "-d", str(sdist)], root / "fetch.log")
    archive = next(sdist.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"), None)
    if archive is None:
        raise LlamaCppError(f"pip downloaded no llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz into {sdist}")
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")
    return src


def convert_to_gguf(model_dir: Path, out: Path, outtype: str = "bf16", vocab: bool = True,
                    root: Path | None = None) -> Path:
    """Convert the Hugging Face model in ``model_dir`` to ``out`` with llama.cpp's ``convert_hf_to_gguf.py``
    (``outtype``: bf16, f16, f32, q8_0). Written to a partial file first: ``out`` exists only when complete."""
    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").is_file():
        raise LlamaCppError(f"{model_dir}: not a Hugging Face model directory (no config.json) to convert")
    root = Path(root) if root is not None else llama_cpp_dir()
    src = fetch_source(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    args = [str(model_dir), "--outtype", outtype, "--outfile", str(partial)]
    if vocab:
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), *args]
    else:
        cmd = [sys.executable, "-c", _NO_VOCAB_DRIVER, str(src), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    try:
        run_logged(cmd, root / "convert.log", env=env)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def _gguf_name(ref: str, kind: str) -> str:
    return f"{ref.removeprefix(BUNDLED_PREFIX)}-{kind}.gguf"


def _fingerprint(model_dir: Path) -> str:
    """A local model directory's identity for the GGUF cache: its path and its files' names, sizes and modification
    times (another model in a directory of the same name, or the same directory rewritten, converts afresh)."""
    h = hashlib.sha256(str(model_dir).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:12]


def converted_gguf(ref: str, outtype: str = "bf16", root: Path | None = None, vocab: bool = True) -> Path:
    """``ref``'s cached safetensors (a bundled model, prepared, or a local HF directory) converted to a GGUF of
    ``outtype`` - the same weights metasd loads; converted once (a minute or two for the 1.5B), then read from
    ``<llama_cpp_dir>/gguf``. A local directory's GGUF is named after the directory and its files (``_fingerprint``); ``vocab=False``: without a
    tokenizer (``convert_to_gguf``), a file of its own."""
    root = Path(root) if root is not None else llama_cpp_dir()
    kind = outtype if vocab else f"{outtype}-novocab"
    if ref.startswith(BUNDLED_PREFIX):
        model_dir, name = prepared_dir(ref), _gguf_name(ref, kind)
        if model_dir is None:
            raise LlamaCppError(f"{ref}: no prepared model directory to convert (run `metasd models prepare` first)")
    else:
        model_dir = Path(ref).expanduser().resolve()
        name = f"{model_dir.name}-{_fingerprint(model_dir)}-{kind}.gguf"
    out = root / "gguf" / name
    if out.is_file():
        return out
    return convert_to_gguf(model_dir, out, outtype, vocab=vocab, root=root)
