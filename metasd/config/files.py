"""Reading YAML configuration files (pools, experiments, training configs): the error type, pydantic errors
turned into messages that name the file and the field path, and ``${VAR}`` paths from the environment."""
from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config file is invalid; the message names the file and the field."""


_UNION_TAG = re.compile(r"^(int|str|float|bool|none|dict\[.*|list\[.*|literal\[.*|function-.*)$", re.I)
# error types whose message does not show the offending value: "(got ...)" is added
_SHOW_INPUT = {"literal_error", "extra_forbidden", "greater_than", "greater_than_equal", "less_than", "less_than_equal",
               "multiple_of", "finite_number", "int_type", "int_parsing", "int_from_float", "float_type", "float_parsing",
               "bool_type", "bool_parsing", "string_type", "list_type", "enum"}


def format_validation_error(err: ValidationError, source: str, what: str = "pool config",
                            model: type[BaseModel] | None = None) -> str:
    """pydantic errors as ``source: invalid <what>`` then one ``  field.path: message`` line per error. Given the
    ``model`` that was validated, an unknown field gets the closest known name ("did you mean") and the names
    allowed there, instead of its whole value."""
    lines = [f"{source}: invalid {what}"]
    for e in err.errors():
        path = [x for x in e["loc"] if not _UNION_TAG.match(str(x))]
        loc = ".".join(map(str, path)) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and model is not None and (allowed := _fields_at(model, path[:-1])):
            close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
            msg = f"unknown field{f' (did you mean {close[0]!r}?)' if close else ''}; allowed here: {', '.join(allowed)}"
        elif e["type"] in _SHOW_INPUT and "input" in e:
            msg = f"{msg} (got {_short(e['input'])})"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(dict.fromkeys(lines))


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to about ``limit`` characters (a whole list of drafters is not a useful echo)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _fields_at(model: type[BaseModel], path: list) -> list[str]:
    """The field names of the (nested) pydantic model at ``path`` inside ``model``; [] when it is not a model."""
    for key in path:
        if isinstance(key, int):  # a list item: the model stays the list's item type
            continue
        field = model.model_fields.get(str(key))
        if field is None:
            return []
        model = _model_in(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X``, ``list[X]``, ``X | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def validate_config(model: type[BaseModel], raw: dict[str, Any], source: str, what: str) -> Any:
    """``model.model_validate(raw)``, or a ``ConfigError`` naming ``source`` and every bad field."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, what, model)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last in silence)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": its keys may be overridden, as YAML says
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """The top-level mapping of a YAML file; a ``ConfigError`` naming the file when it is missing, a directory,
    unreadable, not UTF-8 text, not YAML (a key given twice in a mapping included), or not a mapping."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a {what} file")
    if not path.exists():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:  # permission denied, a FIFO gone away, ...
        raise ConfigError(f"{path}: cannot read the {what}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at position {e.start}, line {line}); "
                          f"save the {what} as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:  # its marks (line, column, snippet) name the text "<unicode string>": say which file
        raise ConfigError(f"{path}: not valid YAML: " + str(e).replace('"<unicode string>"', f'"{path}"')) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return raw


_ENV_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def expand_env_path(value: str | None) -> str | None:
    """``$VAR`` / ``${VAR}`` in a path from a config file, from the environment (training configs name their
    data as ``${METASD_DATA}/...``, not as a path of one machine). An unset variable is an error naming it."""
    if value is None:
        return None
    missing = sorted({a or b for a, b in _ENV_VAR.findall(value) if (a or b) not in os.environ})
    if missing:
        raise ValueError(f"{value!r} uses environment variable(s) {missing}, which are not set "
                         f"(e.g. export METASD_DATA=/path/to/feature/sets)")
    return os.path.expandvars(value)
