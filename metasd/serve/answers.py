"""From submitted requests to HTTP answers: the whole response, or its server-sent events, for the ``n`` scheduler
requests one API request became (one per choice). A client that goes away cancels them all; a choice that fails
fails the answer (the others are cancelled) with an OpenAI-style error that names the request id and nothing of the
exception, which the log has.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from metasd.core.execution.kv_memory import KVAllocationError

from .errors import ApiError
from .records import served_record
from .responses import FINISH_REASONS, Completion, sse

log = logging.getLogger("metasd.serve.app")
#: the headers of a streamed answer: no caching, and no buffering by a proxy in front (nginx's X-Accel-Buffering)
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def draining() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                    code="server_shutting_down", headers={"Retry-After": "5"})


def failed(event, request_id: str) -> ApiError:
    """A request that failed inside the server: what a client may know, never the exception's text (the log has it,
    under the request's id)."""
    if event is not None and isinstance(event.error, KVAllocationError):
        return ApiError(503, "the server could not allocate KV memory for this request; retry later",
                        type="server_error", code="out_of_memory", headers={"Retry-After": "5"})
    log.error("request %s failed: %r", request_id, getattr(event, "error", None))
    return ApiError(500, f"the request failed inside the server (request {request_id}; the server's log has the "
                         f"error)", type="server_error", code="internal_error")


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _went_wrong(event) -> bool:
    """Whether a choice's last event says it failed inside the server (None: its events could not be read)."""
    return event is None or event.finish_reason == "error" or bool(event.error)


async def _collect(handle, handles: Sequence) -> tuple[str, Any]:
    """The request's whole text and its last event; when it failed, the other choices (``handles``) are cancelled:
    the answer fails whatever they do."""
    parts, last = [], None
    async for event in handle.aevents():
        parts.append(event.text or "")
        last = event
        if event.finished:
            break
    if _went_wrong(last) or last.finish_reason == "cancelled":
        _cancel_unfinished(handles)
    return "".join(parts), last


def _cached(event) -> int:
    """The prompt tokens a finished request reused from the prefix cache."""
    result = getattr(event, "result", None)
    return result.stats.cached_prompt_tokens if result is not None else 0


def _finished(event, request_id: str, completion: Completion, index: int) -> tuple[str, dict[str, Any], int]:
    """A finished event of choice ``index`` as (OpenAI finish reason, served record, completion tokens), its thinking
    tokens counted; ApiError when it failed."""
    if _went_wrong(event):
        raise failed(event, request_id)
    if event.finish_reason == "cancelled":
        raise draining()
    result = event.result
    record = served_record(result.to_record() if result is not None else None)
    tokens = len(result.token_ids) if result is not None else 0
    if result is not None:
        completion.count_reasoning(index, result.token_ids)
    return FINISH_REASONS.get(event.finish_reason, "stop"), record, tokens


def _cancel_unfinished(handles) -> None:
    for h in handles:
        if not h.finished:
            h.cancel()


async def answer(request: Request, handles: Sequence, completion: Completion) -> dict[str, Any]:
    """Wait for every choice's whole completion; cancel them when the client goes away first."""
    work = asyncio.ensure_future(asyncio.gather(*(_collect(h, handles) for h in handles)))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            _cancel_unfinished(handles)
            work.cancel()
    if not work.done() or work.cancelled():
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    for handle, (_, last) in zip(handles, work.result()):  # a choice that failed names the failure, not the
        if _went_wrong(last):  # others its failure cancelled
            raise failed(last, handle.id)
    choices, records, total, cached = [], [], 0, {}
    for index, (handle, (text, last)) in enumerate(zip(handles, work.result())):
        cached[index] = _cached(last)
        reason, record, tokens = _finished(last, handle.id, completion, index)
        result = last.result
        logprobs = None
        if completion.echo is not None and completion.names is not None and completion.kind == "text":
            # the prompt's tokens first (a chat's echoed message is part of a templated prompt, not scored alone)
            logprobs = completion.logprobs([], result.prompt_logprobs, handle.prompt_ids, index)
        own = completion.logprobs(result.logprobs if result is not None else None, index=index)
        logprobs = own if logprobs is None else {k: logprobs[k] + own[k] for k in own}
        prompt_scores = result.prompt_logprobs if result is not None else None
        echo = completion.echo[index] if completion.echo is not None else ""
        choices.append(completion.choice(index, text, reason, logprobs, prompt_scores, echo))
        records.append(record)
        total += tokens
    return completion.whole(choices, total, records[0] if len(records) == 1 else records,
                            completion.cached_tokens(cached))


