"""The request bodies the server accepts, as pydantic models that refuse wrong types (``strict``: ``"5"`` is not an
integer). Fields they do not declare are kept aside (``Lenient``) for ``unknown_fields.py``: refused where they would
change the output, else accepted and named in the log (docs/serving.md#requests). metasd's own ``metasd`` options
stay strict: a misspelt one is refused.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from metasd.core.constraints import GUIDED_FIELDS, Constraint, constraint_from_fields
from metasd.core.decoding.bad_words import MAX_BAD_WORDS
from metasd.core.execution.logprobs import MAX_TOP_LOGPROBS

from .chat_template import TemplateFields
from .protocol_messages import (ChatMessage, FunctionCall, Lenient, MessageToolCall, NamedToolChoice,  # noqa: F401
                                TextPart, Tool, ToolFunction)  # (re-exported: the routes' modules import them here)

#: the most stop strings a request may give, and the longest (every step searches the new text for each)
MAX_STOPS = 16
MAX_STOP_CHARS = 256
#: the most choices (``n``) one request may ask for: each is a request of its own in the batch
MAX_CHOICES = 16
#: the most completions (prompts x ``n``) one /v1/completions request may ask for
MAX_COMPLETIONS = 64
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MetasdOptions(_Strict):
    """metasd's own per-request options, in the extension field ``metasd`` (the openai client sends it with
    ``extra_body={"metasd": {...}}``): the drafter to use (a name of the pool), the most draft tokens a step may
    verify for this request, and whether to speculate at all (false: plain decoding)."""

    drafter: str | None = None
    draft_budget: int | None = Field(None, ge=0)
    speculate: bool = True


class StreamOptions(Lenient):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and no choices);
    ``continuous_usage_stats`` (vLLM's, with ``include_usage``) adds each chunk's choice's usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # newer clients send it; streams here carry no obfuscation padding


class ResponseFormat(Lenient):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (structured output, docs/serving.md#structured-output),
    or llama-server's ``{"type": "json_object", "schema": {...}}``; the schema is checked when the request is
    (``Constraint.from_response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama-server's json_object with a schema


def _only(value, allowed, what: str):
    if value is not None and value not in allowed:
        raise ValueError(what)
    return value


class _Common(Lenient):
    """Fields both routes take."""

    model: str | None = None  # null or left out: the served model (as vLLM)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # not OpenAI's; vLLM takes it too (0 or -1: off)
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's and llama-server's; 0: off
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=-2 ** 63, lt=2 ** 64)  # vLLM's int64 range, and uint64 (seeds are mod 2^64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension; 1 = off
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM's: generate past end-of-sequence tokens up to max_tokens (fixed-length benchmarks)
    min_tokens: int = Field(0, ge=0)  # vLLM's: no end-of-sequence token, and no stop string, before this many tokens
    stop_token_ids: list[int] | None = Field(None, max_length=64)  # vLLM's: tokens that end the answer as EOS does
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens generated (empty: no restriction)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string (or token) that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the answer
    return_tokens_as_token_ids: bool = False  # vLLM's: log-probabilities name tokens "token_id:<id>"
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None  # vLLM's: keep the last k
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)  # vLLM's: words never generated
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it on completions too
    guided_json: dict[str, Any] | str | None = None  # vLLM's older structured-output fields
    guided_regex: str | None = None
    guided_grammar: str | None = None  # a Lark grammar (llguidance's dialect), not xgrammar's EBNF
    guided_choice: list[str] | None = None  # exactly one of these strings
    #: vLLM's extension: the prompt tokens' log-probabilities, each with this many alternatives (not with stream)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    metasd: MetasdOptions | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v, info):
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs is not available with stream: true (as in vLLM)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, v):
        """OpenAI's form: token ids as strings (JSON keys), each bias in [-100, 100]."""
        for token, amount in (v or {}).items():
            if not token.strip().isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not (math.isfinite(amount) and -100 <= amount <= 100):
                raise ValueError(f"the bias of token {token} must be in [-100, 100], got {amount!r}")
        return v

    def token_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer token ids (None: no bias); ids outside the vocabulary are refused at submit."""
        return {int(t): float(b) for t, b in self.logit_bias.items()} if self.logit_bias else None

    def processing(self) -> dict[str, Any]:
        """The logit bias, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``,
        ``include_stop_str_in_output``, ``bad_words``, ``skip_special_tokens``: as ``Scheduler.submit`` takes them."""
        return {"logit_bias": self.token_bias(), "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                "stop_token_ids": self.stop_token_ids or None, "allowed_token_ids": self.allowed_token_ids or None,
                "include_stop_str_in_output": self.include_stop_str_in_output, "bad_words": self.bad_words or None,
                "skip_special_tokens": self.skip_special_tokens}

    def sampling(self, defaults: dict | None = None) -> dict[str, float | int]:
        """Every sampling and penalty setting as ``Scheduler.submit`` takes it, resolved in this one place: the
        request's value; unset, the model's ``generation_config`` value (``defaults``: ``generation_defaults``, with
        ``--generation-config auto``); else OpenAI's default (``SAMPLING_FALLBACKS``; a penalty left out: off)."""
        defaults = defaults or {}
        out: dict[str, float | int] = {}
        for field, fallback in SAMPLING_FALLBACKS.items():
            value = getattr(self, field)
            value = value if value is not None else defaults.get(field, fallback)
            if value is not None:
                out[field] = max(int(value), 0) if field == "top_k" else float(value)  # top_k -1: off, as 0
        return out

    def constraint(self) -> Constraint | None:
        """The structured output asked for (at most one of ``response_format`` and vLLM's ``guided_*`` fields);
        ``ConstraintError`` naming the field at fault."""
        fields = {name: getattr(self, name) for name in GUIDED_FIELDS}
        if self.response_format is not None:
            fields["response_format"] = self.response_format.model_dump(exclude_none=True, by_alias=True)
        return constraint_from_fields(fields)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def usage_options(self) -> tuple[bool, bool]:
        """(the usage in a last chunk, each chunk's usage so far): ``stream_options``' two switches, the second only
        with the first (as vLLM reads them)."""
        usage = bool(self.stream_options and self.stream_options.include_usage)
        return usage, usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_Common, TemplateFields):
    """``POST /v1/chat/completions`` (``TemplateFields``: how its chat is rendered, ``chat_template.py``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    #: vLLM's chat template switches: the assistant's turn opened after the messages (the default), or the last
    #: message - the start of an assistant's answer - left open and continued (``continue_final_message``)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: vLLM's: each choice's content begins with the last message's content where that is the assistant's
    echo: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, false leaves the thinking out of the answer

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, v):
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError(f"two functions share a name ({', '.join(names)})")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_its_tool(cls, v, info):
        names = [t.function.name for t in info.data.get("tools") or []]
        if not names and v not in (None, "none", "auto"):
            raise ValueError("'required' or a named function needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"names {v.function.name!r}, which is not among the tools ({', '.join(names)})")
        return v

    def tool_mode(self) -> str:
        """How this request uses its tools: ``"none"`` (no tools, or never call them: no parsing), ``"auto"`` (the
        model may call them: its answer is parsed), ``"required"`` (it must: one or more calls, enforced) or
        ``"named"`` (it must call the one named, enforced)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def tool_functions(self) -> list[dict[str, Any]]:
        """The tools as the chat template and the call grammar take them; with a named choice the grammar gets only
        that one (``callable_functions``)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def callable_functions(self) -> list[dict[str, Any]]:
        """The functions a call may name: the named one, else every tool."""
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in functions if f["name"] == self.tool_choice.function.name]
        return functions

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError(f"top_logprobs={v} needs logprobs: true")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continues_an_assistant_message(cls, v, info):
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt "
                             "false")
        if v and "messages" in info.data and info.data["messages"][-1].role != "assistant":
            raise ValueError(f"continue_final_message continues an assistant's message; the last message is the "
                             f"{info.data['messages'][-1].role}'s")
        return v

    def echoed(self) -> str | None:
        """``echo``: the text each choice's content begins with - the last message's, where it is the assistant's
        (as vLLM); None: nothing echoed."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else None

    def logprob_options(self) -> tuple[int | None, int | None]:
        """(alternatives per new token, per prompt token) to ask the scheduler for; None: none asked."""
        return ((self.top_logprobs or 0) if self.logprobs else None), self.prompt_logprobs

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt(self) -> list[dict[str, Any]]:
        return [m.rendered() for m in self.messages]

    def prompt_values(self) -> list[list[dict[str, Any]]]:
        """The one prompt: the messages as the chat template takes them."""
        return [self.prompt()]


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string (encoded as it is: no chat template) or a list of token ids, or
    a list of either (several prompts, as vLLM: choice ``i`` of prompt ``p`` is ``index`` p x n + i)."""

    prompt: Annotated[str, Field(min_length=1)] | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None  # the text after the gap: fill in the middle ("" or null: none; the server checks it)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v, info):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("a string, a non-empty list of token ids, or a non-empty list of either")
        many = len(v) if isinstance(v, list) and not isinstance(v[0], int) else 1
        n = info.data.get("n", 1)
        if many * n > MAX_COMPLETIONS:
            raise ValueError(f"{many} prompts x n={n} ask for more than {MAX_COMPLETIONS} completions in one request")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v):
        return _only(v, (1,), f"only best_of=1 is served, got {v}")

    def token_budget(self) -> int | None:
        return self.max_tokens

    def logprob_options(self) -> tuple[int | None, int | None]:
        """(alternatives per new token, per prompt token - for an ``echo`` with ``logprobs``, or ``prompt_logprobs``:
        the larger) to ask the scheduler for."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return self.logprobs, max(asked, default=None)

    def prompt_values(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


#: OpenAI's value of a sampling field that neither the request nor the model's generation_config sets (None: the
#: penalty is off)
SAMPLING_FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": None,
                      "frequency_penalty": None, "repetition_penalty": None}


#: the ``generation_config`` fields a server started with ``--generation-config auto`` uses as request defaults, by the
#: request field they fill
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model) -> dict[str, float | int]:
    """The request defaults a model's ``generation_config`` sets (only what differs from transformers' own defaults,
    as vLLM reads it), by request field: ``{"temperature": 0.7, "top_p": 0.8, "max_tokens": 512}``."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    diff = config.to_diff_dict()
    return {field: diff[key] for key, field in GENERATION_DEFAULTS.items() if diff.get(key) is not None}


def accepted_fields(model: type[BaseModel]) -> list[str]:
    """The top-level fields a route accepts (named in the error for an unknown one)."""
    return sorted(model.model_fields)
