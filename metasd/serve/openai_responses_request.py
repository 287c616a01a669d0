"""The request side of OpenAI's Responses API (``POST /v1/responses``, served by ``openai_responses``): the items of
``input`` (messages, earlier function calls and their outputs, earlier thinking) as chat messages, function
``tools`` in the API's flat form, and ``ResponsesRequest`` - every field served, checked as on the chat routes, and the
equivalent chat completion request (``chat_request``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from .protocol import ChatCompletionRequest, Lenient, MetasdOptions, ToolFunction

#: the roles of an input message, by the chat role each becomes (the Responses API's ``developer`` is a system turn)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputText(Lenient):
    """One part of an input message's content: text (``input_text``; an assistant's earlier ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str


def _joined(content: str | list[InputText]) -> str:
    """A content given as a string or as text parts, as one string."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(Lenient):
    """One item of ``input``: a message with text content."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(Lenient):
    """One item of ``input``: a function call the model made earlier (an item of an earlier response's ``output``,
    passed back with the call's result)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the API returns it


class FunctionCallOutput(Lenient):
    """One item of ``input``: what a function call returned (``call_id``: the call it answers), a tool turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return _joined(self.output)


class ReasoningText(Lenient):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Lenient):
    """One item of ``input``: the model's thinking in an earlier response (a ``reasoning`` item of its ``output``,
    passed back), which opens the assistant turn it came before. Only thinking given as text: an
    ``encrypted_content`` (OpenAI's own models') cannot be read here; a ``summary`` is not rendered."""

    type: Literal["reasoning"]
    content: list[ReasoningText] = []
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _readable(cls, v):
        if v is not None:
            raise ValueError("encrypted reasoning (OpenAI's own models') cannot be read here: pass the thinking as "
                             "content, [{\"type\": \"reasoning_text\", \"text\": ...}]")
        return v

    def text(self) -> str:
        return "".join(part.text for part in self.content)


#: the input items served, by ``type`` (a message may leave its type out)
ITEMS: dict[str, type[Lenient]] = {"message": InputMessage, "function_call": FunctionCallItem,
                                   "function_call_output": FunctionCallOutput, "reasoning": ReasoningItem}


def _validated(field: str, i: int, value: Any, models: dict[str, type[Lenient]], refused: str,
               default: str | None = None) -> Any:
    """Item ``i`` of a list ``field`` (``input``, ``tools``) as the model its ``type`` names (``default`` where it
    gives none: an input message may leave its type out); a ``ValidationError`` naming the item's field
    (``input.[0].content.[1].type``), its most specific error first (pydantic reports each member of a union: a
    string, a list of parts), or its type with ``refused`` (``{kind}`` the type) where no model serves it."""
    kind = value.get("type", default) if isinstance(value, dict) else None
    if kind not in models:
        loc = (field, i, "type") if isinstance(value, dict) else (field, i)
        raise ValidationError.from_exception_data(field, [{"type": "value_error", "loc": loc, "input": kind, "ctx": {
            "error": ValueError(refused.format(kind=kind, served=", ".join(repr(k) for k in models)))}}])
    try:
        return models[kind].model_validate(value)
    except ValidationError as e:
        errors = sorted(e.errors(include_url=False), key=lambda err: -len(err["loc"]))
        raise ValidationError.from_exception_data(field, [
            {"type": err["type"], "loc": (field, i, *err["loc"]), "input": err["input"],
             **({"ctx": err["ctx"]} if "ctx" in err else {})} for err in errors]) from None


def chat_messages(items: list[Any], start: int = 0) -> list[dict[str, Any]]:
    """``input``'s items as chat messages: a message as it is (``developer`` a system turn); a reasoning item opens
    an assistant turn (its ``reasoning_content``) that the assistant message after it completes; a function call joins
    the assistant turn before it (its text, then its calls: how an earlier response's ``output`` comes back) or
    opens one; a call's output is a ``tool`` message answering its ``call_id``. The items before ``start`` are a
    stored conversation's (``previous_response_id``): an error in one names that field, the others ``input.[i]``
    counted from ``start``."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        where = ("input", i - start) if i >= start else ("previous_response_id", i)
        item = _validated(*where, raw, ITEMS, "an item of type {kind!r} is not served here (served: {served})",
                          default="message")
        thought_only = bool(out) and out[-1].get("content") == "" and "reasoning_content" in out[-1] \
            and "tool_calls" not in out[-1]
        if isinstance(item, ReasoningItem):
            if item.text():  # (one with a summary alone: nothing a chat template renders)
                out.append({"role": "assistant", "content": "", "reasoning_content": item.text()})
        elif isinstance(item, InputMessage) and item.role == "assistant" and thought_only:
            out[-1]["content"] = item.text()  # the answer after its thinking: one turn
        elif isinstance(item, InputMessage):
            out.append({"role": ROLES[item.role], "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


class FunctionTool(ToolFunction):
    """One entry of ``tools``: a function (the Responses API's flat form of chat's ``{"type": "function", "function":
    {...}}``); the hosted tools (web search, file search, ...) run on OpenAI's side and are refused."""

    type: Literal["function"]

    def chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(Lenient):
    """``tool_choice`` naming the function the model must call."""

    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name": ...,
    "schema": {...}, "strict": ...}`` (the schema inline, where chat's ``response_format`` nests it)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """The same format as chat's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.schema_,
                                                       "strict": self.strict}}


