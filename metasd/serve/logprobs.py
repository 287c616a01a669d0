"""Log-probabilities in OpenAI's shapes (docs/serving.md#log-probabilities): the chat route's ``logprobs.content`` (one entry
per token, with its ``top_logprobs``) and the completions route's legacy ``logprobs`` (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). The numbers are the verifier's raw log-probabilities
(``metasd.core.execution.logprobs``); this module only names the tokens.

A token's ``token`` is its text decoded alone (a byte-level token holding part of a character decodes to U+FFFD, as
in vLLM); its ``bytes`` are its exact bytes where the tokenizer is byte-level (GPT-2's byte-to-character map read
back), else its text's UTF-8.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

from metasd.core.execution.logprobs import TokenLogprob


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the others (controls, space, ...) for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenNames:
    """Names the tokens of one tokenizer (cached per id): text, bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        named = self._cache.get(token)
        if named is None:
            text = self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)
            raw = None
            if self.byte_level:
                piece, table = self.tokenizer.convert_ids_to_tokens(token), _unicode_to_byte()
                if isinstance(piece, str) and piece and all(c in table for c in piece):
                    raw = [table[c] for c in piece]
            named = self._cache[token] = (text, raw if raw is not None else list(text.encode("utf-8")))
        return named


class TokenIdNames(TokenNames):
    """vLLM's ``return_tokens_as_token_ids``: each token named ``token_id:<id>`` (its bytes: that text's), so a client
    can tell apart tokens whose text is the same or not valid UTF-8 alone."""

    def __call__(self, token: int) -> tuple[str, list[int]]:
        name = f"token_id:{int(token)}"
        return name, list(name.encode("utf-8"))


def chat_content(names: TokenNames, scores: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content`` of a chat completion (or of one streamed chunk)."""
    out = []
    for s in scores:
        text, raw = names(s.token)
        top = []
        for token, lp in s.top:
            t, b = names(token)
            top.append({"token": t, "logprob": lp, "bytes": b})
        out.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(names: TokenNames, scores: Sequence[TokenLogprob], offset: int = 0,
                        unscored_first: int | None = None) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion: per token its text, log-probability, its alternatives as
    {text: log-probability} (the token itself added when it is not among them, as vLLM does) and the offset of its text in the choice's text (from ``offset``). ``unscored_first``: an echoed
    prompt's first token, which nothing predicts (listed first, with None for its log-probability)."""
    tokens, values, tops, offsets = [], [], [], []
    if unscored_first is not None:
        text = names(unscored_first)[0]
        tokens.append(text)
        values.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(text)
    for s in scores:
        text = names(s.token)[0]
        tokens.append(text)
        values.append(s.logprob)
        top = {names(t)[0]: lp for t, lp in s.top}
        if s.token not in {t for t, _ in s.top}:
            top[text] = s.logprob
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(names: TokenNames, scores: Sequence[TokenLogprob | None], top: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token None (the first: nothing predicts it) or
    ``{token id: {"logprob", "rank", "decoded_token"}}`` - the prompt token first, then its position's ``top`` most
    likely tokens not already listed (rank 1 = the most likely)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for s in scores:
        if s is None:
            out.append(None)
            continue
        entry = {str(s.token): {"logprob": s.logprob, "rank": s.rank, "decoded_token": names(s.token)[0]}}
        for rank, (token, lp) in enumerate(s.top[:top], start=1):
            entry.setdefault(str(token), {"logprob": lp, "rank": rank, "decoded_token": names(token)[0]})
        out.append(entry)
    return out
