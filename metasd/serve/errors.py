"""OpenAI-style errors: every refusal of the server is ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status, so the official clients raise their usual exceptions (``openai.BadRequestError`` for 400, ...)."""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

#: pydantic names the member of a union it tried (``stop.str``, ``stop.list[str]``); these are not fields
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class ApiError(Exception):
    """A refusal with its HTTP status and the OpenAI error body's fields (``param``: the request field at fault)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unknown_model(model: str, served: str) -> ApiError:
    """The 404 for a request naming a model this server does not serve (OpenAI's: ``openai.NotFoundError``)."""
    return ApiError(404, f"The model {model!r} does not exist: this server serves {served!r}", param="model",
                    code="model_not_found")


def _param(loc: tuple) -> str | None:
    """pydantic's error location as OpenAI spells a parameter: ``messages.[0].content``; union member tags dropped."""
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item not in _TYPE_TAGS and re.fullmatch(r"[a-z_][a-z0-9_]*", item):
            parts.append(item)
    return ".".join(parts) or None


def from_validation(error: ValidationError, accepted: list[str]) -> ApiError:
    """The first error of a request body's validation as a 400 naming its field; ``accepted``: the fields the route
    takes (named when a field is unknown)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    kind, param = first["type"], _param(tuple(first["loc"]))
    if kind == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first['msg']}", None, "invalid_json")
    if kind == "model_type" and not first["loc"]:
        return bad_request("the request body must be a JSON object", None, "invalid_type")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param} (this server accepts: "
                           f"{', '.join(accepted)}; docs/serving.md)", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: {param}", param, "missing_required_parameter")
    same = [e["msg"] for e in errors if _param(tuple(e["loc"])) == param]  # a union's members each say why
    message = " or ".join(dict.fromkeys(m.removeprefix("Value error, ") for m in same))
    return bad_request(f"Invalid value for {param}: {message}", param,
                       "unsupported_value" if kind == "value_error" else "invalid_type")
