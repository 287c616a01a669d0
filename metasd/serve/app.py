"""The FastAPI app: OpenAI's routes over a running ``Scheduler`` (docs/serving.md#routes).

``create_app(scheduler, model_name, api_key=None)`` is all a caller needs: the CLI runs it with uvicorn, the tests in
a thread, Ray Serve in each replica. Every request is checked (fields, types, the model, the context) before it is
submitted; a full queue is a 429 with ``Retry-After`` and nothing started; a client that goes away cancels its
request, which frees its batch slot at the scheduler's next step.
"""
from __future__ import annotations

import asyncio
import hmac
import re
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from metasd.core.batching.scheduler import QueueFullError, RequestOptions, SchedulerClosedError

from .errors import ApiError, bad_request, error_body, from_validation
from .metrics import ServeMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, accepted_fields
from .records import served_record
from .responses import FINISH_REASONS, Completion, sse

#: the fields of the scheduler's ValueErrors, as the request spells them (``submit`` names the field it refuses)
_SUBMIT_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                  "stop": "stop", "seed": "seed", "drafter": "metasd.drafter", "draft_budget": "metasd.draft_budget",
                  "speculate": "metasd.speculate", "prompt": "prompt"}
_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ServeState:
    """What the routes share: the scheduler, the served model's name, the API key, the metrics, and whether the
    server is draining (``begin_drain``: new generation requests get 503, running ones finish)."""

    def __init__(self, scheduler, model_name: str, api_key: str | None, metrics: ServeMetrics,
                 retry_after_s: int = 1):
        self.scheduler, self.model_name, self.api_key, self.metrics = scheduler, model_name, api_key, metrics
        self.retry_after_s = retry_after_s
        self.draining = False
        self.created = int(time.time())
        engine = scheduler.engine
        self.tokenizer = engine.tokenizer
        self.context_length = engine.verifier.context_length
        self.vocab_size = getattr(getattr(engine.verifier.model, "config", None), "vocab_size", None)
        self.drafters = [d.name for d in engine.drafters]

    def begin_drain(self) -> None:
        self.draining = True

    # ------------------------------------------------------------------ checks before anything is queued
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with the key the "
                                "server was started with", type="authentication_error", code="invalid_api_key")

    def prompt_ids(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[list[int], str]:
        """The prompt's token ids (chat messages through the chat template) and the field they came from."""
        engine = self.scheduler.engine
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if field == "messages" and not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"{self.model_name} has no chat template: use /v1/completions", field)
        prompt = req.prompt() if field == "messages" else req.prompt_value()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad = [t for t in prompt if not 0 <= t < (self.vocab_size or 2**63)]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", field)
            return list(prompt), field
        try:
            ids = engine.encode(prompt, chat=field == "messages")
        except (ValueError, TypeError) as e:
            raise bad_request(f"{field}: {e}", field) from None
        if not ids:
            raise bad_request(f"{field}: the prompt is empty after tokenisation", field)
        return ids, field

    def budget(self, req, n_prompt: int, prompt_field: str) -> int:
        """``max_tokens`` checked against the context; when not given, what the context leaves (as vLLM does)."""
        budget, limit = req.token_budget(), self.context_length
        field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        if limit and n_prompt >= limit:
            raise bad_request(f"the prompt is {n_prompt} tokens; {self.model_name}'s context is {limit} tokens",
                              prompt_field, "context_length_exceeded")
        if budget is None:
            return limit - n_prompt if limit else 1024
        if limit and n_prompt + budget > limit:
            raise bad_request(f"the prompt ({n_prompt} tokens) and {field}={budget} exceed {self.model_name}'s context "
                              f"of {limit} tokens (at most {limit - n_prompt} new tokens fit)", field,
                              "context_length_exceeded")
        return budget

    def submit(self, req, ids: list[int], max_new_tokens: int):
        opts = req.metasd
        if opts and opts.drafter is not None and opts.drafter not in self.drafters:
            names = ", ".join(self.drafters) or "none"
            raise bad_request(f"no drafter named {opts.drafter!r} in the pool; drafters: {names}", "metasd.drafter",
                              "unknown_drafter")
        options = RequestOptions(drafter=opts.drafter, draft_budget=opts.draft_budget, speculate=opts.speculate) \
            if opts else RequestOptions()
        try:
            return self.scheduler.submit(
                ids, max_new_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=req.stops() or None,
                seed=req.seed, chat=False, options=options)
        except QueueFullError:
            raise ApiError(429, "the server's queue is full; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)}) from None
        except SchedulerClosedError:
            raise _draining() from None
        except ValueError as e:  # the scheduler names the field first ("seed must be ...", "drafter: ...")
            message = str(e)
            field = re.match(r"[a-z_]+", message)
            field = field.group(0) if field and field.group(0) in _SUBMIT_PARAMS else \
                next((f for f in _SUBMIT_PARAMS if f in message), None)
            raise bad_request(message, _SUBMIT_PARAMS.get(field)) from None


def _draining() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                    code="server_shutting_down", headers={"Retry-After": "5"})


