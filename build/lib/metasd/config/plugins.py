"""Plugin classes for pool and experiment files: drafter types and policies looked up by name in their registries (or
imported from ``package.module:ClassName``), and their ``params`` checked against the class's ``Params`` model."""
from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from pydantic import BaseModel, ValidationError

import metasd.drafters  # noqa: F401  (registers the built-in drafter types)
import metasd.policies  # noqa: F401  (registers the built-in policies)
from metasd.core.decoding.drafter import DRAFTERS, Drafter
from metasd.core.decoding.policy import POLICIES, Policy


def import_plugins(modules: list[str]) -> None:
    """Import the modules a pool file lists under ``plugins`` (classes that register themselves)."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"plugins: cannot import {mod!r}: {e}") from None


def _import_path(ref: str, where: str):
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{where}: cannot import {ref!r}: {e}") from None


def _resolve_class(name: str, where: str, registry: dict[str, type], base: type, what: str) -> type:
    if ":" in name:
        cls = _import_path(name, where)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{where}: {name!r} is not a {base.__module__}.{base.__name__} subclass")
        return cls
    if name not in registry:
        raise ValueError(f"{where}: unknown {what} {name!r}; registered: {sorted(registry)} "
                         "(or give package.module:ClassName)")
    return registry[name]


def resolve_drafter_class(kind: str, where: str = "type") -> type[Drafter]:
    """A registered drafter ``kind`` or a ``package.module:ClassName`` import path -> the Drafter class."""
    return _resolve_class(kind, where, DRAFTERS, Drafter, "drafter type")


def resolve_policy_class(name: str, where: str = "policy.name") -> type[Policy]:
    """A registered policy name or a ``package.module:ClassName`` import path -> the Policy class."""
    return _resolve_class(name, where, POLICIES, Policy, "policy")


def check_param_names(cls: type, params: dict[str, Any], where: str, skip: tuple[str, ...]) -> None:
    """Refuse ``params`` names that ``cls.__init__`` does not take (a class with ``**kwargs`` takes any)."""
    sig = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = [p for p in sig.parameters if p not in skip]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no parameter(s) {unknown}; accepted: {accepted}")


def params_model(cls: type) -> type[BaseModel] | None:
    """The ``Params`` model that describes ``cls``'s parameters: declared on the class itself, or inherited
    together with an unchanged ``__init__`` (a subclass with its own constructor and no ``Params`` of its own,
    e.g. a plugin, falls back to the check of names against its ``__init__``)."""
    for owner in cls.__mro__:
        if "Params" in owner.__dict__:
            model = owner.__dict__["Params"]
            if owner is cls or cls.__init__ is owner.__init__:
                return model if isinstance(model, type) and issubclass(model, BaseModel) else None
            return None
    return None


def line_error(loc: tuple, message: str, value: Any) -> dict[str, Any]:
    """One pydantic line error (for ``ValidationError.from_exception_data``) at ``loc`` with our own message."""
    return {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}


def validate_params(cls: type, params: dict[str, Any], loc: tuple, errors: list[dict[str, Any]],
                     skip: tuple[str, ...]) -> dict[str, Any]:
    """``params`` checked against ``cls``'s ``Params`` model (names, types, ranges) or, without one, their names
    against its ``__init__``. Problems are appended to ``errors`` under ``loc``; returns the validated values of
    the keys that were given (defaults are left to the class), or ``params`` unchanged."""
    model = params_model(cls)
    if model is None:
        try:
            check_param_names(cls, params, ".".join(map(str, loc)), skip)
        except ValueError as e:
            errors.append(line_error(loc, str(e).partition(": ")[2], params))
        return params
    try:
        checked = model.model_validate(params).model_dump(exclude_unset=True)
        return {k: checked[k] for k in params}  # the user's keys in the user's order
    except ValidationError as err:
        allowed = list(model.model_fields)
        for e in err.errors():
            if e["type"] == "extra_forbidden":
                name = str(e["loc"][-1])
                close = difflib.get_close_matches(name, allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                errors.append(line_error(loc + e["loc"], f"{cls.__name__} has no parameter {name!r}{hint}; "
                                                          f"allowed: {', '.join(allowed)}", e["input"]))
            else:
                errors.append({"type": e["type"], "loc": loc + e["loc"], "input": e["input"], "ctx": e.get("ctx", {})})
        return params
