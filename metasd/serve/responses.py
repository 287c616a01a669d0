"""Response bodies in OpenAI's shapes: a whole completion, and the chunks of a streamed one (server-sent events).

Both routes' bodies carry, beside OpenAI's fields, the extension field ``metasd``: this request's record, filtered
by ``metasd.serve.records.served_record`` (docs/serving.md#the-metasd-extension-field).
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from metasd.core.execution.logprobs import TokenLogprob

from .logprobs import TokenNames, chat_content, completion_logprobs, vllm_prompt_logprobs
from .reasoning import ReasoningParser, ReasoningStream
from .tools import ToolCall, ToolCalls

#: the scheduler's finish reasons as OpenAI names them (an EOS token is a natural stop)
FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class Completion:
    """What one request's responses share: its id, kind (``chat`` or ``text``), creation time and model, and per
    choice (``n`` of them) where its completions route's log-probability offsets stand."""

    kind: str
    model: str
    prompt_tokens: int  # of every prompt (completions may give several)
    include_usage: bool = False
    #: vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far (``progress``)
    continuous_usage: bool = False
    n: int = 1  # choices per prompt: choice ``index`` answers prompt index // n
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    #: set when the request asked for log-probabilities: names their tokens (``logprobs``)
    names: TokenNames | None = None
    echo: list[str] | None = None  # completions with ``echo``: per choice, its prompt's text, sent before its own
    #: completions: per choice, where its next token's text starts in the choice's text (streams included)
    text_offsets: dict[int, int] = field(default_factory=dict)
    #: chat with tools the model may call: how its text is read for calls (None: all content)
    tools: ToolCalls | None = None
    #: completions with ``echo`` and ``logprobs``: alternatives per echoed prompt token (the scheduler may have scored
    #: more, for ``prompt_logprobs``)
    echo_top: int | None = None
    #: vLLM's ``prompt_logprobs`` asked: (token names, alternatives per prompt token)
    prompt_scores: tuple[TokenNames, int] | None = None
    #: chat on a server with a reasoning parser: how the answer's thinking is read (None: all content), whether the
    #: answers start inside a thinking block the prompt opened, and whether the request wants the reasoning sent
    reasoning: ReasoningParser | None = None
    reasoning_inside: bool = False
    include_reasoning: bool = True
    tokenizer: Any = None  # with a reasoning parser: reads each answer's thinking tokens (``count_reasoning``)
    #: per choice, its answer's thinking tokens (``usage.completion_tokens_details.reasoning_tokens``)
    reasoning_tokens: dict[int, int] = field(default_factory=dict)
    #: a stream with ``continuous_usage``: per choice, (its prompt's tokens, the tokens generated so far)
    progress: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.kind == "chat" else "cmpl-") + secrets.token_hex(12)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def usage(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens reused from the prefix cache."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": self.prompt_tokens + completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        if self.reasoning is not None:  # the answers' thinking, where a parser reads it
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self.reasoning_tokens.values())}
        return usage

    def count_reasoning(self, index: int, token_ids: Sequence[int]) -> None:
        """Record how many of choice ``index``'s tokens are thinking (nothing to do without a reasoning parser)."""
        if self.reasoning is not None:
            self.reasoning_tokens[index] = self.reasoning.count_tokens(self.tokenizer, token_ids,
                                                                       self.reasoning_inside)

    def cached_tokens(self, per_choice: dict[int, int]) -> int:
        """The prompt tokens reused from the prefix cache, from each choice's count (``index`` -> tokens): per prompt
        the most any of its choices reused (its choices share one prompt), summed over the prompts."""
        per_prompt: dict[int, int] = {}
        for index, tokens in per_choice.items():
            per_prompt[index // self.n] = max(per_prompt.get(index // self.n, 0), tokens)
        return sum(per_prompt.values())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, scores: Sequence[TokenLogprob] | None, echoed: Sequence[TokenLogprob | None] | None = None,
                 prompt_ids: Sequence[int] = (), index: int = 0) -> dict[str, Any] | None:
        """Choice ``index``'s ``logprobs`` for ``scores`` (None when the request did not ask): chat's ``content`` list,
        or the completions route's legacy object, ``echoed`` (the prompt's scores, first token unscored) first."""
        if self.names is None:
            return None
        if self.kind == "chat":
            return {"content": chat_content(self.names, scores or []), "refusal": None}
        unscored, scored = None, list(scores or [])
        if echoed:
            top = self.echo_top
            trimmed = [e if top is None else dataclasses.replace(e, top=e.top[:top]) for e in echoed[1:]]
            unscored, scored = prompt_ids[0], [*trimmed, *scored]
        body = completion_logprobs(self.names, scored, self.text_offsets.get(index, 0), unscored)
        if body["tokens"]:
            self.text_offsets[index] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict[str, Any] | None,
               prompt_scores: Sequence[TokenLogprob | None] | None = None, echo: str = "") -> dict[str, Any]:
        """One choice of the non-streamed response (``echo``: the text it begins with, ``echo``'s); a chat answer's
        thinking (``reasoning``) in ``message.reasoning``, its tool calls (``tools``) in ``message.tool_calls``, the
        finish reason then ``tool_calls``; with ``prompt_scores`` asked for, vLLM's ``prompt_logprobs``."""
        if self.kind == "chat":
            thought = None
            if self.reasoning is not None:  # the new text's (the echoed message is the prompt's)
                thought, text = self.reasoning.split(text, self.reasoning_inside)
            message: dict[str, Any] = {"role": "assistant", "content": echo + text}
            if thought is not None:
                message.update(self.reasoning_fields(thought))
            if self.tools is not None:
                message["content"], calls = self.tools.split(echo + text)
                if calls:
                    message["tool_calls"] = [c.body() for c in calls]
                    finish_reason = "tool_calls"
            body = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            body = {"index": index, "text": echo + text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.prompt_scores is not None:
            names, top = self.prompt_scores
            body["prompt_logprobs"] = vllm_prompt_logprobs(names, prompt_scores or [], top)
        return body

    def reasoning_stream(self) -> ReasoningStream | None:
        """A choice's streamed answer split into reasoning and content (None: no reasoning parser)."""
        return None if self.reasoning is None else self.reasoning.stream(self.reasoning_inside)

    def reasoning_fields(self, text: str) -> dict[str, str]:
        """A message's (or a delta's) reasoning, under vLLM's name and the older one most other servers use."""
        return {"reasoning": text, "reasoning_content": text} if self.include_reasoning else {}

    def whole(self, choices: list[dict[str, Any]], completion_tokens: int,
              record: dict[str, Any] | list[dict[str, Any]], cached_tokens: int = 0) -> dict[str, Any]:
        """The non-streamed response: its ``choices`` (``choice``), the usage of them all and the ``metasd`` record
        (with n > 1, one per choice)."""
        return {**self._head(self.object), "choices": choices, "usage": self.usage(completion_tokens, cached_tokens),
                "metasd": record}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
              record: dict[str, Any] | None = None, logprobs: dict[str, Any] | None = None,
              index: int = 0, tool_calls: list[ToolCall] | None = None, reasoning: str | None = None) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: new text (and the ``logprobs`` of its tokens), new ``reasoning``
        (a chat answer's thinking) or a chat answer's ``tool_calls`` (each whole, in one chunk), or (with
        ``finish_reason``) the last chunk of the choice, which carries its ``metasd`` record; a chat stream's first
        chunk of a choice names the role."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if reasoning:
                delta.update(self.reasoning_fields(reasoning))
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [c.body(i) for i, c in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
            if self.continuous_usage and index in self.progress:  # vLLM's: this choice's usage so far
                prompt, done = self.progress[index]
                body["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        if record is not None:
            body["metasd"] = record
        return body

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self.usage(completion_tokens, cached_tokens)}