def _failed(event) -> ApiError:
    return ApiError(500, f"the request failed inside the server: {event.error or 'unknown error'}",
                    type="server_error", code="internal_error")


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(handle) -> tuple[str, Any]:
    """The request's whole text and its last event."""
    parts, last = [], None
    async for event in handle.aevents():
        parts.append(event.text or "")
        last = event
        if event.finished:
            break
    return "".join(parts), last


def _finished(event, completion: Completion) -> tuple[str, dict[str, Any], int]:
    """A finished event as (OpenAI finish reason, served record, completion tokens); ApiError when it failed."""
    if event is None or event.finish_reason == "error" or event.error:
        raise _failed(event)
    if event.finish_reason == "cancelled":
        raise _draining()
    result = event.result
    record = served_record(result.to_record() if result is not None else None)
    tokens = len(result.token_ids) if result is not None else 0
    return FINISH_REASONS.get(event.finish_reason, "stop"), record, tokens


async def _answer(request: Request, handle, completion: Completion) -> dict[str, Any]:
    """Wait for the whole completion; cancel the request when the client goes away first."""
    work = asyncio.ensure_future(_collect(handle))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            handle.cancel()
            work.cancel()
    if not work.done() or work.cancelled():
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    text, last = work.result()
    reason, record, tokens = _finished(last, completion)
    return completion.whole(text, reason, tokens, record)


async def _stream(handle, completion: Completion) -> AsyncIterator[str]:
    """The server-sent events of one request; closing the stream (the client went away) cancels the request."""
    done = False
    try:
        if completion.kind == "chat":
            yield sse(completion.chunk(None, first=True))
        async for event in handle.aevents():
            if event.finish_reason in ("error", "cancelled") or event.error:
                error = _failed(event) if event.finish_reason != "cancelled" else _draining()
                done = True
                yield sse(error.body())
                return
            if event.text and not event.finished:
                yield sse(completion.chunk(event.text))
            if event.finished:
                reason, record, tokens = _finished(event, completion)
                done = True
                yield sse(completion.chunk(event.text, reason, record=record))
                if completion.include_usage:
                    yield sse(completion.usage_chunk(tokens))
                yield sse("[DONE]")
                return
    finally:
        if not done:
            handle.cancel()


class _ServerHeader:
    """ASGI middleware: every response names the server that answered (``x-metasd-server``), e.g. a Ray replica."""

    def __init__(self, app, value: str):
        self.app, self.header = app, (b"x-metasd-server", value.encode())

    async def __call__(self, scope, receive, send):
        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named if scope["type"] == "http" else send)


def create_app(scheduler, model_name: str, api_key: str | None = None, *, metrics: ServeMetrics | None = None,
               retry_after_s: int = 1, server_id: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over ``scheduler`` (started by the caller), serving it as ``model_name``; with
    ``api_key`` every route but ``/health`` needs ``Authorization: Bearer <api_key>``; with ``server_id`` every
    response carries it in ``x-metasd-server``. ``app.state.serve`` is its ``ServeState`` (``begin_drain()`` stops
    admission for a graceful shutdown)."""
    metrics = metrics or ServeMetrics(model_name)
    metrics.attach(scheduler)
    state = ServeState(scheduler, model_name, api_key, metrics, retry_after_s)
    app = FastAPI(title="metasd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    if server_id:
        app.add_middleware(_ServerHeader, value=server_id)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)

    async def generate(request: Request, model: type, kind: str):
        state.check_auth(request)
        if state.draining:
            raise _draining()
        try:
            req = model.model_validate_json(await request.body())
        except ValidationError as e:
            raise from_validation(e, accepted_fields(model)) from None
        if req.model != state.model_name:
            raise bad_request(f"The model {req.model!r} does not exist: this server serves {state.model_name!r}",
                              "model", "model_not_found")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        ids, prompt_field = state.prompt_ids(req)
        budget = state.budget(req, len(ids), prompt_field)
        handle = state.submit(req, ids, budget)
        completion = Completion(kind, state.model_name, len(ids), req.include_usage())
        if req.stream:
            return StreamingResponse(_stream(handle, completion), media_type="text/event-stream",
                                     headers=_STREAM_HEADERS)
        return JSONResponse(await _answer(request, handle, completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, "text")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "metasd", "max_model_len": state.context_length}]}

    @app.get("/health")
    async def health():
        failure = getattr(scheduler, "failure", None)
        if failure is not None:  # the scheduler thread died: no request can be served (the server must be restarted)
            return JSONResponse({"status": "failed", "error": f"{type(failure).__name__}: {failure}"[:500]},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        state.check_auth(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
