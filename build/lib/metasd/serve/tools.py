"""Tool calls: the model's own tool-call format, read out of its text and, where the request demands a call, enforced
by a grammar (docs/serving.md#tool-calls).

The tools reach the model through its chat template (``tools=`` of ``apply_chat_template``), which tells it the format
to answer in; a ``ToolCallParser`` knows one such format:

- ``parse(text)`` splits a finished completion into its plain content and its calls;
- ``grammar(tools, parallel)`` is a Lark grammar (llguidance's dialect) of the text of one or more well-formed calls to
  the given tools, the arguments valid under each tool's ``parameters`` schema: ``tool_choice: "required"`` and a
  named tool constrain the output with it, so the model writes its own format and the answer is the constrained
  verifier's (exact under speculation, as every constraint is);
- ``ToolStream`` streams content as it comes and holds back what may be the start of a call, so a stream carries
  the same content and calls as the whole answer.

``PARSERS`` holds the formats by name (``--tool-call-parser``); ``detect_parser`` picks one from a chat template.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Container, Sequence

from metasd.core.constraints.backend import JSON_DEFAULTS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def body(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item (with ``index`` in a stream's delta); the arguments as JSON text."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return out if index is None else {"index": index, **out}


class ToolCallParser:
    """One model family's tool-call format. Subclasses set ``name``, ``start`` (the text that opens a call, which a
    stream holds back from) and implement ``parse`` and ``grammar``."""

    name: str = ""
    start: str = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished completion: the content is the text before the first call, trailing
        whitespace trimmed (None when nothing is left); no calls (and the text as it is) when one is not well
        formed."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool = True, added: Container[str] = ()) -> str:
        """A Lark grammar of one call (more with ``parallel``) to one of ``tools`` (OpenAI's function objects:
        ``{"name", "parameters"}``), the arguments valid under its parameters; ``added``: the tokenizer's added
        tokens (``added_tokens``), which the grammar names as tokens where its format's markers are among them."""
        raise NotImplementedError


def added_tokens(tokenizer) -> set[str]:
    """The texts of a tokenizer's added tokens (``<tool_call>`` in Qwen's): a grammar must name such a token as a
    token (``<tool_call>``), not as text, for the grammar library treats every added token as special."""
    try:
        return set(tokenizer.get_added_vocab())
    except (AttributeError, NotImplementedError):
        return set()


def _marker(text: str, added: Container[str]) -> str:
    """A format's marker in a Lark grammar: the added token when the tokenizer has it, else the text."""
    return text if text in added else json.dumps(text)


def call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of ``{"name": <one of the tools>, "arguments": <its parameters>}`` (name first, nothing
    else), with JSON's whitespace bounded as for every structured output."""
    options = [{"type": "object",
                "properties": {"name": {"const": t["name"]},
                               "arguments": t.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": dict(JSON_DEFAULTS)}


class HermesParser(ToolCallParser):
    """The Hermes format, which Qwen2.5 and Qwen3, Hermes 2 and 3 and many other chat templates ask for: each call a
    JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` lines, calls
    separated by a newline, any plain content before the first."""

    name = "hermes"
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = []
        for body in self._CALL.findall(text[at:]):
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                log.info("a tool call that is not JSON was returned as content: %.200r", body)
                return text, []
            if not isinstance(value, dict):
                value = {}
            arguments = value.get("arguments", value.get("parameters"))  # some models write "parameters"
            if not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
                log.info("a tool call without a name and an arguments object was returned as content: %.200r", body)
                return text, []
            calls.append(ToolCall(value["name"], arguments))
        return text[:at].rstrip() or None, calls

    def grammar(self, tools: Sequence[dict[str, Any]], parallel: bool = True, added: Container[str] = ()) -> str:
        body = json.dumps(call_schema(tools), separators=(",", ":"))
        repeat = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{repeat}\n"
                f'call: {_marker("<tool_call>", added)} "\\n" body "\\n" {_marker("</tool_call>", added)}\n'
                f"body: %json {body}\n")


#: the tool-call formats metasd reads, by ``--tool-call-parser`` name
PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def detect_parser(chat_template: str | None) -> ToolCallParser | None:
    """The parser of the format a chat template asks its model for (``<tool_call>`` in it: Hermes), or None."""
    if chat_template and "<tool_call>" in chat_template:
        return HermesParser()
    return None


def tool_parser(name: str, chat_template: str | None) -> ToolCallParser | None:
    """``--tool-call-parser``: a name of ``PARSERS``, ``"auto"`` (``detect_parser``) or ``"none"``; ValueError
    naming the choices for another."""
    if name == "auto":
        return detect_parser(chat_template)
    if name == "none":
        return None
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be 'auto', 'none' or one of {', '.join(PARSERS)}; got {name!r}")
    return PARSERS[name]()


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` list (else tools given to it would silently vanish)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def split_answer(parser: ToolCallParser, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's (content, calls); with ``parallel`` false only the first call (as vLLM does)."""
    content, calls = parser.parse(text)
    return content, (calls if parallel else calls[:1])


@dataclass(frozen=True)
class ToolCalls:
    """How a request's choices are read for tool calls: the model's format and whether more than one call counts."""

    parser: ToolCallParser
    parallel: bool = True

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return split_answer(self.parser, text, self.parallel)

    def stream(self) -> "ToolStream":
        return ToolStream(self.parser, self.parallel)


class ToolStream:
    """One streamed choice of a request with tools: ``feed`` returns the content that is safe to send now (none of
    a call, and not a tail that may begin one); ``finish`` the rest as (content, calls), parsed as a whole answer is."""

    def __init__(self, parser: ToolCallParser, parallel: bool = True):
        self.parser, self.parallel = parser, parallel
        self.text, self.sent = "", 0  # the whole text so far; how much of it went out as content

    def feed(self, text: str) -> str:
        self.text += text
        at = self.text.find(self.parser.start)
        if at >= 0:  # a call has begun: nothing more goes out until the end
            safe = at
        else:  # hold back a tail that could grow into the start of a call
            safe = len(self.text)
            for k in range(min(len(self.parser.start) - 1, len(self.text)), 0, -1):
                if self.parser.start.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
        safe = len(self.text[:safe].rstrip())  # and trailing whitespace, which parse trims before a call
        out, self.sent = self.text[self.sent:max(safe, self.sent)], max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls), as ``split_answer`` splits the whole text: with calls, the content before
        them is all sent already."""
        _, calls = split_answer(self.parser, self.text, self.parallel)
        return ("" if calls else self.text[self.sent:]), calls
