"""The FastAPI app: OpenAI's routes over a running ``Scheduler`` (docs/serving.md#routes).

``create_app(scheduler, model_name, api_key=None)`` is all a caller needs: the CLI runs it with uvicorn, the tests in
a thread, Ray Serve in each replica. Every request is checked (fields, types, the model, the context) before it is
submitted; a full queue is a 429 with ``Retry-After`` and nothing started; a client that goes away cancels its
request, which frees its batch slot at the scheduler's next step.
"""
from __future__ import annotations

import hmac
import logging
import math
import re
import time
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from metasd.core.constraints import INSTALL_HINT, AfterThinking, Constraint, ConstraintError, compile_constraint
from metasd.core.decoding.prompt import encode_infill, infill_format, infill_stop_ids
from metasd.core.batching.jobs import PROCESSING, SAMPLING
from metasd.core.batching.scheduler import QueueFullError, RequestOptions, SchedulerClosedError
from metasd.core.execution.kv_memory import KVBudgetError, draft_headroom, tokens_alone

from .errors import ApiError, bad_request, error_body, from_validation, unknown_model
from .http_log import HttpObserver
from .logprobs import TokenIdNames, TokenNames
from .metrics import ServeMetrics
from .middleware import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit, ServerHeader
from .openai_responses import add_responses_route
from .response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from .protocol import ChatCompletionRequest, CompletionRequest, accepted_fields, generation_defaults
from .unknown_fields import ignored_fields, refused_field
from .answers import STREAM_HEADERS, answer, draining, stream
from .responses import Completion
from .chat_template import ChatTemplates
from .reasoning import served_reasoning
from .tokenize import add_tokenizer_routes
from .tools import PARSERS, ToolCalls, added_tokens, template_takes_tools, tool_parser

#: the fields of the scheduler's ValueErrors, as the request spells them (``submit`` names the field it refuses):
#: its sampling and processing arguments are the request's fields of the same names (a constraint has several)
_SUBMIT_PARAMS = {"max_new_tokens": "max_tokens", "drafter": "metasd.drafter", "draft_budget": "metasd.draft_budget",
                  "speculate": "metasd.speculate", "seed": "seed", "prompt": "prompt",
                  **{f: f for f in sorted((SAMPLING | PROCESSING) - {"chat", "constraint"})}}

log = logging.getLogger(__name__)


