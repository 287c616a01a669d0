"""Import metasd from this source checkout when it is not installed (a GPU machine gets a bare copy of the repository):
the installed layout maps ``metasd.drafters``, ``metasd.policies`` and ``metasd.configs`` to the folders
``drafters/``, ``policies/`` and ``configs/`` at the top of the repository (pyproject.toml's ``package-dir``).
``ensure()`` puts the checkout on ``sys.path`` if no ``metasd`` is found and adds a finder for those three, after
any other finder, so that an installed metasd (editable or not) is used as it is."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"metasd.drafters": ROOT / "drafters", "metasd.policies": ROOT / "policies", "metasd.configs": ROOT / "configs"}


class _CheckoutFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = MAPPING.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def ensure() -> None:
    if importlib.util.find_spec("metasd") is None:
        sys.path.insert(0, str(ROOT))
    if _CheckoutFinder not in sys.meta_path:
        sys.meta_path.append(_CheckoutFinder)


ensure()
