"""OpenAI's Responses API (``POST /v1/responses``), served as a chat completion: the request's ``input`` (a string, or
messages whose content is text) and ``instructions`` become chat messages, ``max_output_tokens`` the token budget,
``text.format`` the structured output; the answer is one assistant message, whole or as the API's stream of events
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``). Nothing is stored: a request
that names an earlier response (``previous_response_id``), asks to run in the background or gives tools is refused
with a 400 naming the field, as is any input item that is not a text message.
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
from .protocol import ChatCompletionRequest, Lenient, MetasdOptions, accepted_fields

#: the roles of an input message, by the chat role each becomes (the Responses API's ``developer`` is a system turn)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputText(Lenient):
    """One part of an input message's content: text (``input_text``; an assistant's earlier ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Lenient):
    """One item of ``input``: a message with text content (other items - images, tool outputs - are refused)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


def _messages(items: list[dict[str, Any]]) -> list[InputMessage]:
    """``input``'s items as messages; a ``ValidationError`` naming the item's field (``input.[0].content.[1].type``),
    its most specific error first (pydantic reports each member of a union: a string, a list of parts)."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(InputMessage.model_validate(item))
        except ValidationError as e:
            errors = sorted(e.errors(include_url=False), key=lambda err: -len(err["loc"]))
            raise ValidationError.from_exception_data("input", [
                {"type": err["type"], "loc": ("input", i, *err["loc"]), "input": err["input"],
                 **({"ctx": err["ctx"]} if "ctx" in err else {})} for err in errors]) from None
    return out


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
    tools: list[dict[str, Any]] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = Field(None, ge=0)

    def refusal(self) -> tuple[str, str] | None:
        """(field, why) for what this server does not do - it stores nothing, runs nothing in the background - or
        None."""
        if self.previous_response_id is not None:
            return "previous_response_id", "responses are not stored here: send the whole conversation as input"
        if self.background:
            return "background", "responses run in the foreground only"
        if self.tools:
            return "tools", "tool calls are served on /v1/chat/completions, not /v1/responses"
        if self.truncation == "auto":
            return "truncation", "only 'disabled': an input over the context is refused, never cut"
        if self.top_logprobs:
            return "top_logprobs", "log-probabilities are served on /v1/chat/completions"
        return None

    def chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat completion request."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": ROLES[m.role], "content": m.text()} for m in _messages(self.input)]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        fields = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "seed": self.seed, "metasd": self.metasd.model_dump() if self.metasd else None,
                  "response_format": self.text.format.response_format() if self.text and self.text.format else None}
        body.update({k: v for k, v in fields.items() if v is not None})
        body.update({k: getattr(self, k) for k in PASSED if getattr(self, k) is not None})
        return ChatCompletionRequest.model_validate(body)


class ResponseBuilder:
    """One response's objects and events, in the API's shapes: the ``Response`` (``whole``) and, streamed, its event
    sequence (``events``). Beside OpenAI's fields, the finished response carries this request's record in ``metasd``,
    as the chat routes' answers do."""

    def __init__(self, req: ResponsesRequest, model_name: str):
        self.req, self.model = req, model_name
        self.id, self.item_id = f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.sequence = 0

    def response(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None,
                 record: Any = None) -> dict[str, Any]:
        req = self.req
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": False, "tool_choice": "none",
               "tools": [], "error": None, "previous_response_id": None, "store": False,
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
    def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
        """Chat's usage in the Responses API's names."""
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
                "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The finished response, from the chat completion it was served as."""
        choice = chat["choices"][0]
        text, reason = choice["message"].get("content") or "", choice["finish_reason"]
        status = "incomplete" if reason == "length" else "completed"
        return self.response(status, [self.message(text, "completed")], self.usage(chat["usage"]), reason,
                             chat.get("metasd"))

    def event(self, kind: str, **fields) -> str:
        """One server-sent event: its type named twice, as the API does (``event:`` and the data's ``type``)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The response's events, from the server-sent chunks of the chat completion it is served as (``chunks``:
        ``answers.stream`` with usage included)."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        yield self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        yield self.event("response.content_part.added", **where, part=self.part(""))
        text, reason, record, usage = "", None, None, None
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
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    text += delta
                    yield self.event("response.output_text.delta", **where, delta=delta, logprobs=[])
                reason = choice.get("finish_reason") or reason
            record = body.get("metasd", record)
        yield self.event("response.output_text.done", **where, text=text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=self.part(text))
        yield self.event("response.output_item.done", output_index=0, item=self.message(text, "completed"))
        status = "incomplete" if reason == "length" else "completed"
        yield self.event(f"response.{status}",
                         response=self.response(status, [self.message(text, "completed")], usage, reason, record))


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