class ServeState:
    """What the routes share: the scheduler, the served model's name, the API key, the metrics, and whether the
    server is draining (``begin_drain``: new generation requests get 503, running ones finish)."""

    def __init__(self, scheduler, model_name: str | Sequence[str], api_key: str | None, metrics: ServeMetrics,
                 retry_after_s: int = 1, max_model_len: int | None = None, generation_config: str = "auto",
                 tool_call_parser: str = "auto", chat_template: str | None = None,
                 trust_request_chat_template: bool = False, reasoning_parser: str | None = None):
        #: every name a request may give in ``model``; the first is the one answers and errors name
        self.model_names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
        model_name = self.model_names[0]
        self.scheduler, self.model_name, self.api_key, self.metrics = scheduler, model_name, api_key, metrics
        self.retry_after_s, self.draining = retry_after_s, False
        self.created = int(time.time())
        engine = scheduler.engine
        self.tokenizer = engine.tokenizer
        self.context_length = engine.verifier.context_length
        if max_model_len is not None:  # --max-model-len: serve less context than the model has, never more
            if self.context_length and max_model_len > self.context_length:
                raise ValueError(f"--max-model-len {max_model_len} exceeds the context of {model_name} "
                                 f"({self.context_length} tokens)")
            self.context_length = max_model_len
        #: the most tokens (prompt + new) one request may hold alone in the KV budget (None: the context bounds it)
        cache = getattr(scheduler.verifier, "cache", None)
        self.kv_tokens = None if cache is None else tokens_alone(
            cache, self.context_length, draft_headroom(getattr(scheduler, "max_draft_nodes", 0)))
        if self.kv_tokens == 0:
            raise ValueError(f"the KV budget cannot hold one request of {model_name} (a reservation of its draft "
                             f"headroom alone does not fit): start with a larger --kv-budget")
        if self.kv_tokens is not None:
            log.warning("the KV budget holds one request of at most %d tokens (prompt and answer; %s's context is "
                        "%s): a request without max_tokens gets what fits, one asking for more is refused "
                        "(--kv-budget sets the budget)", self.kv_tokens, model_name, self.context_length or "unbounded")
        self.vocab_size = getattr(getattr(engine.verifier.model, "config", None), "vocab_size", None)
        self.drafters = [d.name for d in engine.drafters]
        self.names = TokenNames(self.tokenizer)  # names the tokens of log-probabilities
        self.id_names = TokenIdNames(self.tokenizer)  # names them "token_id:<id>" (return_tokens_as_token_ids)
        if generation_config not in ("auto", "none"):
            raise ValueError(f"generation_config must be 'auto' or 'none', got {generation_config!r}")
        #: what a request that leaves a sampling field unset gets: the model's generation_config (``auto``)
        self.defaults = generation_defaults(engine.verifier.model) if generation_config == "auto" else {}
        if self.defaults:
            log.info("request defaults from %s's generation_config: %s", model_name, self.defaults)
        #: how chats are rendered: the server's template (--chat-template, else the model's) and a request's options
        self.templates = ChatTemplates(self.tokenizer, model_name, chat_template, trust_request_chat_template)
        template = self.templates.text
        self.takes_tools = template_takes_tools(template)
        #: reads the model's tool calls out of its text (and writes the grammar of an enforced call); None: none
        self.tool_parser = tool_parser(tool_call_parser, template)
        #: reads a chat answer's thinking out of its text (None: all content); its markers' tokens (None: not tokens)
        self.reasoning, self.thinking_ids = served_reasoning(reasoning_parser, self.tokenizer, template, model_name)
        #: the tokens that end a fill-in-the-middle answer (a completion with ``suffix``); None: the model has no format
        infill = infill_format(self.tokenizer)
        self.infill_stops = infill_stop_ids(self.tokenizer, infill) if infill else None

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

    def names_for(self, req) -> TokenNames:
        """How the request's log-probabilities name tokens: by their text, or ``token_id:<id>``."""
        return self.id_names if req.return_tokens_as_token_ids else self.names

    def prompt_ids(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[list[list[int]], str]:
        """Each prompt's token ids (chat messages through the chat template; completions may give several prompts)
        and the field they came from."""
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if field == "messages" and not (self.templates.text or req.chat_template):
            raise bad_request(f"{self.model_name} has no chat template: use /v1/completions", field)
        tools = req.tool_functions() if field == "messages" else None
        if tools:
            self.check_tools(req)
        template = self.templates.options(req) if field == "messages" else {}
        if field == "prompt" and req.suffix:
            prompts = [self._infill_ids(req, prompt) for prompt in req.prompt_values()]
        else:
            prompts = [self._ids(prompt, field, tools, template) for prompt in req.prompt_values()]
        return self.truncated(prompts, req.truncate_prompt_tokens), field

    def truncated(self, prompts: list[list[int]], keep: int | None) -> list[list[int]]:
        """vLLM's ``truncate_prompt_tokens``: each prompt's last ``keep`` tokens (-1: as many as the context holds;
        None: the prompts as they are)."""
        keep = self.context_length if keep == -1 else keep
        if keep is None:
            return prompts
        if self.context_length and keep > self.context_length:
            raise bad_request(f"truncate_prompt_tokens ({keep}) is more than {self.model_name}'s context of "
                              f"{self.context_length} tokens", "truncate_prompt_tokens")
        return [ids[-keep:] for ids in prompts]

    def _ids(self, prompt, field: str, tools, template: dict) -> list[int]:
        """One prompt's token ids: token ids as given (checked against the vocabulary), text encoded."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad = [t for t in prompt if not 0 <= t < (self.vocab_size or 2**63)]
            if bad:
                raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", field)
            return list(prompt)
        try:
            ids = self.scheduler.engine.encode(prompt, chat=field == "messages", tools=tools, **template)
        except (ValueError, TypeError) as e:
            raise bad_request(f"{field}: {e}", field) from None
        if not ids:
            raise bad_request(f"{field}: the prompt is empty after tokenisation", field)
        return ids

    def _infill_ids(self, req: CompletionRequest, prompt) -> list[int]:
        """A completion's prompt with a ``suffix``: the text before the gap, then the suffix, in the model's
        fill-in-the-middle format."""
        if not isinstance(prompt, str):
            raise bad_request("suffix: fill in the middle takes text prompts, not token ids", "suffix")
        if req.echo:
            raise bad_request("echo and suffix cannot be combined: the answer is inserted, not continued", "echo")
        try:
            return encode_infill(self.tokenizer, prompt, req.suffix, self.model_name).ids
        except ValueError as e:
            raise bad_request(f"suffix: {e}", "suffix", "infill_unsupported") from None

    def budget(self, req, n_prompt: int, prompt_field: str) -> int:
        """``max_tokens`` checked against the context; when not given, what the context leaves (as vLLM does)."""
        budget, limit = req.token_budget(), self.context_length
        chat = isinstance(req, ChatCompletionRequest)
        field = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        if limit and n_prompt >= limit:
            raise bad_request(f"the prompt is {n_prompt} tokens; {self.model_name}'s context is {limit} tokens",
                              prompt_field, "context_length_exceeded")
        if budget is None:  # the model's max_new_tokens, else what the context leaves - within what the KV holds
            fits = [n - n_prompt for n in (limit, self.kv_tokens) if n is not None]
            model_cap = [self.defaults["max_tokens"]] if "max_tokens" in self.defaults else []
            budget = min(model_cap + fits, default=1024)
            if budget < 1:
                raise bad_request(f"the prompt is {n_prompt} tokens; the KV budget holds one request of at most "
                                  f"{self.kv_tokens} tokens", prompt_field, "kv_budget_exceeded")
            return budget
        if limit and n_prompt + budget > limit:
            raise bad_request(f"the prompt ({n_prompt} tokens) and {field}={budget} exceed {self.model_name}'s context "
                              f"of {limit} tokens (at most {limit - n_prompt} new tokens fit)", field,
                              "context_length_exceeded")
        return budget

    def check_tools(self, req) -> None:
        """A 400 when the chat template cannot show the model its tools, or when the request needs its calls read
        (``tool_choice`` other than ``none``) and no parser knows the model's format."""
        if not self.takes_tools:
            raise bad_request(f"{self.model_name}'s chat template does not render tools", "tools", "tools_unsupported")
        if req.tool_mode() != "none" and self.tool_parser is None:
            raise bad_request(f"no tool-call parser reads {self.model_name}'s format: start the server with "
                              f"--tool-call-parser (one of {', '.join(PARSERS)}), or send tool_choice 'none'",
                              "tool_choice", "tools_unsupported")

    def tool_calls(self, req) -> ToolCalls | None:
        """How to read the choices' tool calls (None: the request's text is all content)."""
        if not isinstance(req, ChatCompletionRequest) or req.tool_mode() == "none":
            return None
        return ToolCalls(self.tool_parser, req.parallel_tool_calls)

    def constraint(self, req):
        """The request's structured output compiled for the verifier's tokenizer (cached per schema), or None; a 400
        naming the field for a bad one, or when the grammar library is not installed. A required or named tool
        call is one: the grammar of the model's own call format."""
        mode = req.tool_mode() if isinstance(req, ChatCompletionRequest) else "none"
        enforced = mode in ("required", "named")  # a call the grammar writes
        try:
            spec = req.constraint()
            if enforced:
                if spec is not None:
                    raise ConstraintError("tool_choice", f"a required tool call is structured output already; "
                                                         f"drop {spec.kind!r} output or set tool_choice 'auto'")
                try:
                    spec = Constraint.grammar_of(self.tool_parser.grammar(
                        req.callable_functions(), req.parallel_tool_calls, added_tokens(self.tokenizer)))
                except ConstraintError as e:  # a tool's parameters that are no JSON schema llguidance reads
                    raise ConstraintError("tools", f"a function's parameters {e.reason}") from None
            if spec is None:
                return None
            return compile_constraint(self.tokenizer, spec, sorted(self.scheduler.engine.eos_ids()) or None)
        except ConstraintError as e:
            raise bad_request(str(e), e.field, "invalid_structured_output") from None
        except ImportError:
            raise bad_request(f"the server cannot serve {'a required tool call' if enforced else 'structured output'}"
                              f": {INSTALL_HINT}", "tool_choice" if enforced else "response_format",
                              "structured_output_unavailable") from None

    def submit_choices(self, req, prompts: list[tuple[list[int], int]], constraint=None) -> list:
        """One scheduler request per choice of each prompt (``prompts``: its ids and new-token budget; ``n`` each,
        choice i of a seeded request sampling with seed + i, so the choices differ and each is reproducible), in the
        order of their ``index`` (prompt p's choice i: p x n + i); when one cannot be queued, those queued before it
        are cancelled."""
        most = self.scheduler.max_queue + self.scheduler.max_batch  # what the queue and the batch can ever hold
        if len(prompts) * req.n > most:
            raise bad_request(f"{len(prompts)} prompt(s) x n={req.n} ask for more completions than this server can "
                              f"hold at once ({most}: --max-queue + --max-batch)", "n" if len(prompts) == 1 else
                              "prompt", "too_many_completions")
        handles = []
        try:
            for ids, max_new_tokens in prompts:
                for i in range(req.n):
                    handles.append(self.submit(req, ids, max_new_tokens, seed_offset=i, constraint=constraint))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    def submit(self, req, ids: list[int], max_new_tokens: int, seed_offset: int = 0, constraint=None):
        opts = req.metasd
        if opts and opts.drafter is not None and opts.drafter not in self.drafters:
            names = ", ".join(self.drafters) or "none"
            raise bad_request(f"no drafter named {opts.drafter!r} in the pool; drafters: {names}", "metasd.drafter",
                              "unknown_drafter")
        options = RequestOptions(drafter=opts.drafter, draft_budget=opts.draft_budget, speculate=opts.speculate) \
            if opts else RequestOptions()
        logprobs, prompt_logprobs = req.logprob_options()
        seed = None if req.seed is None else (req.seed + seed_offset) % 2 ** 64  # a generator's seed is a uint64
        processing = req.processing()
        if getattr(req, "suffix", None):  # fill in the middle: the format's end tokens end the answer too
            processing["stop_token_ids"] = sorted({*(processing["stop_token_ids"] or ()), *self.infill_stops})
        try:
            return self.scheduler.submit(
                ids, max_new_tokens, stop=req.stops() or None, seed=seed, **processing,
                chat=False, options=options, logprobs=logprobs, prompt_logprobs=prompt_logprobs, constraint=constraint,
                **req.sampling(self.defaults))
        except QueueFullError:
            raise ApiError(429, "the server's queue is full; retry later", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)}) from None
        except SchedulerClosedError:
            raise draining() from None
        except KVBudgetError as e:  # could never fit, even alone: the client must ask for less
            raise bad_request(str(e).replace("max_new_tokens", "max_tokens", 2), "max_tokens",
                              "kv_budget_exceeded") from None
        except ValueError as e:  # the scheduler names the field first ("seed must be ...", "drafter: ...")
            message = str(e)
            field = re.match(r"[a-z_]+", message)
            field = field.group(0) if field and field.group(0) in _SUBMIT_PARAMS else \
                next((f for f in sorted(_SUBMIT_PARAMS, key=len, reverse=True) if f in message), None)
            raise bad_request(message, _SUBMIT_PARAMS.get(field)) from None


