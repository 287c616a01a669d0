"""The package's shape: layers that import one way (import-linter's contracts in pyproject.toml, checked on the
installed layout), no import cycles, a core without function-level imports, ``import metasd`` without the experiment
layer's heavy dependencies (the ``bench`` extra's MLflow and matplotlib: without them the CLI works and ``metasd bench``
says which extra to install), and no package file over 450 lines."""
import ast
import importlib.util
import json
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
    assert "4 kept, 0 broken" in result.stdout
    assert (tmp_path / "metasd" / "drafters" / "pretrained.py").is_file()  # the mapped packages are in the layout


@needs_linter
def test_a_lower_layer_importing_a_higher_one_breaks_the_contracts(tmp_path):
    layout = installed_layout(tmp_path)
    with open(layout / "metasd" / "core" / "execution" / "tree.py", "a") as f:  # the core reaching up to pool files
        f.write("\n\ndef _reaches_up():\n    from metasd.config import load_pool  # noqa: F401\n")
    result = _lint(layout)
    assert result.returncode != 0
    assert "metasd.core.execution.tree -> metasd.config" in result.stdout
    assert "The decoding core imports no YAML, MLflow or Ray BROKEN" in result.stdout  # config reads YAML
    assert "No import cycles, at any depth BROKEN" in result.stdout  # config imports the core


@needs_linter
@pytest.mark.parametrize("lower, higher, imported", [
    ("execution/kv_cache.py", "decoding", "from metasd.core.decoding.sampling import SamplingParams"),
    ("execution/verifier.py", "pricing", "from metasd.core.pricing.cost import CostModel"),
    ("decoding/request.py", "pricing", "from metasd.core.pricing.goodput import shared_step_cost"),
    ("pricing/allocator.py", "batching", "from metasd.core.batching.scheduler import Scheduler"),
])
def test_inside_the_core_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path, lower, higher, imported):
    layout = installed_layout(tmp_path)
    with open(layout / "metasd" / "core" / lower, "a") as f:
        f.write(f"\n\ndef _reaches_up():\n    {imported}  # noqa: F401\n")
    result = _lint(layout)
    assert result.returncode != 0
    module = "metasd.core." + lower.removesuffix(".py").replace("/", ".")
    assert f"{module} -> metasd.core.{higher}" in result.stdout, result.stdout
    assert "Inside the core: the engine over running many" in result.stdout and "BROKEN" in result.stdout


def test_the_core_is_split_into_its_layers():
    core = ROOT / "metasd" / "core"
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py", "engine.py"]
    assert sorted(p.name for p in core.iterdir() if (p / "__init__.py").is_file()) == [
        "batching", "constraints", "decoding", "execution", "pricing"]


def test_the_core_has_no_function_level_imports():
    found = []
    for path in sorted((ROOT / "metasd" / "core").rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(fn)
                          if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not found, f"imports inside functions of metasd/core: {found}"


def test_import_metasd_leaves_the_study_layer_and_its_dependencies_alone():
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import metasd"], capture_output=True, text=True,
                         check=True).stderr
    modules = {line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.startswith("import time:")}
    assert "metasd.core.engine" in modules  # the parse reads the real list
    heavy = sorted(m for m in modules
                   if m.split(".")[0] in ("mlflow", "matplotlib", "ray", "fastapi", "uvicorn", "prometheus_client")
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


# Run in a fresh interpreter: mlflow and matplotlib look uninstalled (find_spec gives None, import raises
# ModuleNotFoundError), as in an install without the 'bench' extra; then each command's exit code and output.
_WITHOUT_BENCH_EXTRA = """
import contextlib, importlib.machinery, io, json, sys
_find = importlib.machinery.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] in ("mlflow", "matplotlib") else _find(cls, name, path, target)
importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
from metasd.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue(),
                      "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("mlflow", "matplotlib"))}))
"""


def test_without_the_bench_extra_the_cli_works_and_bench_names_the_extra():
    commands = [["--help"], ["generate", "--help"], ["bench", "--help"], ["bench", str(ROOT / "experiments" / "smoke.yaml")]]
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_BENCH_EXTRA, json.dumps(commands)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["argv"] for r in results] == commands
    top, generate, bench_help, bench = results
    assert top["code"] == 0 and "generate" in top["out"] and "bench" in top["out"]
    assert generate["code"] == 0 and "--max-new-tokens" in generate["out"]
    assert bench_help["code"] == 0 and "experiment" in bench_help["out"]
    assert bench["code"] == 2, bench
    assert "'bench' extra" in bench["err"] and "pip install 'metasd[bench]'" in bench["err"], bench["err"]
    assert "mlflow" in bench["err"] and "Traceback" not in bench["err"]
    assert all(not r["loaded"] for r in results), results  # the blocker held: nothing of either was imported


def test_a_trainer_that_logs_to_mlflow_names_the_extra_before_it_loads_anything(monkeypatch):
    from metasd.config.tracking import MissingExtraError
    from metasd.training.common import require_tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    require_tracking(False)  # logging off: MLflow is not needed
    with pytest.raises(MissingExtraError, match=r"'bench' extra .*pip install 'metasd\[bench\]'") as e:
        require_tracking(True)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ImportError)  # the CLI's exit 2; an ImportError
