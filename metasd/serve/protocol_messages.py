"""The chat messages and tools of a request body (``protocol.py`` holds the requests): a message's content (a
string, or text parts), the tool calls an earlier assistant message made and its thinking, the functions the model
may call and a ``tool_choice`` naming one. ``Lenient``: unknown fields kept aside for ``unknown_fields.py``.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Lenient(BaseModel):
    """Unknown fields are kept aside (``model_extra``): refused when they would change the output, else ignored."""

    model_config = ConfigDict(extra="allow", strict=True)


class TextPart(Lenient):
    """One part of a message's content given as a list: only text parts are served."""

    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    """The function an assistant message called: its name and its arguments as JSON text (OpenAI's) or an object."""

    name: str
    arguments: str | dict[str, Any]

    def argument_object(self) -> dict[str, Any] | str:
        """The arguments as an object, as chat templates render them (``arguments | tojson``); text that is not a JSON
        object is passed on as it is."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments


class MessageToolCall(Lenient):
    """One tool call of an earlier assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    """One chat message; the content as a string or a list of text parts. An assistant message may carry the
    ``tool_calls`` it made (its content then may be null) and its thinking (``reasoning``), a ``tool`` message the
    result of one (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    #: an earlier answer's thinking, passed back (``reasoning``: vLLM's name; ``reasoning_content``: the older one,
    #: which chat templates read, Qwen3's among them)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_where_needed(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may "
                             f"leave it null)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def rendered(self) -> dict[str, Any]:
        """The message as a chat template takes it (``developer`` as ``system``, tool-call arguments as objects)."""
        out: dict[str, Any] = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": c.function.argument_object()}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            out["reasoning_content"] = thought
        return out


class ToolFunction(Lenient):
    """A function the model may call: its name, what it does and the JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted; the arguments follow the schema whenever a call is enforced


class Tool(Lenient):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(Lenient):
    """``tool_choice`` naming the function the model must call."""

    class _Name(Lenient):
        name: str

    type: Literal["function"]
    function: _Name