class TextOptions(Lenient):
    format: TextFormat | None = None


class ChatExtensions(Lenient):
    """The chat routes' sampling and output fields a Responses request may send (not OpenAI's, as on the chat routes:
    vLLM's and llama-server's extensions), passed on to the chat request as they are and checked there."""

    top_k: Any = None
    min_p: Any = None
    stop: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    allowed_token_ids: Any = None
    include_stop_str_in_output: Any = None
    bad_words: Any = None
    skip_special_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_grammar: Any = None
    guided_choice: Any = None
    chat_template: Any = None  # how the chat is rendered (``chat_template.py``)
    chat_template_kwargs: Any = None
    documents: Any = None


#: the names of ``ChatExtensions``' fields
PASSED = tuple(ChatExtensions.model_fields)


class ResponsesRequest(ChatExtensions):
    """``POST /v1/responses``: the fields of OpenAI's Responses API this server serves, and the chat routes'
    extensions (``ChatExtensions``: ``top_k``, ``min_p``, ``stop``, penalties, ``guided_*``, ...) as they are; unknown
    fields as on the other routes: refused where they would change the output, else ignored and logged."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)  # the items: InputMessage each (``messages``)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    seed: int | None = Field(None, ge=-2 ** 63, lt=2 ** 64)  # not OpenAI's here: the chat routes' extension
    metasd: MetasdOptions | None = None
    previous_response_id: str | None = None  # a stored response this one continues (``ResponseStore``)
    store: bool = True  # keep this response for a later ``previous_response_id`` and ``GET /v1/responses/{id}``
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None  # FunctionTool each (``function_tools``)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None  # "message.output_text.logprobs" served; the others name what is never made here

    def refusal(self) -> tuple[str, str] | None:
        """(field, why) for what this server does not do - it runs nothing in the background, cuts no input - or
        None."""
        if self.background:
            return "background", "responses run in the foreground only"
        if self.truncation == "auto":
            return "truncation", "only 'disabled': an input over the context is refused, never cut"
        if self.wants_logprobs() and self.tools and self.tool_choice != "none":
            return ("top_logprobs" if self.top_logprobs is not None else "include",
                    "log-probabilities with tool calls are served on /v1/chat/completions")
        return None

    def wants_logprobs(self) -> bool:
        """Whether the message's text carries its tokens' log-probabilities: ``include`` names
        ``message.output_text.logprobs``, or ``top_logprobs`` asks for alternatives."""
        return "message.output_text.logprobs" in (self.include or []) or self.top_logprobs is not None

    def function_tools(self) -> list[FunctionTool]:
        """``tools`` checked: functions only (a ``ValidationError`` naming ``tools.[i].type`` for a hosted tool)."""
        refused = "only function tools are served here: a {kind!r} tool is run by OpenAI's own servers"
        return [_validated("tools", i, t, {"function": FunctionTool}, refused) for i, t in enumerate(self.tools or [])]

    def input_items(self) -> list[Any]:
        """``input`` as items (a string: one user message)."""
        return [{"role": "user", "content": self.input}] if isinstance(self.input, str) else list(self.input)

    def chat_request(self, earlier: list[Any] = ()) -> ChatCompletionRequest:
        """The equivalent chat completion request; ``earlier``: the items of the stored conversation this request
        continues (``previous_response_id``), before its own input. ``instructions`` are this request's alone: an
        earlier response's are not carried over, as in OpenAI's API."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += chat_messages([*earlier, *self.input_items()], start=len(earlier))
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools is not None:
            body["tools"] = [t.chat_tool() for t in self.function_tools()]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, FunctionChoice) else choice)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        fields = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": self.seed, "metasd": self.metasd.model_dump() if self.metasd else None,
                  "response_format": self.text.format.response_format() if self.text and self.text.format else None,
                  "logprobs": True if self.wants_logprobs() else None,
                  "top_logprobs": (self.top_logprobs or 0) if self.wants_logprobs() else None}
        body.update({k: v for k, v in fields.items() if v is not None})
        body.update({k: getattr(self, k) for k in PASSED if getattr(self, k) is not None})
        return ChatCompletionRequest.model_validate(body)
