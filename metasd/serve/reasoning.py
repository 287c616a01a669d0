"""A reasoning model's thinking read out of its answer (vLLM's ``--reasoning-parser``): the text between ``<think>``
and ``</think>`` goes to the message's ``reasoning`` (and ``reasoning_content``, its older name that DeepSeek's API,
llama-server and SGLang use), the rest to ``content`` - where tool calls are then read. Nothing is lost: reasoning and
content together are the answer without its two markers.

Where the thinking starts: in the answer (Qwen3 writes ``<think>`` first), or in the prompt - a chat template that
opens the block itself (Qwen3's thinking models, DeepSeek-R1's later templates) leaves an unclosed ``<think>`` at
the prompt's end, and the answer starts inside it. ``qwen3`` reads where from the prompt and the answer's start: an
answer that neither starts with ``<think>`` nor follows an open one is all content (Qwen3 with
``enable_thinking: false``, whose template writes an empty block into the prompt). ``deepseek_r1`` always starts
inside the block, as DeepSeek-R1 answers with its thinking and no ``<think>``. A block never closed (the budget ran
out while the model thought) is all reasoning. The markers are matched in the text, so they are found however the
tokenizer splits them and whether or not they are special tokens.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from metasd.core.constraints import thinking_tokens

START, END = "<think>", "</think>"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its thinking (``PARSERS``); ``opens``: the answer always starts inside the block."""

    name: str
    opens: bool = False

    def inside(self, prompt_text: str) -> bool:
        """Whether an answer to ``prompt_text`` starts inside the block: the format says so, or the prompt ends in an
        open one (its last ``<think>`` after its last ``</think>``)."""
        return self.opens or prompt_text.rfind(START) > prompt_text.rfind(END)

    def starts_inside(self, tokenizer, prompt: list[int]) -> bool:
        """``inside`` for a prompt given as token ids (its last 512 tokens' text)."""
        return self.inside(tokenizer.decode(prompt[-512:]))

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole answer; reasoning None where the answer has none."""
        stream = self.stream(inside)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning if stream.reasoned else None), content

    def stream(self, inside: bool) -> "ReasoningStream":
        return ReasoningStream(inside)

    def count_tokens(self, tokenizer, ids: Sequence[int], inside: bool) -> int:
        """How many of an answer's tokens ``ids`` are its thinking, the markers included (usage's
        ``reasoning_tokens``): none where the answer has no block, all where it never closed, else those up to the
        one that completes ``</think>`` - found by bisection over the text of the answer's first k tokens, read as
        the answer is read, so a marker spelt in several tokens counts alike."""
        def read(k: int) -> ReasoningStream:
            stream = self.stream(inside)
            stream.feed(tokenizer.decode(list(ids[:k]), skip_special_tokens=True))
            return stream
        whole = read(len(ids))
        if not whole.reasoned:
            return 0
        if whole.state != "content":  # never closed: all thinking
            return len(ids)
        lo, hi = 1, len(ids)  # the fewest tokens whose text closes the block
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if read(mid).state == "content" else (mid + 1, hi)
        return lo


class ReasoningStream:
    """Splits one answer's text as it comes (``feed`` each piece, ``finish`` at the end) into reasoning and content,
    holding back only what may be the start of a marker."""

    def __init__(self, inside: bool):
        #: "undecided" (the answer may still open a block), "thinking", or "content" (every later piece is content)
        self.state = "thinking" if inside else "undecided"
        self.reasoned = inside  # whether the answer had a block (reasoning then, possibly empty)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next piece) makes safe to send."""
        text, self.held = self.held + text, ""
        reasoning = content = ""
        while text:
            if self.state == "content":
                return reasoning, content + text
            if self.state == "undecided":
                opening = text.lstrip()
                if START.startswith(opening):  # "", "<", "<thi", "<think>": may still open a block
                    if opening == START:
                        self.state, self.reasoned, text = "thinking", True, ""
                        continue
                    self.held = text
                    return reasoning, content
                if opening.startswith(START):
                    self.state, self.reasoned = "thinking", True
                    text = opening[len(START):]
                    continue
                self.state = "content"
                continue
            # thinking: up to the end marker; hold back a tail that may be its start
            end = text.find(END)
            if end >= 0:
                reasoning += text[:end]
                self.state, text = "content", text[end + len(END):]
                continue
            keep = _marker_prefix(text, END)
            reasoning += text[:len(text) - keep]
            self.held = text[len(text) - keep:]
            return reasoning, content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the answer's end: reasoning inside an unclosed block, else content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "thinking" else ("", held)


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker`` (0: none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


#: the formats, by vLLM's parser names
PARSERS = {"qwen3": ReasoningParser("qwen3"), "deepseek_r1": ReasoningParser("deepseek_r1", opens=True)}


def reasoning_parser_named(name: str | None) -> ReasoningParser | None:
    """The parser ``--reasoning-parser`` names (None: none); ValueError naming the option for an unknown name."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return PARSERS[name] if name else None


def served_reasoning(name: str | None, tokenizer, template: str | None,
                     model_name: str) -> tuple[ReasoningParser | None, tuple[int, int] | None]:
    """The parser ``--reasoning-parser`` names, and the ids of the block's two markers where each is one token of the
    tokenizer: structured output then holds the answer after the thinking (metasd/core/constraints/thinking.py);
    None where they are not, and the answer is held from its first token. The log says where either leaves the
    thinking where a user may not expect it."""
    parser = reasoning_parser_named(name)
    if parser is None:
        if "<think>" in (template or ""):
            log.warning("the chat template of %s writes <think>: start with --reasoning-parser qwen3 (or deepseek_r1) "
                        "to answer the thinking in message.reasoning instead of the content", model_name)
        return None, None
    ids = thinking_tokens(tokenizer, START, END)
    if ids is None:
        log.warning("%s's tokenizer has no single token for %s or %s: structured output and required tool calls hold "
                    "the answer from its first token (the model cannot think first)", model_name, START, END)
    return parser, ids
