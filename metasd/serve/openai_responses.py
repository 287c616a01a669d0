"""OpenAI's Responses API (``POST /v1/responses``), served as a chat completion: the request's ``input`` (a string, or
items: messages whose content is text, earlier function calls and their outputs) and ``instructions`` become chat
messages, ``max_output_tokens`` the token budget, ``text.format`` the structured output, function ``tools`` and
``tool_choice`` the chat route's tools, ``top_logprobs`` / ``include`` the text's log-probabilities (the request
side: ``openai_responses_request``); the answer is the model's thinking where a reasoning parser reads one (a
``reasoning`` item), an assistant message and the function calls the model made, whole
or as the API's stream of events (``response.created`` ... ``response.output_text.delta`` ...
``response.function_call_arguments.done`` ... ``response.completed``). A finished response is stored (``store``, true
by default; ``response_store``) for a later request that continues it (``previous_response_id``: its conversation's
items come before that request's input) and for ``GET`` / ``DELETE /v1/responses/{id}`` and its ``input_items``. A
request to run in the background is refused with a 400 naming the field, as are any other input item (an image, an
item reference) and any tool that is not a function (web search, ...).
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from .answers import STREAM_HEADERS, answer, stream
from .errors import ApiError, bad_request, from_validation
from .openai_responses_request import FunctionChoice, ResponsesRequest
from .protocol import ChatCompletionRequest, accepted_fields
from .response_store import ResponseStore


def _status(reason: str | None) -> str:
    """A response's (and its message's) status from the chat answer's finish reason."""
    return "incomplete" if reason == "length" else "completed"


