"""The marker of a converted bundled-model cache directory: what makes a cache complete and intact.

The marker (``CACHE_MARKER``, written last) names the source GGUF and lists every converted file with its
size, sha256 and mtime. ``cache_problem`` checks a directory against it cheaply enough for every load (sizes
and mtimes; a file is hashed only when its mtime changed); ``write_marker`` writes it after fsyncing the
files it vouches for; ``upgrade_marker`` gives a cache written by an older metasd (format 1) the file list.
Used by ``metasd.models.bundled``, which assembles, converts and locks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .catalog import BundledModel

logger = logging.getLogger(__name__)

#: file written last into a cache directory; its presence (with matching content) marks it complete
CACHE_MARKER = "metasd_cache.json"
#: 2: the marker also lists every converted file with its size, sha256 and mtime (format 1 did not; a format-1
#: cache is upgraded in place by hashing its files once, see ``upgrade_marker``)
CACHE_FORMAT = 2
#: dtype of the cached safetensors copy of a bundled model
CACHE_DTYPE = torch.bfloat16
_CHUNK = 8 * 1024 * 1024  # bytes read at a time while hashing


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def marker_matches(entry: BundledModel, marker: dict[str, Any], formats: tuple[int, ...] = (CACHE_FORMAT,)) -> bool:
    return (
        marker.get("format") in formats
        and marker.get("name") == entry.name
        and marker.get("sha256") == entry.sha256
        and marker.get("gguf_bytes") == entry.gguf_bytes
    )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_record(path: Path, digest: str | None = None) -> dict[str, Any]:
    st = path.stat()
    return {"bytes": st.st_size, "sha256": digest or sha256_file(path), "mtime_ns": st.st_mtime_ns}


def cache_problem(entry: BundledModel, path: Path) -> str | None:
    """Why the cache dir of ``entry`` cannot be loaded (None: it is complete and intact).

    The marker is written last and lists every converted file with its size, sha256 and mtime. Checking a
    cache must be cheap, because every load of a bundled model does it and the files are gigabytes: a file
    whose size differs from the marker's is damaged (truncated or overwritten) without reading it; a file of
    the recorded size *and* mtime is taken as intact without reading it; only a file of the right size whose
    mtime changed (touched, copied, or overwritten in place) is hashed in full, and when its sha256 still
    matches, its new mtime is recorded (``restamp``) so the next load is cheap again. A write that keeps both
    the size and the mtime is not detected; nothing in normal use does that.
    """
    marker = read_marker(path)
    if marker is None:
        return f"no readable {CACHE_MARKER} in {path}" if path.exists() else f"{path} does not exist"
    if not marker_matches(entry, marker):
        return f"{path / CACHE_MARKER} is for other contents (format {marker.get('format')}, sha256 {marker.get('sha256')})"
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return f"{path / CACHE_MARKER} lists no converted files"
    verified = {}  # file -> new mtime of a file whose hash still matches
    for rel, want in files.items():
        f = path / rel
        try:
            st = f.stat()
        except OSError:
            return f"{f} is missing"
        if st.st_size != want.get("bytes"):
            return f"{f} has {st.st_size:,} bytes, the marker recorded {want.get('bytes'):,} (truncated or overwritten)"
        if st.st_mtime_ns != want.get("mtime_ns"):
            digest = sha256_file(f)
            if digest != want.get("sha256"):
                return f"{f} was modified: its sha256 is {digest}, the marker recorded {want.get('sha256')}"
            verified[rel] = st.st_mtime_ns
    if verified:
        restamp(path, marker, verified)
    return None


def restamp(path: Path, marker: dict[str, Any], mtimes: dict[str, int]) -> None:
    """Record the new mtimes of files whose contents were just verified by hash (best effort: a read-only
    cache keeps working, it is only hashed again on the next load)."""
    for rel, mtime in mtimes.items():
        marker["files"][rel]["mtime_ns"] = mtime
    try:
        replace_marker(path, marker)
    except OSError as e:
        logger.info("could not record verified mtimes in %s: %s", path / CACHE_MARKER, e)


def cache_complete(entry: BundledModel, path: Path) -> bool:
    """A cache dir counts only if its marker (written last) matches this entry and its files are intact."""
    return cache_problem(entry, path) is None


def write_marker(out: Path, entry: BundledModel, digest: str) -> None:
    """Write the marker last: fsync every converted file, record its size, sha256 and mtime, then the marker."""
    import transformers

    try:
        from importlib.metadata import version

        metasd_version = version("metasd")
    except Exception:
        metasd_version = None
    files = {}
    for f in sorted(out.rglob("*")):  # the marker must never be on disk before the files it vouches for
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
            files[f.relative_to(out).as_posix()] = file_record(f)
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
        "files": files,
    }
    replace_marker(out, marker)


def replace_marker(out: Path, marker: dict[str, Any]) -> None:
    """Write the marker atomically (a unique temp file, fsync, rename)."""
    tmp = out / f"{CACHE_MARKER}.{os.getpid()}.part"
    with open(tmp, "w") as f:
        f.write(json.dumps(marker, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / CACHE_MARKER)


def upgrade_marker(entry: BundledModel, path: Path) -> bool:
    """Give a format-1 cache (its marker did not list the files) a format-2 marker by hashing its files once.

    A format-1 marker was written only after every file was fsynced, so the files were complete then; this
    records them as they are now, which spares a multi-minute reconversion. Call it while holding the lock.
    Returns False when the directory is not such a cache (then it is rebuilt).
    """
    marker = read_marker(path)
    if marker is None or not marker_matches(entry, marker, formats=(1,)) or not (path / "config.json").is_file():
        return False
    logger.warning("recording sizes and sha256 of the cached files of %s in %s (once)", entry.ref, path / CACHE_MARKER)
    marker["files"] = {f.relative_to(path).as_posix(): file_record(f) for f in sorted(path.rglob("*"))
                       if f.is_file() and f.name != CACHE_MARKER and not f.name.startswith(CACHE_MARKER + ".")}
    marker["format"] = CACHE_FORMAT
    replace_marker(path, marker)
    return True
