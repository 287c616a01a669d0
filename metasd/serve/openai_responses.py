"""OpenAI's Responses API (``POST /v1/responses``), served as a chat completion: the request's ``input`` (a string, or
items: messages whose content is text, earlier function calls and their outputs) and ``instructions`` become chat
messages, ``max_output_tokens`` the token budget, ``text.format`` the structured output, function ``tools`` and
``tool_choice`` the chat route's tools; the answer is an assistant message and the function calls the model made,
whole or as the API's stream of events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.done`` ... ``response.completed``). Nothing is stored: a request that names an
earlier response (``previous_response_id``) or asks to run in the background is refused with a 400 naming the field,
as are any other input item (an image, a reasoning item) and any tool that is not a function (web search, ...).
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from .answers import STREAM_HEADERS, answer, stream
from .errors import ApiError, bad_request, from_validation
from .protocol import ChatCompletionRequest, Lenient, MetasdOptions, ToolFunction, accepted_fields

#: the roles of an input message, by the chat role each becomes (the Responses API's ``developer`` is a system turn)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputText(Lenient):
    """One part of an input message's content: text (``input_text``; an assistant's earlier ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Lenient):
    """One item of ``input``: a message with text content."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


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
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


#: the input items served, by ``type`` (a message may leave its type out)
ITEMS: dict[str, type[Lenient]] = {"message": InputMessage, "function_call": FunctionCallItem,
                                   "function_call_output": FunctionCallOutput}


def _validated(field: str, i: int, value: Any, models: dict[str, type[Lenient]], refused: str) -> Any:
    """Item ``i`` of a list ``field`` (``input``, ``tools``) as the model its ``type`` names (a message may leave its
    type out); a ``ValidationError`` naming the item's field (``input.[0].content.[1].type``), its most specific
    error first (pydantic reports each member of a union: a string, a list of parts), or its type with ``refused``
    (``{kind}`` the type) where no model serves it."""
    kind = value.get("type", "message" if field == "input" else None) if isinstance(value, dict) else None
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


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """``input``'s items as chat messages: a message as it is (``developer`` a system turn); a function call joins
    the assistant turn before it (its text, then its calls: how an earlier response's ``output`` comes back) or
    opens one; a call's output is a ``tool`` message answering its ``call_id``."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        item = _validated("input", i, raw, ITEMS, "an item of type {kind!r} is not served here (served: {served})")
        if isinstance(item, InputMessage):
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
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None  # FunctionTool each (``function_tools``)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = Field(None, ge=0)

    def refusal(self) -> tuple[str, str] | None:
        """(field, why) for what this server does not do - it stores nothing, runs nothing in the background - or
        None."""
        if self.previous_response_id is not None:
            return "previous_response_id", "responses are not stored here: send the whole conversation as input"
        if self.background:
            return "background", "responses run in the foreground only"
        if self.truncation == "auto":
            return "truncation", "only 'disabled': an input over the context is refused, never cut"
        if self.top_logprobs:
            return "top_logprobs", "log-probabilities are served on /v1/chat/completions"
        return None

    def function_tools(self) -> list[FunctionTool]:
        """``tools`` checked: functions only (a ``ValidationError`` naming ``tools.[i].type`` for a hosted tool)."""
        refused = "only function tools are served here: a {kind!r} tool is run by OpenAI's own servers"
        return [_validated("tools", i, t, {"function": FunctionTool}, refused) for i, t in enumerate(self.tools or [])]

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completion request."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += chat_messages(self.input)
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
                  "response_format": self.text.format.response_format() if self.text and self.text.format else None}
        body.update({k: v for k, v in fields.items() if v is not None})
        body.update({k: getattr(self, k) for k in PASSED if getattr(self, k) is not None})
        return ChatCompletionRequest.model_validate(body)


def _status(reason: str | None) -> str:
    """A response's (and its message's) status from the chat answer's finish reason."""
    return "incomplete" if reason == "length" else "completed"


