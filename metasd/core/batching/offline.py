"""Offline batch generation (``metasd generate --input prompts.jsonl --output results.jsonl``): every request of a
JSONL file through one ``Scheduler``, the models loaded once, each result written as soon as it finishes.

Input: one JSON object per line (blank lines skipped) -
    {"prompt": "text"}                      a string prompt (the chat template applies unless the command's --raw)
    {"messages": [{"role": "user", "content": "..."}, ...]}   a conversation (always through the chat template)
plus any of: "id" (echoed in the output; default: the line number), "max_tokens" (or "max_new_tokens"),
"temperature", "top_p", "top_k", "min_p", "seed", "stop" (a string or a list), "drafter" (one arm of the pool),
"draft_budget", "speculate" (false: plain decoding), and one structured output: "response_format" (OpenAI's) or
vLLM's "guided_json", "guided_regex", "guided_grammar", "guided_choice" (docs/serving.md#structured-output). Missing
values take the command's options (a line's structured output replaces the command's).

Output: one JSON object per request, in the order they finish: {"id", "line", "text", "token_ids",
"finish_reason", "stats"} (``stats``: the request record, ``RequestStats.to_record()``), or {"id", "line", "error"}
for a request that was refused or failed. Lines are flushed as written, so a crash loses no finished request.
"""
from __future__ import annotations

import json
import queue
from typing import Any, Iterable, TextIO

from tqdm import tqdm

from ..constraints import GUIDED_FIELDS, ConstraintError, constraint_from_fields
from .request_handle import RequestFinished, RequestOptions
from .scheduler import Scheduler

#: keys of an input line, beyond "prompt" / "messages"
REQUEST_KEYS = {"id", "max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "drafter", "draft_budget", "speculate", "response_format", *GUIDED_FIELDS}


def parse_request_line(text: str, line: int, defaults: dict[str, Any]) -> dict[str, Any]:
    """One input line -> ``Scheduler.submit`` keyword arguments (with ``request_id``); ``ValueError`` naming the
    line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {line}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {line}: expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"line {line}: give exactly one of 'prompt' (a string) or 'messages' "
                         "(a list of chat messages)")
    unknown = set(obj) - REQUEST_KEYS - {"prompt", "messages"}
    if unknown:
        raise ValueError(f"line {line}: unknown keys {sorted(unknown)}; allowed: prompt or messages, "
                         f"{sorted(REQUEST_KEYS)}")
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise ValueError(f"line {line}: 'prompt' must be a string")
    messages = obj.get("messages")
    if "messages" in obj and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
        raise ValueError(f"line {line}: 'messages' must be a list of objects with 'role' and 'content'")
    kwargs = dict(defaults)
    kwargs["prompt"] = obj.get("prompt", obj.get("messages"))
    for key in ("temperature", "top_p", "top_k", "min_p", "seed", "stop"):
        if key in obj:
            kwargs[key] = obj[key]
    try:
        constraint = constraint_from_fields(obj)
    except ConstraintError as e:
        raise ValueError(f"line {line}: {e}") from None
    if constraint is not None or "response_format" in obj:  # {"type": "text"}: none, whatever the command's
        kwargs["constraint"] = constraint
    if "max_tokens" in obj or "max_new_tokens" in obj:
        kwargs["max_new_tokens"] = obj.get("max_tokens", obj.get("max_new_tokens"))
    options = {k: obj[k] for k in ("drafter", "draft_budget", "speculate") if k in obj}
    if options:
        kwargs["options"] = RequestOptions(**options)
    kwargs["request_id"] = str(line)  # unique: the listener names finished requests by it
    kwargs["id"] = obj.get("id", line)
    return kwargs


def read_requests(lines: Iterable[str], defaults: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, submit arguments) of every non-blank line, all checked before anything runs."""
    return [(i, parse_request_line(text, i, defaults)) for i, text in enumerate(lines, 1) if text.strip()]


def run_offline(engine, requests: list[tuple[int, dict[str, Any]]], out: TextIO, *, max_batch: int = 8,
                progress: bool = True) -> tuple[int, int]:
    """Run ``requests`` (``read_requests``) through a scheduler, writing a line to ``out`` as each finishes; keeps
    ``max_batch`` requests running and as many queued. Returns (finished, failed)."""
    done: queue.Queue = queue.Queue()
    todo = list(reversed(requests))
    handles: dict[str, tuple[int, Any, Any]] = {}  # request id -> (line, the line's "id", handle)
    finished = failed = 0

    def write(record: dict[str, Any]) -> None:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()

    with Scheduler(engine, max_batch=max_batch, max_queue=2 * max_batch) as scheduler, \
            tqdm(total=len(requests), disable=not progress, unit="req") as bar:
        scheduler.add_listener(lambda r: done.put(r.id) if isinstance(r, RequestFinished) else None)
        while todo or handles:
            while todo and len(handles) < 2 * max_batch:
                line, kwargs = todo.pop()
                kwargs = dict(kwargs)
                user_id = kwargs.pop("id")
                try:
                    handles[kwargs["request_id"]] = (line, user_id, scheduler.submit(**kwargs))
                except ValueError as e:  # refused (e.g. over the context): recorded, the others go on
                    write({"id": user_id, "line": line, "error": str(e)})
                    failed += 1
                    bar.update()
            if not handles:
                continue
            line, user_id, handle = handles.pop(done.get())
            try:
                result = handle.result()
            except Exception as e:  # noqa: BLE001 - a failed request is a line of the output
                write({"id": user_id, "line": line, "error": f"{type(e).__name__}: {e}"})
                failed += 1
            else:
                record = result.to_record()
                write({"id": user_id, "line": line, "text": record.pop("text"), "token_ids": record.pop("token_ids"),
                       "finish_reason": record["stop_reason"], "stats": record})
                finished += 1
            bar.update()
    return finished, failed
