"""Where MLflow writes, for ``metasd bench`` and ``metasd train`` alike: the tracking URI (an explicit one, else
``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory) and, for a SQLite store, the
artifacts beside the database (``mlartifacts/``) rather than MLflow's default ``./mlruns`` in the working directory.
Pure path logic: MLflow itself is imported only by the layers that log, and those check first that it is installed
(``require_extra``): MLflow and matplotlib come with the ``bench`` extra, not with the package itself."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def resolve_tracking_uri(uri: str | None = None) -> str:
    """``uri``, else $MLFLOW_TRACKING_URI, else ``sqlite:///mlflow.db`` in the working directory."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def artifact_location(uri: str, name: str) -> str | None:
    """For a SQLite store, the artifact location of experiment ``name``: ``mlartifacts/<name>`` beside the database
    (not in the working directory); None for other stores (the server decides)."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):])
    root = (db.parent if db.is_absolute() else Path.cwd() / db.parent).resolve() / "mlartifacts"
    return (root / re.sub(r"[^\w.\-]", "_", name)).as_uri()


class MissingExtraError(ImportError, ValueError):
    """A command or call needs an optional dependency group (a pip extra) that is not installed; the message names the
    extra and the command that installs it. A ValueError too, so the CLI reports it as a usage error (exit 2)."""


def require_extra(extra: str, what: str, *modules: str) -> None:
    """Raise ``MissingExtraError`` unless every top-level module in ``modules`` can be imported; ``what`` names the
    feature that needs them (``metasd bench``). Looks the modules up without importing them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed): "
                                f"pip install 'metasd[{extra}]' (in a clone: pip install -e '.[{extra}]')")
