"""The error of the model layer."""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A model reference could not be resolved or loaded (the message names the reference and the fix)."""