class ResponseBuilder:
    """One response's objects and events, in the API's shapes: the ``Response`` (``whole``) and, streamed, its event
    sequence (``events``). Its ``output`` is the assistant's message (left out when the model only called functions)
    and then a ``function_call`` item per call. Beside OpenAI's fields, the finished response carries this request's
    record in ``metasd``, as the chat routes' answers do."""

    def __init__(self, req: ResponsesRequest, model_name: str):
        self.req, self.model = req, model_name
        self.id, self.item_id = f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None,
                 record: Any = None) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
               "tool_choice": choice or "auto", "tools": req.tools or [],
               "error": None, "previous_response_id": None, "store": False,
               "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
               "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                        if req.text and req.text.format else {"type": "text"}},
               "usage": usage}
        if record is not None:
            out["metasd"] = record
        return out

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part(text)]
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        """A ``function_call`` output item from a chat ``tool_calls`` entry (its ``id`` is the item's ``call_id``,
        the id a ``function_call_output`` answers); in progress, its arguments are still to come."""
        function = call["function"]
        return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "status": status,
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"] if status == "completed" else ""}

    @staticmethod
    def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
        """Chat's usage in the Responses API's names."""
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
                "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def output(self, text: str | None, calls: list[dict[str, Any]], reason: str | None) -> list[dict[str, Any]]:
        """The finished output items: the message (with text, or without calls; ``incomplete`` where the budget cut
        it), then the calls."""
        message = [self.message(text or "", _status(reason))] if text or not calls else []
        return message + [self.function_call(c) for c in calls]

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The finished response, from the chat completion it was served as."""
        choice = chat["choices"][0]
        message, reason = choice["message"], choice["finish_reason"]
        status = _status(reason)
        return self.response(status, self.output(message.get("content"), message.get("tool_calls") or [], reason),
                             self.usage(chat["usage"]), reason, chat.get("metasd"))

    def event(self, kind: str, **fields) -> str:
        """One server-sent event: its type named twice, as the API does (``event:`` and the data's ``type``)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _message_events(self, opening: bool, text: str = "", status: str = "completed") -> list[str]:
        """The events that open the message (output item 0) or close it with its whole ``text``."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if opening:
            return [self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress")),
                    self.event("response.content_part.added", **where, part=self.part(""))]
        return [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=self.message(text, status))]

    def _call_events(self, call: dict[str, Any], index: int) -> list[str]:
        """A whole call's events: its item added, its arguments (in one delta: a call is sent once it is whole), the
        item done."""
        done = self.function_call(call)
        where = {"item_id": done["id"], "output_index": index}
        added = self.function_call(call, "in_progress")
        return [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
                self.event("response.function_call_arguments.done", **where, arguments=done["arguments"]),
                self.event("response.output_item.done", output_index=index, item=done)]

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The response's events, from the server-sent chunks of the chat completion it is served as (``chunks``:
        ``answers.stream`` with usage included). The message opens at its first text (or at the end, empty, when
        the model made no call), the calls follow it as output items 1, 2, ... (0, 1, ... without text)."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        text, opened, calls, reason, record, usage = "", False, [], None, None, None
        async for chunk in chunks:
            data = chunk.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            body = json.loads(data)
            if "error" in body:  # the chat stream's error: the response failed
                error = body["error"]
                yield self.event("error", code=error.get("code"), message=error.get("message"),
                                 param=error.get("param"))
                failed = self.response("failed", [])
                failed["error"] = {"code": error.get("code") or "server_error", "message": error.get("message")}
                yield self.event("response.failed", response=failed)
                return
            if body.get("usage"):
                usage = self.usage(body["usage"])
            for choice in body.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if not opened:
                        opened = True
                        for event in self._message_events(opening=True):
                            yield event
                    text += delta["content"]
                    yield self.event("response.output_text.delta", **where, delta=delta["content"], logprobs=[])
                for call in delta.get("tool_calls") or []:  # whole calls, after the text: the message is done
                    if opened and not calls:
                        for event in self._message_events(opening=False, text=text):
                            yield event
                    calls.append(call)
                    for event in self._call_events(call, len(calls) - int(not opened)):
                        yield event
                reason = choice.get("finish_reason") or reason
            record = body.get("metasd", record)
        if not calls:  # the message, opened at the end where no text came
            for event in (self._message_events(opening=True) if not opened else []) + \
                    self._message_events(opening=False, text=text, status=_status(reason)):
                yield event
        status = _status(reason)
        yield self.event(f"response.{status}",
                         response=self.response(status, self.output(text, calls, reason), usage, reason, record))


#: ``add_responses_route``'s two steps of the chat pipeline: a request body read and checked against a route's model
#: (the key, the drain, the fields, the model name), and a checked chat request submitted (its handles and the
#: ``Completion`` that renders them)
Parse = Callable[[Request, type], Awaitable[Any]]
Start = Callable[[ChatCompletionRequest, str], Awaitable[tuple[list, Any]]]


def add_responses_route(app: FastAPI, model_name: str, parse: Parse, start: Start) -> None:
    """``POST /v1/responses`` on ``app``, served through the chat route's ``parse`` and ``start``."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await parse(request, ResponsesRequest)
        refused = req.refusal()
        if refused:
            raise bad_request(refused[1], refused[0], "unsupported_value")
        try:
            chat = req.chat_request()
        except ValidationError as e:  # a chat extension's value (top_k, min_p, ...): named as the request gave it
            raise from_validation(e, accepted_fields(ResponsesRequest)) from None
        try:
            handles, completion = await start(chat, "chat")
        except ApiError as e:  # the chat request's budget is this request's max_output_tokens
            if e.param == "max_tokens":
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
            raise
        built = ResponseBuilder(req, model_name)
        if req.stream:
            return StreamingResponse(built.events(stream(handles, completion)), media_type="text/event-stream",
                                     headers=STREAM_HEADERS)
        return JSONResponse(built.whole(await answer(request, handles, completion)))
