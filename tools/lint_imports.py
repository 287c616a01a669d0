"""Check metasd's import rules (the import-linter contracts in pyproject.toml) on the package as it is installed.

``drafters/`` and ``policies/`` live at the top of the repository and are installed as ``metasd.drafters`` and
``metasd.policies`` (pyproject's ``package-dir``), so the source tree is not the package tree import-linter must
see. This script copies the package's modules into a temporary folder in their installed layout, as a wheel would
place them, and runs ``lint-imports`` there. Exit status: lint-imports' own (0: every contract kept).

    python tools/lint_imports.py            # what .ci/run runs
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(dest: Path, root: Path = ROOT) -> Path:
    """Copy every Python module of the packages pyproject.toml lists into ``dest`` as they are installed;
    returns ``dest``."""
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})
    for package in setup["packages"]:
        # a package's folder: its own package-dir entry, else its parent's folder joined with its last name
        parts, source = package.split("."), None
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in package_dir:
                source = root / package_dir[prefix] / Path(*parts[i:])
                break
        source = source if source is not None else root / Path(*parts)
        target = dest / Path(*parts)
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, target / module.name)
    return dest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="metasd-layout-") as tmp:
        installed_layout(Path(tmp))
        env = dict(os.environ, PYTHONPATH=tmp + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
               str(ROOT / "pyproject.toml"), "--no-cache", *argv]
        return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
