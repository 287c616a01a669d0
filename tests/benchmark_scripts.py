"""The scripts under benchmarks/ imported as modules by their tests (they are not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str):
    """``benchmarks/<name>.py`` as the module ``name`` (registered in ``sys.modules`` so that the scripts can import
    one another, as ``serve_regret`` imports ``serve_load``)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
