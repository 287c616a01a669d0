"""The package's shape: layers that import one way (import-linter's contracts in pyproject.toml, checked on the
installed layout), no import cycles, a core without function-level imports, ``import metasd`` without the experiment
layer's heavy dependencies, and no package file over 450 lines."""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from lint_imports import installed_layout  # noqa: E402

needs_linter = pytest.mark.skipif(importlib.util.find_spec("importlinter") is None,
                                  reason="import-linter is not installed (pip install -e '.[dev]')")


def _lint(layout: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
           str(ROOT / "pyproject.toml"), "--no-cache"]
    return subprocess.run(cmd, cwd=layout, env={"PYTHONPATH": str(layout), "PATH": ""}, capture_output=True, text=True)


@needs_linter
def test_the_installed_layout_keeps_every_import_contract(tmp_path):
    result = _lint(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout
    assert (tmp_path / "metasd" / "drafters" / "pretrained.py").is_file()  # the mapped packages are in the layout


@needs_linter
def test_a_lower_layer_importing_a_higher_one_breaks_the_contracts(tmp_path):
    layout = installed_layout(tmp_path)
    with open(layout / "metasd" / "core" / "tree.py", "a") as f:  # the core reaching up to pool files
        f.write("\n\ndef _reaches_up():\n    from metasd.config import load_pool  # noqa: F401\n")
    result = _lint(layout)
    assert result.returncode != 0
    assert "metasd.core.tree -> metasd.config" in result.stdout
    assert "The decoding core imports no YAML, MLflow or Ray BROKEN" in result.stdout  # config reads YAML
    assert "No import cycles, at any depth BROKEN" in result.stdout  # config imports the core


def test_the_core_has_no_function_level_imports():
    found = []
    for path in sorted((ROOT / "metasd" / "core").glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.name}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not found, f"imports inside functions of metasd/core: {found}"


def test_import_metasd_leaves_the_study_layer_and_its_dependencies_alone():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import metasd"], capture_output=True, text=True,
                         check=True).stderr
    modules = {line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.startswith("import time:")}
    assert "metasd.core.engine" in modules  # the parse reads the real list
    heavy = sorted(m for m in modules if m.split(".")[0] in ("mlflow", "ray", "fastapi", "uvicorn", "prometheus_client")
                   or m.startswith(("metasd.bench", "metasd.training", "metasd.serve")))
    assert not heavy, f"import metasd imports {heavy}"


def test_no_package_file_is_over_450_lines():
    files = [p for d in ("metasd", "drafters", "policies") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"files over 450 lines: {long}"


def test_the_top_of_metasd_holds_only_its_subpackages_and_the_cli():
    top = sorted(p.name for p in (ROOT / "metasd").iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "cli.py"]
    for package in (p for p in (ROOT / "metasd").iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc, f"metasd/{package.name}/__init__.py has no docstring saying what the layer is for"
