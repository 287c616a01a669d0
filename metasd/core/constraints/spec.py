"""What a structured-output request asks for: ``Constraint`` (a JSON object, a JSON schema, a regex or a Lark grammar)
and the
``ConstraintError`` (backend.py) a bad one raises, naming the field at fault.

A ``Constraint`` is library-agnostic data: it checks its own fields when built and, where llguidance is installed,
that the schema or pattern compiles to a grammar (no tokenizer needed, a few milliseconds), so a bad request fails
when it is parsed and not in the middle of decoding. ``metasd.core.constraints.compiler`` turns it into a grammar
for a tokenizer.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .backend import ConstraintError, available, check_grammar, grammar_source

#: the kinds of constraint: any JSON object, a JSON object valid under a JSON schema, a string fully matching a regex,
#: a string in the language of a Lark grammar
KINDS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True, eq=False)
class Constraint:
    """A structured-output constraint on the generated text (the whole completion, prompt excluded).

    ``kind``: ``"json_object"`` (any JSON object, OpenAI's ``response_format={"type": "json_object"}``),
    ``"json_schema"`` (a JSON object valid under ``schema``, a dict or its JSON text) or ``"regex"`` (the text fully
    matches ``pattern``; llguidance's syntax, i.e. Rust's ``regex`` crate without look-around or back-references) or
    ``"lark"`` (the text is in the language of the grammar ``lark``, whose rule ``start`` is the whole text;
    llguidance's Lark dialect, in which ``%json {schema}`` embeds a JSON schema as a rule). A field that the kind does
    not use must be left None; ``schema`` is kept as a private copy (a dict: read it, do not change it). Whitespace
    between JSON tokens is bounded (``backend.JSON_DEFAULTS``); the generation ends with an end-of-sequence token once
    the text is complete.

    Frozen; equal constraints (same kind, same schema whatever its key order, same pattern) are equal and hash
    alike, so they share one compiled grammar (``ConstraintCompiler``). Raises ``ConstraintError`` naming the field.
    ``Constraint.json_object()``, ``.json_schema(schema)``, ``.regex(pattern)``, ``.grammar_of(lark)``,
    ``.choice(strings)`` and ``.from_response_format(rf)`` build one.
    """

    kind: str
    schema: Mapping[str, Any] | str | None = None
    pattern: str | None = None
    lark: str | None = None
    #: canonical text of the constraint: the cache key (set in __post_init__)
    key: str = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ConstraintError("kind", f"must be one of {', '.join(map(repr, KINDS))}, got {self.kind!r}")
        if self.kind == "json_schema":
            object.__setattr__(self, "schema", _check_schema(self.schema, "schema"))
        elif self.schema is not None:
            raise ConstraintError("schema", f"is only for kind 'json_schema', not {self.kind!r}; leave it None")
        if self.kind == "regex":
            if not isinstance(self.pattern, str) or not self.pattern:
                raise ConstraintError("pattern", f"kind 'regex' needs a non-empty string, got {self.pattern!r}")
        elif self.pattern is not None:
            raise ConstraintError("pattern", f"is only for kind 'regex', not {self.kind!r}; leave it None")
        if self.kind == "lark":
            if not isinstance(self.lark, str) or not self.lark.strip():
                raise ConstraintError("lark", f"kind 'lark' needs a non-empty grammar, got {self.lark!r}")
        elif self.lark is not None:
            raise ConstraintError("lark", f"is only for kind 'lark', not {self.kind!r}; leave it None")
        key = json.dumps([self.kind, self.schema, self.pattern, self.lark], sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "key", key)
        _check_grammar(self)

    def __eq__(self, other) -> bool:
        return isinstance(other, Constraint) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def field_name(self) -> str:
        """The field that holds this constraint's grammar source (``schema``, ``pattern``; ``kind`` for
        json_object): where a compile error is reported."""
        return {"json_schema": "schema", "regex": "pattern", "lark": "lark"}.get(self.kind, "kind")

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (its JSON text; needs llguidance)."""
        schema = None if self.kind in ("regex", "lark") else self.json_schema_source()
        return grammar_source(self.kind, schema, self.pattern if self.kind == "regex" else self.lark, self.field_name)

    def json_schema_source(self) -> dict[str, Any]:
        """The JSON schema this constraint compiles from (``{"type": "object"}`` for json_object); a copy."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind == "json_schema":
            return copy.deepcopy(dict(self.schema))
        raise ValueError(f"a {self.kind!r} constraint has no JSON schema")

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> "Constraint":
        """A JSON object valid under ``schema`` (a dict, or its JSON text)."""
        return cls("json_schema", schema=schema)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text that fully matches ``pattern``."""
        return cls("regex", pattern=pattern)

    @classmethod
    def grammar_of(cls, lark: str) -> "Constraint":
        """Text in the language of the Lark grammar ``lark`` (llguidance's dialect: rule ``start``, ``%json``)."""
        return cls("lark", lark=lark)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "Constraint":
        """Exactly one of ``choices`` (vLLM's ``guided_choice``): the Lark grammar of their alternatives, each a
        string literal (JSON's escapes, which Lark's strings read alike). ``ConstraintError`` naming ``choices`` for
        anything but a non-empty list of non-empty strings."""
        if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)) or not choices:
            raise ConstraintError("choices", f"must be a non-empty list of strings, got {choices!r}")
        for i, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice:
                raise ConstraintError("choices", f"choice {i} must be a non-empty string, got {choice!r}")
        return cls.grammar_of("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any] | None,
                             name: str = "response_format") -> "Constraint | None":
        """OpenAI's ``response_format`` -> a Constraint (None for ``{"type": "text"}`` or None): ``{"type":
        "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict":
        ...}}`` (``strict`` is accepted and changes nothing: the output always follows the schema); llama-server's
        ``{"type": "json_object", "schema": {...}}`` follows its schema. Errors name the field under ``name``, e.g.
        ``response_format.json_schema.schema``."""
        if response_format is None:
            return None
        if not isinstance(response_format, Mapping):
            raise ConstraintError(name, f"must be an object, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object" and response_format.get("schema") is not None:  # llama-server's form
            try:
                return cls.json_schema(response_format["schema"])
            except ConstraintError as e:
                raise ConstraintError(f"{name}.{e.field}", e.reason) from None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise ConstraintError(f"{name}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
        inner = response_format.get("json_schema")
        if not isinstance(inner, Mapping):
            raise ConstraintError(f"{name}.json_schema", "must be an object with a 'schema'")
        if "schema" not in inner:
            raise ConstraintError(f"{name}.json_schema.schema", "is missing")
        try:
            return cls.json_schema(inner["schema"])
        except ConstraintError as e:
            raise ConstraintError(f"{name}.json_schema.{e.field}", e.reason) from None


#: vLLM's structured-output request fields, each to the ``Constraint`` it asks for
GUIDED_FIELDS = {"guided_json": Constraint.json_schema, "guided_regex": Constraint.regex,
                 "guided_grammar": Constraint.grammar_of, "guided_choice": Constraint.choice}


def constraint_from_fields(fields: Mapping[str, Any]) -> Constraint | None:
    """The structured output a request's fields ask for (the server's requests, ``metasd generate``'s input lines):
    at most one of OpenAI's ``response_format`` (a dict; ``{"type": "text"}`` asks for none) and vLLM's
    ``guided_json`` (a JSON schema), ``guided_regex``, ``guided_grammar`` (llguidance's Lark) and ``guided_choice``
    (a list of strings); other keys are not read, None values are not given. None where none is asked for;
    ``ConstraintError`` naming the field at fault (a part of ``guided_json``'s schema by its path)."""
    response_format = fields.get("response_format")
    given = [name for name in GUIDED_FIELDS if fields.get(name) is not None]
    if response_format is not None and not (isinstance(response_format, Mapping)
                                            and response_format.get("type") == "text"):
        given.insert(0, "response_format")
    if len(given) > 1:
        raise ConstraintError(given[1], f"only one structured output per request; {given[0]} is given too")
    if not given:
        return None
    if given[0] == "response_format":
        return Constraint.from_response_format(response_format)
    try:
        return GUIDED_FIELDS[given[0]](fields[given[0]])
    except ConstraintError as e:
        inner = f".{e.field}" if given[0] == "guided_json" and e.field != "schema" else ""
        raise ConstraintError(given[0] + inner, e.reason) from None


def _check_schema(schema: Any, name: str) -> dict[str, Any]:
    """A JSON schema given as a dict or its JSON text -> a private deep copy (a dict of JSON values)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(name, f"is not valid JSON: {e}") from None
    if not isinstance(schema, Mapping):
        raise ConstraintError(name, f"kind 'json_schema' needs a JSON schema object (a dict), got {schema!r:.80}")
    try:
        return json.loads(json.dumps(schema))  # a private copy, and a check that it is JSON
    except (TypeError, ValueError) as e:
        raise ConstraintError(name, f"is not JSON-serializable: {e}") from None


def _check_grammar(spec: Constraint) -> None:
    """Compile the spec's grammar without a tokenizer where llguidance is installed (else the compiler checks it)."""
    if available():
        check_grammar(spec.grammar(), spec.field_name)
