"""The request bodies the server accepts, as pydantic models that refuse unknown fields and wrong types (``strict``:
``"5"`` is not an integer), and refuse the OpenAI options metasd cannot honour (``n > 1``, ``logprobs``, a
``logit_bias``, a JSON ``response_format``, penalties) instead of silently ignoring them (docs/serving.md#requests).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: the most stop strings a request may give, and the longest (every step searches the new text for each)
MAX_STOPS = 16
MAX_STOP_CHARS = 256
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


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and no choices)."""

    include_usage: bool = False
    include_obfuscation: bool | None = None  # newer clients send it; streams here carry no obfuscation padding


class TextPart(_Strict):
    """One part of a message's content given as a list: only text parts are served."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; the content as a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    """``response_format``: only plain text is served (no JSON mode, no schemas)."""

    type: Literal["text"]


def _only(value, allowed, what: str):
    if value is not None and value not in allowed:
        raise ValueError(what)
    return value


class _Common(_Strict):
    """Fields both routes take."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # not OpenAI's; vLLM takes it too
    stop: _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    metasd: MetasdOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        return _only(v, (1,), f"only n=1 is served (one choice per request), got {v}")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        return _only(v, (0,), f"penalties change the verifier's distribution, which lossless decoding keeps: only 0 "
                              f"is served, got {v}")

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported (only an empty one is accepted)")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _only(v, (False,), "logprobs are not supported")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        return _only(v, (0,), "logprobs are not supported")

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def prompt(self) -> list[dict[str, str]]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in self.messages]


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string (encoded as it is: no chat template), a list of one string, or
    a list of token ids."""

    prompt: Annotated[str, Field(min_length=1)] | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and (not v or (isinstance(v[0], str) and len(v) != 1)):
            raise ValueError("one prompt per request: a string, a list of one string, or a non-empty list of token ids")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        return _only(v, (0,), "logprobs are not supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _only(v, (False,), "echo is not supported")

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v):
        return _only(v, (1,), f"only best_of=1 is served, got {v}")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _only(v, ("",), "suffix (insertion) is not supported")

    def token_budget(self) -> int | None:
        return self.max_tokens

    def prompt_value(self) -> str | list[int]:
        return self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], str) else self.prompt


def accepted_fields(model: type[BaseModel]) -> list[str]:
    """The top-level fields a route accepts (named in the error for an unknown one)."""
    return sorted(model.model_fields)
