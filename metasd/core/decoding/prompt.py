"""From what a caller gives to the verifier's token ids: ``encode_prompt`` (strings, chat messages, token ids; chat
messages through ``render_chat``) and the context check (``check_context``). Needs no model, only its tokenizer, so a
command can check a prompt before any model loads."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


def render_chat(tokenizer, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The text of chat ``messages`` through the tokenizer's chat template (which it must have), OpenAI's ``tools``
    rendered as the template renders them: what a chat prompt's tokens encode (without special tokens added), for
    ``encode_prompt`` and the server's ``/tokenize`` alike. ``add_generation_prompt``: the start of the assistant's
    turn after the messages; ``continue_final_message``: instead, the last message left open (its end-of-turn
    removed), so that the answer continues it - an assistant message's start given by the client."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt false")
    return tokenizer.apply_chat_template([dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
                                         add_generation_prompt=add_generation_prompt, tokenize=False,
                                         continue_final_message=continue_final_message)


def encode_prompt(tokenizer, prompt: Prompt, chat: bool | None = None, model_name: str = "the verifier",
                  tools: Sequence[Mapping] | None = None, **template: bool) -> list[int]:
    """Prompt -> token ids, as ``Engine.encode`` does: token ids as given, message lists through the chat template
    (with ``tools``, OpenAI's tool objects, rendered as the template renders them; ``template``: ``render_chat``'s
    ``add_generation_prompt`` and ``continue_final_message``), strings through it when ``chat`` (else encoded as they
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
            return encode_prompt(tokenizer, [{"role": "user", "content": prompt}], True, model_name, tools)
        return tokenizer_or_fail().encode(prompt, add_special_tokens=True)
    if all(isinstance(t, int) for t in prompt):
        return prompt
    if all(isinstance(m, Mapping) for m in prompt):
        tok = tokenizer_or_fail()
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{model_name}'s tokenizer has no chat template; pass a string prompt")
        return tok.encode(render_chat(tok, prompt, tools, **template), add_special_tokens=False)
    raise TypeError("prompt must be a string, a list of chat messages, or a list of token ids")


def check_context(prompt_tokens: int, max_new_tokens: int, context_length: int | None, model_name: str) -> None:
    """``ValueError`` when the prompt and the new tokens do not fit the verifier's context."""
    if context_length and prompt_tokens + max_new_tokens > context_length:
        raise ValueError(f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} exceeds the context of "
                         f"{model_name} ({context_length} tokens)")
