"""From what a caller gives to the verifier's token ids: ``encode_prompt`` (strings, chat messages, token ids; chat
messages through ``render_chat``), ``encode_infill`` (the text before and after a gap, in a code model's
fill-in-the-middle format) and the context check (``check_context``). Needs no model, only its tokenizer, so a
command can check a prompt before any model loads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from jinja2 import TemplateError, TemplateSyntaxError

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


def render_chat(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False, *,
                documents: Sequence[Mapping] | None = None, chat_template: str | None = None,
                variables: Mapping[str, Any] | None = None) -> str:
    """The text of chat ``messages`` through the tokenizer's chat template (which it must have, unless
    ``chat_template`` gives one instead), OpenAI's ``tools`` rendered as the template renders them: what a chat
    prompt's tokens encode (without special tokens added), for ``encode_prompt`` and the server's ``/tokenize`` alike.
    ``add_generation_prompt``: the start of the assistant's turn after the messages; ``continue_final_message``:
    instead, the last message left open (its end-of-turn removed), so that the answer continues it - an assistant
    message's start given by the client. ``documents``: retrieved passages (dicts, e.g. ``title`` and ``text``) for a
    template that renders them; ``variables``: more names the template reads (vLLM's ``chat_template_kwargs``, e.g.
    Qwen3's ``enable_thinking``). A template that refuses the messages (its ``raise_exception``) or does not parse
    raises ValueError with its message."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt false")
    try:
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
            documents=[dict(d) for d in documents] if documents else None, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False, continue_final_message=continue_final_message,
            **dict(variables or {}))
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None
    except TemplateError as e:
        raise ValueError(f"the chat template refused the messages: {e}") from None


def encode_prompt(tokenizer, prompt: Prompt, chat: bool | None = None, model_name: str = "the verifier",
                  tools: Sequence[Mapping] | None = None, **template: Any) -> list[int]:
    """Prompt -> token ids, as ``Engine.encode`` does: token ids as given, message lists through the chat template
    (with ``tools``, OpenAI's tool objects, rendered as the template renders them; ``template``: ``render_chat``'s
    other options - ``add_generation_prompt``, ``continue_final_message``, ``documents``, ``chat_template``,
    ``variables``), strings through it when ``chat`` (else encoded as they
    are). Needs no model, only its tokenizer, so a command can check a prompt's length before any model loads."""
    def tokenizer_or_fail():
        if tokenizer is None:
            raise ValueError(f"{model_name} has no tokenizer: pass token ids")
        return tokenizer

    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    if not isinstance(prompt, str):
        prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")
    if isinstance(prompt, str):
        if chat:
            return encode_prompt(tokenizer, [{"role": "user", "content": prompt}], True, model_name, tools, **template)
        return tokenizer_or_fail().encode(prompt, add_special_tokens=True)
    if all(isinstance(t, int) for t in prompt):
        return prompt
    if all(isinstance(m, Mapping) for m in prompt):
        tok = tokenizer_or_fail()
        if not (template.get("chat_template") or getattr(tok, "chat_template", None)):
            raise ValueError(f"{model_name}'s tokenizer has no chat template; pass a string prompt")
        return tok.encode(render_chat(tok, prompt, tools, **template), add_special_tokens=False)
    raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int | None, model_name: str) -> None:
    """``ValueError`` when the prompt and the new tokens do not fit the verifier's context."""
    if context_length and prompt_tokens + max_new_tokens > context_length:
        raise ValueError(f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                         f"{model_name} ({context_length} tokens)")


@dataclass(frozen=True)
class InfillFormat:
    """A code model's fill-in-the-middle format, by its marker tokens: the prompt is ``prefix`` + the text before the
    gap + ``suffix`` + the text after it + ``middle`` (PSM order), and the model writes the gap's text, ending it with
    its end-of-text token or another of ``ends`` (a marker: the middle is over)."""

    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...] = ()

    def markers(self) -> tuple[str, ...]:
        return self.prefix, self.suffix, self.middle


#: the fill-in-the-middle formats metasd knows; a tokenizer's is the first whose three markers are tokens of its
#: vocabulary (``infill_format``)
INFILL_FORMATS = (
    # Qwen2.5-Coder, CodeGemma
    InfillFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                 ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")),
    # StarCoder, StarCoder2, SantaCoder, Granite Code
    InfillFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>",
                 ("<|endoftext|>", "<fim_pad>", "<file_sep>", "<reponame>", "<repo_name>")),
    # DeepSeek-Coder
    InfillFormat("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>",
                 ("<\uff5cend\u2581of\u2581sentence\uff5c>",)),
)


def _token_id(tokenizer, text: str) -> int | None:
    """The id of the token spelled ``text`` in the tokenizer's vocabulary, or None (not one token)."""
    try:
        found = tokenizer.convert_tokens_to_ids(text)
    except (AttributeError, KeyError, TypeError):
        return None
    return None if found is None or found == getattr(tokenizer, "unk_token_id", None) else int(found)


def infill_format(tokenizer) -> InfillFormat | None:
    """The fill-in-the-middle format of ``INFILL_FORMATS`` whose markers are all tokens of the tokenizer, or None."""
    for fmt in INFILL_FORMATS:
        if tokenizer is not None and all(_token_id(tokenizer, m) is not None for m in fmt.markers()):
            return fmt
    return None


@dataclass(frozen=True)
class InfillPrompt:
    """A fill-in-the-middle prompt: its token ids, and the tokens that end the middle (the format's end-of-text and
    markers, the tokenizer's EOS) - pass them as ``stop_token_ids``."""

    ids: list[int]
    stop_token_ids: list[int]


def encode_infill(tokenizer, prefix: str, suffix: str, model_name: str = "the verifier") -> InfillPrompt:
    """The prompt that asks the model for the text between ``prefix`` and ``suffix``, in its fill-in-the-middle
    format (``infill_format``): the special tokens the tokenizer puts first (a BOS), the markers as tokens and the two
    texts encoded apart, special tokens spelled in them left as text (as llama.cpp's ``/infill`` does). ValueError
    naming the model when its tokenizer has no fill-in-the-middle tokens."""
    fmt = infill_format(tokenizer)
    if fmt is None:
        known = "; ".join(" ".join(f.markers()) for f in INFILL_FORMATS)
        raise ValueError(f"{model_name}'s tokenizer has no fill-in-the-middle tokens (known formats: {known})")
    plain, full = tokenizer.encode("a", add_special_tokens=False), tokenizer.encode("a", add_special_tokens=True)
    lead = full[:len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []
    p, s, m = (_token_id(tokenizer, t) for t in fmt.markers())

    def text(t: str) -> list[int]:  # a marker's spelling in the code stays text
        return tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True)

    ids = [*lead, p, *text(prefix), s, *text(suffix), m]
    return InfillPrompt(ids, infill_stop_ids(tokenizer, fmt))


def infill_stop_ids(tokenizer, fmt: InfillFormat) -> list[int]:
    """The tokens that end a middle in ``fmt``: its end-of-text and other ``ends``, its markers, the tokenizer's
    EOS - those of them the vocabulary has."""
    ends = {_token_id(tokenizer, t) for t in (*fmt.ends, *fmt.markers())} | {getattr(tokenizer, "eos_token_id", None)}
    return sorted(e for e in ends if isinstance(e, int))
