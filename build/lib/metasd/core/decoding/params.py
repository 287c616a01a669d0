"""Plugin parameters: one pydantic model per drafter type and per policy (``Params``) checks every value it is
given - by a pool file before any model loads, and by a constructor called from Python - with the same rules.

Field types (``Int``, ``Float``, ``Bool``) do not coerce: YAML gives ints, floats and booleans, and a string "5", a
float 4.0 for a count or 1 for a flag is refused rather than guessed; an int is accepted where a float is expected.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, Strict, ValidationError

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class PluginParams(BaseModel):
    """Base of a plugin's ``Params``: unknown names are refused; declare each parameter with its default and its
    allowed values (``Field(ge=1)``, ``Literal[...]``). Constraints that need more than the values (the loaded
    model, the number of arms) stay in the plugin's constructor."""

    model_config = ConfigDict(extra="forbid")


P = TypeVar("P", bound=BaseModel)

_UNION_TAG = re.compile(r"^(int|str|float|bool|none|dict\[.*|list\[.*|literal\[.*|function-.*|constrained-.*)$", re.I)
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}
_TYPES = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "bool_type": "True or False", "string_type": "a string", "list_type": "a list", "finite_number": "finite"}


def _requirement(error: Mapping[str, Any]) -> str:
    """What an error's value should have been, in words ("must be >= 1", "must be one of 'a', 'b')."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"must be {op} {ctx.get(key)}"
    if kind in _TYPES:
        return f"must be {_TYPES[kind]}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return str(error["msg"]).removeprefix("Value error, ")


def _either(requirements: list[str]) -> str:
    """``["must be > 0", "must be one of 'x'"]`` -> ``must be > 0 or one of 'x'``."""
    unique = list(dict.fromkeys(requirements))
    if all(r.startswith("must be ") for r in unique):
        return "must be " + " or ".join(r.removeprefix("must be ") for r in unique)
    return "; or ".join(unique)


def _field(loc: tuple) -> str:
    """An error's parameter path without pydantic's union-member tags (``reward_scale.constrained-float``)."""
    return ".".join(str(x) for x in loc if not _UNION_TAG.match(str(x)))


def check_params(model: type[P], values: Mapping[str, Any], owner: str) -> P:
    """``values`` validated by ``model``; a ``ValueError`` naming ``owner`` and every bad parameter otherwise:
    ``UCB1: parameter 'c' must be >= 0, got -1.0``; an unknown name lists the accepted ones."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as err:
        unknown, checks, inputs, general = [], {}, {}, []
        for e in err.errors():
            name = _field(e["loc"])
            if e["type"] == "extra_forbidden":
                unknown.append(f"unknown parameter {name!r}; accepted: {', '.join(map(repr, model.model_fields)) or 'none'}")
            elif name:  # a union's members fail one by one: one line per parameter, their requirements or-ed
                checks.setdefault(name, []).append(_requirement(e))
                inputs[name] = e["input"]
            else:  # a check across parameters (a model validator)
                general.append(_requirement(e))
        problems = unknown + [f"parameter {name!r} {_either(reqs)}, got {inputs[name]!r}" for name, reqs in checks.items()]
        problems += general
        raise ValueError(f"{owner}: " + "; ".join(problems)) from None
