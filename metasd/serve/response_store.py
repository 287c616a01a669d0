"""Stored responses of the Responses API (``store: true``, the API's default): what ``previous_response_id`` continues
and ``GET`` / ``DELETE /v1/responses/{id}`` read and remove (docs/serving.md#the-responses-api).

A stored response keeps the response object as it was sent and its conversation as input items: the items of the
response it continued, its own input, then its output (a message, function calls) - so a request naming it continues
the whole conversation, as if its client had sent every item again. Items are shared between the responses of one
conversation, not copied (a later response's list holds the same item objects), so a chain of N turns holds N lists
of references, not N copies of the text.

In this process's memory only: the most recent ``max_entries`` responses, the least recently used removed first, and
none after a restart. Anyone who may call the server and knows a response's id (96 random bits) may read it.
"""
from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: stored responses kept by default (``metasd serve --max-stored-responses``)
DEFAULT_MAX_STORED_RESPONSES = 256


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: the object sent (``response``) and its conversation as input items (``items``), the first
    ``inputs`` of them the items it was generated from (the rest: its output)."""

    response: dict[str, Any]
    items: list[Any]
    inputs: int = 0

    def input_items(self) -> list[dict[str, Any]]:
        """The items it was generated from, oldest first, each with an ``id`` (``GET .../input_items``)."""
        return self.items[: self.inputs]


class ResponseStore:
    """The stored responses of one server, by id (module docstring): at most ``max_entries`` (0: none is stored),
    the least recently used given up first; safe to use from several threads."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, not {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], inputs: list[Any]) -> bool:
        """Keep ``response`` (under its ``id``) with its conversation: ``inputs``, the items it was generated from (an
        ``id`` given to those without one), then its output; whether it was kept (not when storing is off)."""
        if not self.enabled:
            return False
        items = [*(with_id(item) for item in inputs), *response["output"]]
        with self._lock:
            self._entries[response["id"]] = StoredResponse(response, items, len(inputs))
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._entries.get(response_id)
            if stored is not None:
                self._entries.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        """Remove the response; whether it was stored."""
        with self._lock:
            return self._entries.pop(response_id, None) is not None


def with_id(item: Any) -> Any:
    """An input item as the API lists it: with an ``id`` (``msg_...`` for a message, ``fc_...`` / ``fco_...`` for a
    function call and its output) and, for a message, a ``type`` and its content as text parts."""
    if not isinstance(item, dict) or "id" in item:
        return item
    kind = item.get("type", "message")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
    out = {"id": f"{prefix}_{secrets.token_hex(12)}", "type": kind, **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    return out