class ResponseBuilder:
    """One response's objects and events, in the API's shapes: the ``Response`` (``whole``) and, streamed, its event
    sequence (``events``). Its ``output`` is the assistant's message (left out when the model only called functions)
    and then a ``function_call`` item per call. Beside OpenAI's fields, the finished response carries this request's
    record in ``metasd``, as the chat routes' answers do."""

    def __init__(self, req: ResponsesRequest, model_name: str, stored: bool = False):
        self.req, self.model, self.stored = req, model_name, stored  # stored: kept once finished (``ResponseStore``)
        self.id, self.item_id = f"resp_{secrets.token_hex(12)}", f"msg_{secrets.token_hex(12)}"
        self.reasoning_id = f"rs_{secrets.token_hex(12)}"
        self.reasoned = False  # whether the output starts with a reasoning item (the model's thinking)
        self.created = int(time.time())
        self.sequence = 0
        self.final: dict[str, Any] | None = None  # the finished response, once streamed

    def response(self, status: str, output: list[dict], usage: dict | None = None, reason: str | None = None,
                 record: Any = None) -> dict[str, Any]:
        req = self.req
        choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": output, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
               "tool_choice": choice or "auto", "tools": req.tools or [],
               "error": None, "previous_response_id": req.previous_response_id, "store": self.stored,
               "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
               "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                        if req.text and req.text.format else {"type": "text"}},
               "usage": usage}
        if record is not None:
            out["metasd"] = record
        return out

    @property
    def text_at(self) -> dict[str, Any]:
        """Where the message's text is: its one part, the output's first item or the one after the reasoning."""
        return {"item_id": self.item_id, "output_index": int(self.reasoned), "content_index": 0}

    def reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        """The ``reasoning`` output item: the model's thinking (``--reasoning-parser``) as its one ``reasoning_text``
        (no summary: none is written)."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"id": self.reasoning_id, "type": "reasoning", "status": status, "summary": [], "content": content}

    def message(self, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.part(text, logprobs)]
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str, logprobs: list | None = None) -> dict[str, Any]:
        """An ``output_text`` part; ``logprobs``: its tokens', as chat's ``logprobs.content`` (the same entries)."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

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
                "output_tokens_details": {"reasoning_tokens": (chat_usage.get("completion_tokens_details") or {})
                                          .get("reasoning_tokens", 0)}}

    def output(self, text: str | None, calls: list[dict[str, Any]], reason: str | None,
               logprobs: list | None = None, thought: str | None = None) -> list[dict[str, Any]]:
        """The finished output items: the reasoning where the model thought, the message (with text, or without calls;
        ``incomplete`` where the budget cut it), then the calls."""
        self.reasoned = bool(thought)  # (an empty block: no item, as a stream sends none)
        reasoning = [self.reasoning(thought)] if thought else []
        message = [self.message(text or "", _status(reason), logprobs)] if text or not calls else []
        return reasoning + message + [self.function_call(c) for c in calls]

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The finished response, from the chat completion it was served as."""
        choice = chat["choices"][0]
        message, reason = choice["message"], choice["finish_reason"]
        status = _status(reason)
        output = self.output(message.get("content"), message.get("tool_calls") or [], reason,
                             (choice.get("logprobs") or {}).get("content"), message.get("reasoning"))
        return self.response(status, output, self.usage(chat["usage"]), reason, chat.get("metasd"))

    def event(self, kind: str, **fields) -> str:
        """One server-sent event: its type named twice, as the API does (``event:`` and the data's ``type``)."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def _message_events(self, opening: bool, text: str = "", status: str = "completed",
                        logprobs: list | None = None) -> list[str]:
        """The events that open the message (output item 0) or close it with its whole ``text``."""
        where = self.text_at
        index = where["output_index"]
        if opening:
            return [self.event("response.output_item.added", output_index=index, item=self.message("", "in_progress")),
                    self.event("response.content_part.added", **where, part=self.part(""))]
        return [self.event("response.output_text.done", **where, text=text, logprobs=logprobs or []),
                self.event("response.content_part.done", **where, part=self.part(text, logprobs)),
                self.event("response.output_item.done", output_index=index, item=self.message(text, status, logprobs))]

    def _reasoning_events(self, delta: str | None, thought: str) -> list[str]:
        """The reasoning item's events: opened with its first ``delta``, a delta each, closed (``delta`` None) with
        the whole ``thought``."""
        where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
        if delta is None:
            return [self.event("response.reasoning_text.done", **where, text=thought),
                    self.event("response.output_item.done", output_index=0, item=self.reasoning(thought))]
        opening = [] if self.reasoned else [
            self.event("response.output_item.added", output_index=0, item=self.reasoning("", "in_progress"))]
        self.reasoned = True
        return opening + [self.event("response.reasoning_text.delta", **where, delta=delta)]

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
        the model made no call), the calls follow it as output items 1, 2, ... (0, 1, ... without text). A text
        delta carries the log-probabilities that came since the last one (a chunk may bring a held-back token's
        without text)."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        text, opened, calls, reason, record, usage = "", False, [], None, None, None
        scores, pending = [], []  # the log-probabilities so far; those no text delta carried yet
        thought, thinking = None, False  # the reasoning so far (None: none came), and whether its item is open
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
                new = (choice.get("logprobs") or {}).get("content") or []
                scores, pending = scores + new, pending + new
                if delta.get("reasoning"):  # the thinking comes first: its item is output 0
                    thought, thinking = (thought or "") + delta["reasoning"], True
                    for event in self._reasoning_events(delta["reasoning"], thought):
                        yield event
                if thinking and (delta.get("content") or delta.get("tool_calls") or choice.get("finish_reason")):
                    thinking = False
                    for event in self._reasoning_events(None, thought):
                        yield event
                if delta.get("content"):
                    if not opened:
                        opened = True
                        for event in self._message_events(opening=True):
                            yield event
                    text += delta["content"]
                    yield self.event("response.output_text.delta", **self.text_at, delta=delta["content"],
                                     logprobs=pending)
                    pending = []
                for call in delta.get("tool_calls") or []:  # whole calls, after the text: the message is done
                    if opened and not calls:
                        for event in self._message_events(opening=False, text=text):
                            yield event
                    calls.append(call)
                    for event in self._call_events(call, len(calls) - int(not opened) + int(self.reasoned)):
                        yield event
                reason = choice.get("finish_reason") or reason
            record = body.get("metasd", record)
        if not calls:  # the message, opened at the end where no text came
            for event in (self._message_events(opening=True) if not opened else []) + \
                    self._message_events(opening=False, text=text, status=_status(reason), logprobs=scores):
                yield event
        status = _status(reason)
        self.final = self.response(status, self.output(text, calls, reason, scores, thought), usage, reason, record)
        yield self.event(f"response.{status}", response=self.final)


