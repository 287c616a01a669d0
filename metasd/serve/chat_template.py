"""Chat templates as vLLM serves them. The server renders every chat through one template: ``--chat-template``'s (a
file, or the template's own text) where given, else the model's. A request changes the rendering only where the
template lets it:

- ``chat_template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``, ...). A key the template
  does not read renders nothing: it is accepted and named in the log, as an unknown field is. A key that is one of
  the rendering's own switches (``add_generation_prompt``, ``tools``, ...) is refused: the request has a field for it,
  or the server sets it.
- ``documents``: retrieved passages (objects, e.g. ``title`` and ``text``) for a template that renders them; refused
  (``documents_unsupported``) by a template that never reads ``documents`` - never dropped in silence.
- ``chat_template``: a template of the request's own, only on a server started with
  ``--trust-request-chat-template``. A template is code the server runs: sandboxed, but free to loop for a long time
  (vLLM refuses request templates by default for that reason). Tool calls are still read in the server's format.

The same fields reach ``/tokenize`` and the Responses API (passed on to its chat request), so a client can count
the tokens of exactly what it will send.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jinja2.meta
from jinja2 import TemplateSyntaxError
from pydantic import BaseModel
from transformers.utils.chat_template_utils import _compile_jinja_template

from .errors import bad_request

log = logging.getLogger("metasd.serve")

#: ``apply_chat_template``'s own arguments and the names it renders with: each set by a request field of its own
#: (``FIELDS``) or by the server, never through ``chat_template_kwargs``
FIELDS = ("add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template")
RESERVED = frozenset(FIELDS) | {"messages", "conversation", "tokenize", "sanitize_control_tokens", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"}


class TemplateFields(BaseModel):
    """A request's fields that change how its chat is rendered (vLLM's): on the chat route, ``/tokenize`` and, passed
    on, the Responses API. Checked against the server's template by ``ChatTemplates.options``."""

    chat_template: str | None = None  # a template of the request's own (needs --trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables the template reads
    documents: list[dict[str, Any]] | None = None  # passages, for a template that renders them


def template_variables(template: str) -> frozenset[str]:
    """The names ``template`` reads from its context (``messages``, ``tools``, ``enable_thinking``, ...), parsed as
    transformers renders it (its sandbox and extensions); ``TemplateSyntaxError`` where it does not parse."""
    compiled = _compile_jinja_template(template)
    return frozenset(jinja2.meta.find_undeclared_variables(compiled.environment.parse(template)))


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value: the path of a file holding the template, or the template's own text (as vLLM
    takes it: text with a Jinja tag or expression), checked to parse - before any model loads. ValueError naming the
    option otherwise."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text, where = path.read_text(encoding="utf-8"), f"--chat-template {value}"
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it ({e})") from None
    elif "{{" in value or "{%" in value:
        text, where = value, "--chat-template (the template given as text)"
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a template's text (no {{{{ or {{% in it)")
    if not text.strip():
        raise ValueError(f"{where}: the template is empty")
    try:
        template_variables(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"{where}: the template does not parse (line {e.lineno}: {e.message})") from None
    return text


class ChatTemplates:
    """How the server renders chats: its template (``template``, from ``--chat-template``, else the tokenizer's) and
    the rendering options a request's fields ask for, checked against it (``options``); ``trust_request_templates``:
    whether a request may send a template of its own."""

    def __init__(self, tokenizer, model_name: str, template: str | None = None, trust_request_templates: bool = False):
        self.model_name, self.trust = model_name, trust_request_templates
        self.given = template is not None  # the server's own template: passed to every rendering
        self.text: str | None = template if self.given else getattr(tokenizer, "chat_template", None)
        self.variables = template_variables(self.text) if isinstance(self.text, str) else frozenset()

    def options(self, req) -> dict[str, Any]:
        """``render_chat``'s options for ``req`` (a request with ``TemplateFields`` and the chat template's switches
        ``add_generation_prompt`` and ``continue_final_message``): its switches, the server's template where one was
        given, the request's documents and variables; an ``ApiError`` (400) naming the field at fault."""
        out: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                               "continue_final_message": req.continue_final_message}
        template, reads = (self.text, self.variables)
        if req.chat_template is not None:
            template, reads = req.chat_template, self._request_template(req.chat_template)
            out["chat_template"] = template
        elif self.given:
            out["chat_template"] = template
        if req.documents:
            if "documents" not in reads:
                raise bad_request(f"the chat template of {self.model_name} does not render documents", "documents",
                                  "documents_unsupported")
            out["documents"] = req.documents
        if req.chat_template_kwargs:
            out["variables"] = self._variables(req.chat_template_kwargs, reads)
        return out

    def _request_template(self, template: str) -> frozenset[str]:
        if not self.trust:
            raise bad_request("this server renders chats through its own template only: a request's chat_template "
                              "needs a server started with --trust-request-chat-template", "chat_template",
                              "unsupported_value")
        if not template.strip():
            raise bad_request("chat_template is empty", "chat_template")
        try:
            return template_variables(template)
        except TemplateSyntaxError as e:
            raise bad_request(f"chat_template does not parse (line {e.lineno}: {e.message})", "chat_template") from None

    def _variables(self, kwargs: dict[str, Any], reads: frozenset[str]) -> dict[str, Any]:
        reserved = sorted(set(kwargs) & RESERVED)
        if reserved:
            key = reserved[0]
            instead = f"send the request's field {key}" if key in FIELDS else "the server sets it"
            raise bad_request(f"chat_template_kwargs.{key} is the rendering's own argument: {instead}",
                              f"chat_template_kwargs.{key}", "unsupported_value")
        unread = sorted(set(kwargs) - reads)
        if unread:  # they render nothing (as an unknown field changes nothing): accepted, named in the log
            log.warning("chat_template_kwargs %s: not read by the chat template of %s (ignored)", ", ".join(unread),
                        self.model_name)
        return kwargs
