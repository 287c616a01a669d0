"""Several processes on one MLflow store: bounded retries while SQLite is locked, a lock file around creating a
store, and an owner tag so that a run another live process writes is not resumed (``metasd.bench.tracking`` uses
these; ``tests/test_faults.py`` injects each fault)."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: retries of an MLflow call while SQLite reports the database locked (backoff 0.1 s doubling to 2 s: ~20 s in all)
LOCKED_RETRIES = 12


class StoreBusyError(RuntimeError):
    """The MLflow store stayed locked by other writers through every retry."""


class RunInUseError(ValueError):
    """``--resume`` / ``--run-id`` of a parent run that another live ``metasd bench`` process is writing."""


OWNER_TAG = "metasd.owner"


def _process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``; "" elsewhere): with the pid
    it names one process, so a pid reused by an unrelated process is not taken for the writer."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def owner_token(pid: int | None = None) -> str:
    """``host:pid:start`` of this (or another local) process, recorded on the parent run it writes."""
    import socket

    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_process_start(pid)}"


def owner_alive(token: str) -> bool:
    """Whether the process named by ``owner_token`` still runs (False for another host: it cannot be checked)."""
    import socket

    host, _, rest = token.partition(":")
    pid_s, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_s.isdigit() or int(pid_s) == os.getpid():
        return False
    try:
        os.kill(int(pid_s), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    return not start or _process_start(int(pid_s)) == start


def _is_locked_error(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if "database is locked" in text or "database table is locked" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def call_with_retry(uri: str, what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, retried while SQLite says the database is locked (another process is writing).

    SQLite lets one writer at a time in; a writer that waits longer than the driver's busy timeout gets
    ``database is locked`` and its transaction is rolled back, so calling again is safe. Bounded: after
    ``LOCKED_RETRIES`` tries (backoff 0.1 s doubling up to 2 s, with jitter) ``StoreBusyError`` names the store.
    """
    delay = 0.1
    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not _is_locked_error(e):
                raise
            if attempt == LOCKED_RETRIES:
                raise StoreBusyError(
                    f"MLflow store {uri} stayed locked by another writer through {LOCKED_RETRIES + 1} tries of {what} "
                    f"({e}); run fewer concurrent `metasd bench` processes on one SQLite store, or use an MLflow server"
                ) from e
            logger.info("%s: %s is locked, retrying in %.2f s", what, uri, delay)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(2 * delay, 2.0)


class RetryingClient:
    """An ``MlflowClient`` whose every method call goes through ``call_with_retry``."""

    def __init__(self, client, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return call_with_retry(self._uri, name, attr, *args, **kwargs)

        return call


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores and in-memory SQLite)."""
    if not uri.startswith("sqlite:///") or uri in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


@contextlib.contextmanager
def store_lock(uri: str):
    """Exclusive lock (POSIX flock on ``<database>.lock``) around what two processes must not do at once on one
    SQLite store: create and migrate its tables (two processes doing it at once fail with alembic errors) and
    find-or-create an experiment. A no-op for other stores or where fcntl is unavailable."""
    db = _sqlite_path(uri)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    if db is None or fcntl is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
