"""Name -> class registries (drafter types, policies) filled by class decorators, for the core and for plugins."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T", bound=type)


def registrar(registry: dict[str, type], key_attr: str, doc: str) -> Callable[[T], T]:
    """A class decorator that adds a class to ``registry`` under its ``key_attr`` (refusing a class without one)."""

    def register(cls: T) -> T:
        key = getattr(cls, key_attr, "")
        if not key:
            raise ValueError(f"{cls.__name__} has no {key_attr}")
        registry[key] = cls
        return cls

    register.__doc__ = doc
    return register
