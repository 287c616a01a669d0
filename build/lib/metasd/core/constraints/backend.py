"""The grammar library behind the constraints, llguidance (an optional dependency: ``metasd[structured]``), and the
errors of this package. Nothing here imports the rest of the package."""
from __future__ import annotations

from typing import Any

try:
    import llguidance
    import llguidance.hf
except ImportError:  # the optional dependency is absent: specs check their fields only, compiling says what to install
    llguidance = None

INSTALL_HINT = "structured output needs llguidance: pip install 'metasd[structured]' (or: pip install llguidance)"


class ConstraintError(ValueError):
    """A constraint that cannot be used, with the field at fault: ``field`` (e.g. ``"schema"``, ``"pattern"``,
    ``"response_format.json_schema.schema"``, ``"tokenizer"``) and ``reason``; ``str(e)`` is ``"field: reason"``."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def available() -> bool:
    """Whether llguidance is installed."""
    return llguidance is not None


def llguidance_module():
    """The llguidance module (with its Hugging Face bridge loaded), or ImportError with the install command."""
    if llguidance is None:
        raise ImportError(INSTALL_HINT)
    return llguidance


#: llguidance's JSON options every schema gets unless its own "x-guidance" sets them: at most 8 whitespace characters
#: between two JSON tokens (pretty-printed JSON up to 7 levels deep still fits)
JSON_DEFAULTS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,8}"}


def grammar_source(kind: str, schema: dict[str, Any] | None, pattern: str | None, field: str) -> str:
    """The llguidance grammar (its JSON text) of a regex or a Lark grammar (``pattern``) or of a JSON schema
    (``schema``); independent of any tokenizer. ConstraintError under ``field`` when llguidance cannot read it."""
    matcher = llguidance_module().LLMatcher
    if kind == "regex":
        return matcher.grammar_from_regex(pattern)
    if kind == "lark":
        try:
            return matcher.grammar_from_lark(pattern)
        except ValueError as e:
            raise ConstraintError(field, f"does not compile to a grammar: {e}") from None
    try:  # whitespace between JSON tokens bounded, unless the schema's own "x-guidance" says otherwise: with free
        # whitespace a model can spend every token on blanks between two items (a loop to max_tokens)
        return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except ValueError as e:
        raise ConstraintError(field, f"does not compile to a grammar: {e}") from None


def check_grammar(grammar: str, field: str) -> None:
    """ConstraintError under ``field`` when ``grammar`` does not compile (checked without a tokenizer)."""
    is_error, messages = llguidance_module().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConstraintError(field, f"does not compile to a grammar: {' '.join(messages).strip()}")