#: ``add_responses_route``'s two steps of the chat pipeline: a request body read and checked against a route's model
#: (the key, the drain, the fields, the model name), and a checked chat request submitted (its handles and the
#: ``Completion`` that renders them)
Parse = Callable[[Request, type], Awaitable[Any]]
Start = Callable[[ChatCompletionRequest, str], Awaitable[tuple[list, Any]]]


def add_responses_route(app: FastAPI, model_name: str, parse: Parse, start: Start, store: ResponseStore) -> None:
    """``POST /v1/responses`` on ``app``, served through the chat route's ``parse`` and ``start``, its finished
    responses kept in ``store``; ``GET`` and ``DELETE /v1/responses/{response_id}`` over them."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        req = await parse(request, ResponsesRequest)
        refused = req.refusal()
        if refused:
            raise bad_request(refused[1], refused[0], "unsupported_value")
        earlier = _continued(req, store)
        try:
            chat = req.chat_request(earlier)
        except ValidationError as e:  # a chat extension's value (top_k, min_p, ...): named as the request gave it
            raise from_validation(e, accepted_fields(ResponsesRequest)) from None
        try:
            handles, completion = await start(chat, "chat")
        except ApiError as e:  # the chat request's budget is this request's max_output_tokens
            if e.param == "max_tokens":
                e.param, e.message = "max_output_tokens", e.message.replace("max_tokens", "max_output_tokens")
            raise
        built = ResponseBuilder(req, model_name, stored=req.store and store.enabled)
        items = [*earlier, *req.input_items()]
        if req.stream:
            return StreamingResponse(_kept(built, built.events(stream(handles, completion)), items, store),
                                     media_type="text/event-stream", headers=STREAM_HEADERS)
        whole = built.whole(await answer(request, handles, completion))
        if built.stored:
            store.put(whole, items)
        return JSONResponse(whole)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return JSONResponse(_stored(store, response_id).response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request):
        return JSONResponse(listed(_stored(store, response_id).input_items(), request.query_params))

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise _not_found(store, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def listed(items: list[dict[str, Any]], query) -> dict[str, Any]:
    """A page of a stored response's input items as the API lists them: ``order`` (``desc``, newest first, by
    default, or ``asc``), the items after / before the item ids ``after`` / ``before`` in that order, at most
    ``limit`` (1-100, 20 by default); a 400 naming the query parameter at fault."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", "order")
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be an integer in 1..100, not {query.get('limit')!r}", "limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in ordered]
    for name in ("after", "before"):
        if name in query and query[name] not in ids:
            raise bad_request(f"{name}: no input item {query[name]!r} in this response", name)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(ordered)
    page = ordered[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}


def _continued(req: ResponsesRequest, store: ResponseStore) -> list[Any]:
    """The items of the stored conversation ``previous_response_id`` names (none without one); a 404 naming the field
    where it is not stored (never was, deleted, given up for newer ones), a 400 where this server stores nothing."""
    if req.previous_response_id is None:
        return []
    if not store.enabled:
        raise bad_request("responses are not stored on this server (--max-stored-responses 0): send the whole "
                          "conversation as input", "previous_response_id", "unsupported_value")
    return _stored(store, req.previous_response_id, "previous_response_id").items


def _stored(store: ResponseStore, response_id: str, param: str | None = None):
    stored = store.get(response_id)
    if stored is None:
        raise _not_found(store, response_id, param)
    return stored


def _not_found(store: ResponseStore, response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id {response_id!r} is stored here (never stored, deleted, or given up for "
                         f"newer ones: at most {store.max_entries} are kept)", param=param, code="response_not_found")


async def _kept(built: ResponseBuilder, events: AsyncIterator[str], items: list[Any],
                store: ResponseStore) -> AsyncIterator[str]:
    """``events`` passed on; the response stored once its last event is out (not when the client left before)."""
    async for event in events:
        yield event
    if built.stored and built.final is not None:
        store.put(built.final, items)
