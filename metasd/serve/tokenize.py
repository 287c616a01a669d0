"""``/tokenize``, ``/detokenize`` and ``/version``, with vLLM's request and response shapes.

``POST /tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
"add_generation_prompt": true, "continue_final_message": false, "add_special_tokens": false}`` (the chat template
applied as ``/v1/chat/completions`` applies it, with the request's ``tools``, ``documents``, ``chat_template_kwargs``
and ``chat_template``: ``chat_template.py``), either with ``"return_token_strs": true`` and an optional ``model``, and
answers ``{"count", "max_model_len", "tokens", "token_strs"}``; with their defaults the tokens are what the completion
routes prefill.
``POST /detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. ``GET /version`` answers
``{"version": metasd's version}``.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import Request
from pydantic import Field, ValidationError
from starlette.concurrency import run_in_threadpool

from metasd.core.decoding.prompt import render_chat

from .errors import bad_request, from_validation, unknown_model
from .chat_template import TemplateFields
from .protocol import ChatMessage, Lenient, Tool


class TokenizeRequest(Lenient, TemplateFields):
    """``POST /tokenize``: a ``prompt`` string or chat ``messages`` (one of them; ``TemplateFields``: rendered as the
    chat route renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None  # rendered with the messages, as the chat route renders them
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message left open, as the chat route's field of that name
    return_token_strs: bool | None = False


class DetokenizeRequest(Lenient):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def metasd_version() -> str:
    try:
        return version("metasd")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout that is not installed
        return "unknown"


def add_tokenizer_routes(app, state) -> None:
    """The three routes, on ``app`` over ``state`` (a ``ServeState``); /tokenize and /detokenize need the API key."""

    async def parse(request: Request, model):
        state.check_auth(request)
        try:
            req = await run_in_threadpool(model.model_validate_json, await request.body())
        except ValidationError as e:
            raise from_validation(e, sorted(model.model_fields)) from None
        if req.model and req.model not in state.model_names:
            raise unknown_model(req.model, state.model_name)
        return req

    def tokenize(req: TokenizeRequest) -> dict:
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", "prompt" if req.prompt is None else "messages")
        if req.messages is not None:
            if not (state.templates.text or req.chat_template):
                raise bad_request(f"{state.model_name} has no chat template: tokenize a prompt", "messages")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            options = state.templates.options(req)
            try:
                text = render_chat(tok, [m.rendered() for m in req.messages], tools, **options)
            except ValueError as e:  # continue_final_message with add_generation_prompt, or a template's refusal
                raise bad_request(f"messages: {e}", "continue_final_message" if req.continue_final_message
                                  else "messages") from None
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": state.context_length, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def detokenize(req: DetokenizeRequest) -> dict:
        bad = [t for t in req.tokens if state.vocab_size and t >= state.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{state.vocab_size - 1})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await run_in_threadpool(tokenize, await parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await run_in_threadpool(detokenize, await parse(request, DetokenizeRequest))

    @app.get("/version")
    async def version_route():
        return {"version": metasd_version()}