async def stream(handles: Sequence, completion: Completion) -> AsyncIterator[str]:
    """The server-sent events of every choice, as their tokens come (each chunk names its choice's ``index``);
    closing the stream (the client went away) cancels them."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle) -> None:
        try:
            async for event in handle.aevents():
                await queue.put((index, event))
                if event.finished:
                    return
        except Exception:  # noqa: BLE001 - reported below as this choice's failure
            log.exception("request %s: reading its events failed", handle.id)
            await queue.put((index, None))

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    if completion.continuous_usage:
        completion.progress = {i: [len(h.prompt_ids), 0] for i, h in enumerate(handles)}
    try:
        if completion.kind == "chat":
            for index in range(len(handles)):
                yield sse(completion.chunk(None, first=True, index=index))
        echo = dict(enumerate(completion.echo or [None] * len(handles)))
        # chat with tools: per choice, the content that is safe to send (none of a call) until the calls are whole
        calls = {index: completion.tools.stream() for index in range(len(handles))} if completion.tools else {}
        # chat on a server with a reasoning parser: per choice, its thinking split from its content (before the calls)
        thinking = {index: completion.reasoning_stream() for index in range(len(handles))} if completion.reasoning \
            else {}
        remaining, total, cached = len(handles), 0, {}
        while remaining:
            index, event = await queue.get()
            handle = handles[index]
            if _went_wrong(event) or event.finish_reason == "cancelled":
                error = failed(event, handle.id) if event is None or event.finish_reason != "cancelled" else draining()
                yield sse(error.body())
                yield sse("[DONE]")  # the stream ends as every stream does (as vLLM's)
                return
            if echo[index] is not None and (event.token_ids or (event.finished and event.result is not None)):
                prompt = event.prompt_logprobs if event.token_ids else event.result.prompt_logprobs
                if completion.kind == "text":
                    logprobs = completion.logprobs([], prompt, handle.prompt_ids, index)
                    yield sse(completion.chunk(echo[index], logprobs=logprobs, index=index))
                else:  # a chat's continued message: content, through the tool-call parser where there is one
                    content = calls[index].feed(echo[index]) if calls else echo[index]
                    if content:
                        yield sse(completion.chunk(content, index=index))
                echo[index] = None  # the prompt (scored by now) before the first new tokens
            if completion.continuous_usage and event.token_ids:
                completion.progress[index][1] += len(event.token_ids)
            logprobs = completion.logprobs(event.logprobs, index=index) if event.token_ids else None
            thought, text = thinking[index].feed(event.text or "") if thinking else ("", event.text)
            if event.finished and thinking:  # what the splitter held back: the end of the thinking, or content
                held_thought, held = thinking[index].finish()
                thought, text = thought + held_thought, (text or "") + held
            text = calls[index].feed(text or "") if calls else text
            if (text or thought or logprobs) and not event.finished:
                yield sse(completion.chunk(text, logprobs=logprobs, index=index, reasoning=thought))
            if event.finished:
                reason, record, tokens = _finished(event, handle.id, completion, index)
                total, cached[index] = total + tokens, _cached(event)
                remaining -= 1
                if calls:
                    rest, made = calls[index].finish()
                    text = (text or "") + rest
                    if made:
                        if text or thought:
                            yield sse(completion.chunk(text, index=index, reasoning=thought))
                        text, thought, reason = None, "", "tool_calls"
                        yield sse(completion.chunk(None, tool_calls=made, index=index))
                yield sse(completion.chunk(text, reason, record=record, index=index, reasoning=thought))
        if completion.include_usage:
            yield sse(completion.usage_chunk(total, completion.cached_tokens(cached)))
        yield sse("[DONE]")
    finally:
        for p in pumps:
            p.cancel()
        _cancel_unfinished(handles)