def create_app(scheduler, model_name: str | Sequence[str], api_key: str | None = None, *, metrics: ServeMetrics | None = None,
               retry_after_s: int = 1, server_id: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_model_len: int | None = None,
               metrics_require_key: bool = False, access_log: bool = True, generation_config: str = "auto",
               tool_call_parser: str = "auto", max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
               chat_template: str | None = None, trust_request_chat_template: bool = False,
               reasoning_parser: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over ``scheduler`` (started by the caller), serving it as ``model_name`` (several
    names: each accepted and listed, answers naming the first); with
    ``api_key`` every route but ``/health``, ``/version`` and ``/metrics`` (that one too with
    ``metrics_require_key``) needs ``Authorization: Bearer <api_key>``; with ``server_id`` every response carries it
    in ``x-metasd-server``; a request body over ``max_body_bytes`` gets 413, one not received within
    ``body_timeout_s`` seconds 408; ``max_model_len`` caps the context served; ``access_log``: a log line per
    request (logger ``metasd.serve.access``); ``generation_config``: "auto" fills a request's unset temperature,
    top_p, top_k, min_p, repetition_penalty and max_tokens from the model's ``generation_config`` (vLLM's), "none"
    leaves OpenAI's defaults; ``tool_call_parser``: the format the model's tool calls are read in (a name of
    ``tools.PARSERS``; "auto": from the chat template; "none": tool calls are not read, tool_choice other than
    'none' refused); ``max_stored_responses``: the Responses API's responses kept for ``previous_response_id`` (0:
    none); ``chat_template``: the template chats are rendered through instead of the model's (its text,
    ``chat_template.read_chat_template``); ``trust_request_chat_template``: a request may send a template of its own;
    ``reasoning_parser``: how a chat answer's thinking is read out of it (a name of ``reasoning.PARSERS``; None: not).
    ``app.state.serve`` is its ``ServeState`` (``begin_drain()`` stops admission for a graceful shutdown)."""
    metrics = metrics or ServeMetrics(model_name if isinstance(model_name, str) else model_name[0])
    state = ServeState(scheduler, model_name, api_key, metrics, retry_after_s, max_model_len, generation_config,
                       tool_call_parser, chat_template, trust_request_chat_template, reasoning_parser)
    metrics.attach(scheduler)
    app = FastAPI(title="metasd", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serve = state
    if server_id:
        app.add_middleware(ServerHeader, value=server_id)
    if not (isinstance(body_timeout_s, (int, float)) and math.isfinite(body_timeout_s) and body_timeout_s > 0):
        raise ValueError(f"body_timeout_s must be a finite number of seconds > 0, got {body_timeout_s!r}")
    app.add_middleware(BodyLimit, limit=max_body_bytes, timeout=float(body_timeout_s))

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
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body("internal error (the server's log has it)", "server_error"), status_code=500)

    async def parse(request: Request, model: type):
        """The request's body checked against the route's ``model``: the API key, the drain, the fields, the model."""
        state.check_auth(request)
        if state.draining:
            raise draining()
        body = await request.body()
        try:  # parsing and tokenising a large body is work: off the event loop, which every stream shares
            req = await run_in_threadpool(model.model_validate_json, body)
        except ValidationError as e:
            raise from_validation(e, accepted_fields(model)) from None
        refused = refused_field(req)
        if refused:
            raise bad_request(refused[1], refused[0], "unsupported_value")
        ignored = ignored_fields(req)
        if ignored:  # as vLLM: accepted, named in the log, so a client's misspelt option can be found
            log.warning("%s: the request's fields %s were ignored (not used by this server)", request.url.path,
                        ", ".join(ignored))
        if req.model and req.model not in state.model_names:  # null or "": the served model (as vLLM)
            raise unknown_model(req.model, state.model_name)
        return req

    async def start(req, kind: str) -> tuple[list, Completion]:
        """A checked request's choices submitted (``kind``: "chat" or "text"), and the ``Completion`` that renders
        them."""
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        prompts, prompt_field = await run_in_threadpool(state.prompt_ids, req)
        budgets = [state.budget(req, len(ids), prompt_field) for ids in prompts]
        constraint = await run_in_threadpool(state.constraint, req)  # compiling a grammar is work: off the loop too
        completion = Completion(kind, state.model_name, sum(map(len, prompts)), *req.usage_options(), n=req.n,
                                names=state.names_for(req) if req.logprob_options()[0] is not None else None,
                                tools=state.tool_calls(req), echo_top=req.logprobs if kind == "text" else None,
                                prompt_scores=None if req.prompt_logprobs is None else (state.names_for(req),
                                                                                        req.prompt_logprobs))
        if kind == "chat" and state.reasoning is not None:  # one prompt: its choices start alike
            completion.reasoning, completion.include_reasoning = state.reasoning, req.include_reasoning
            completion.tokenizer = state.tokenizer
            completion.reasoning_inside = await run_in_threadpool(state.reasoning.starts_inside, state.tokenizer,
                                                                  prompts[0])
            if constraint is not None and state.thinking_ids:  # the grammar holds the answer, not the thinking
                constraint = AfterThinking(constraint, *state.thinking_ids, completion.reasoning_inside)
        if kind == "text" and req.echo:  # each prompt as given (token ids, a truncated prompt: their text), before
            texts = [p if isinstance(p, str) and req.truncate_prompt_tokens is None  # each of its choices
                     else await run_in_threadpool(state.tokenizer.decode, ids)
                     for p, ids in zip(req.prompt_values(), prompts)]
            completion.echo = [text for text in texts for _ in range(req.n)]
        elif kind == "chat" and req.echoed() is not None:  # the assistant message it continues, before each choice
            completion.echo = [req.echoed()] * req.n
        # the last step: queued, answered
        return state.submit_choices(req, list(zip(prompts, budgets)), constraint), completion

    async def generate(request: Request, model: type, kind: str):
        req = await parse(request, model)
        handles, completion = await start(req, kind)
        if req.stream:
            return StreamingResponse(stream(handles, completion), media_type="text/event-stream",
                                     headers=STREAM_HEADERS)
        return JSONResponse(await answer(request, handles, completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, "text")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                            "owned_by": "metasd", "max_model_len": state.context_length}
                                           for name in state.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        state.check_auth(request)
        if model_id not in state.model_names:
            raise unknown_model(model_id, state.model_name)
        return next(m for m in (await models(request))["data"] if m["id"] == model_id)

    @app.get("/health")
    async def health():
        healthy, reason = scheduler.health()
        if not healthy:  # its thread died, or its last steps all failed: a load balancer should send elsewhere
            return JSONResponse({"status": "failed", "reason": reason}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        if metrics_require_key:
            state.check_auth(request)
        return Response(metrics.render(), media_type=metrics.content_type)

    add_responses_route(app, state.model_name, parse, start, ResponseStore(max_stored_responses))
    add_tokenizer_routes(app, state)
    app.add_middleware(HttpObserver, metrics=metrics, routes={getattr(r, "path", "") for r in app.routes},
                       log=access_log)  # the outermost: it sees every answer, a 413 and a 401 included
    return app
