"""Incremental detokenisation: the text of a growing token list, one delta per append, without decoding the whole
output at every step (which costs O(n^2) over a request).

Byte-level BPE tokens are not text one at a time: a multi-byte character can span tokens, and some tokenizers change
the spelling of a token by what precedes it (a leading space). So each append decodes a short window - the tokens
from ``prefix`` (a few tokens before the text already emitted) to the end - and emits what the window adds beyond
the same window without the new tokens, holding back a trailing incomplete character (U+FFFD) until the next append
completes it. The same scheme as text-generation-inference's and vLLM's detokenizers.
"""
from __future__ import annotations

from typing import Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a token list that grows by ``add``; ``add`` returns only the new text.

    The concatenation of every delta equals ``tokenizer.decode(all_ids, skip_special_tokens=...)`` once the last
    character is complete (``flush`` returns whatever an incomplete trailing character held back).
    """

    #: tokens of context decoded before the unemitted ones, so that a token whose spelling depends on its left
    #: neighbour (a leading space after the previous word) decodes as it does inside the whole text
    CONTEXT = 5

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens whose text has been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        """Append ``ids``; return the text they complete (may be empty while a character is incomplete)."""
        self.ids.extend(int(t) for t in ids)
        before = self._decode(self.ids[self._prefix: self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(_REPLACEMENT) or len(after) <= len(before) or not after.startswith(before):
            if after.endswith(_REPLACEMENT) or not after.startswith(before):
                return ""  # wait: an incomplete character, or a window that re-spells its start
            self._read = len(self.ids)  # tokens with no text (special tokens skipped)
            return ""
        delta = after[len(before):]
        self.text += delta
        self._read = len(self.ids)
        self._prefix = max(self._read - self.CONTEXT, 0)
        return delta

    def flush(self) -> str:
        """Text still held back (an incomplete trailing character, emitted as U+FFFD) - call once at the end."""
        full = self._decode(self.ids)
        if full.startswith(self.text) and len(full) > len(self.text):
            delta = full[len(self.text):]
            self.text = full
            return delta
        return ""


def first_stop(text: str, stops: Sequence[str], floor: int = 0) -> tuple[int, str] | None:
    """(index, stop string) of the stop string in ``text`` that starts first among those ending after ``floor``
    characters (the text already checked), the first listed where two start together; None where there is none.
    Only the tail that new text can complete is searched: O(new text + longest stop) per call."""
    hits = [(i, k) for k, s in enumerate(stops) if (i := text.find(s, max(floor - len(s) + 1, 0))) != -1]
    return (min(hits)[0], stops[min(hits)[1]]) if hits else None


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in ``text`` that ends at or after ``start`` (``first_stop``'s), or None."""
    hit = first_stop(text, stops, start)
    return hit[0] if hit else None


class StoppingText:
    """A request's text as its tokens are committed, and its stop strings: read incrementally (one short decode per
    append), cut before the first stop string once one is complete - or after it, with ``include_stop`` (vLLM's
    ``include_stop_str_in_output``). ``stop``: a string, a list of them or None; an empty one is a ``ValueError``.
    ``skip_special``: special tokens' text left out (vLLM's ``skip_special_tokens``). The token that ended the request
    (an end-of-sequence or stop token: ``ended_by_token``) is left out of the text unless ``include_stop``, as vLLM
    leaves it."""

    def __init__(self, tokenizer, stop: str | Sequence[str] | None, include_stop: bool = False,
                 skip_special: bool = True):
        if not isinstance(skip_special, bool):
            raise ValueError(f"skip_special_tokens must be true or false, got {skip_special!r}")
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.cut_last = False  # the last token ended the request and stays out of the text (``ended_by_token``)
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if not isinstance(include_stop, bool):
            raise ValueError(f"include_stop_str_in_output must be true or false, got {include_stop!r}")
        self.include_stop = include_stop
        self.stopped: str | None = None  # the text once a stop string ended the request, cut before it
        self._detok: IncrementalDetokenizer | None = None
        self._fed = 0  # tokens given to _detok
        self._floor = 0  # with min_tokens: the text's length before a stop string may end (``hit_stop``)

    def _read(self, ids: Sequence[int]) -> str:
        """Feed the tokens of ``ids`` not fed yet to the incremental detokenizer; its text."""
        if self._detok is None:
            self._detok = IncrementalDetokenizer(self.tokenizer, self.skip_special)
        if self._fed < len(ids):
            self._detok.add(ids[self._fed:])
            self._fed = len(ids)
        return self._detok.text

    def ended_by_token(self) -> None:
        """The last token given ended the request (an end-of-sequence or stop token): its text is left out, unless
        the request includes the stop in its text."""
        self.cut_last = not self.include_stop

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special)

    def final(self, ids: Sequence[int]) -> str:
        """The whole text of ``ids`` (decoded once), cut before the stop string or token that ended it."""
        if self.tokenizer is None or self.stopped is not None:
            return self.stopped if self.tokenizer is not None else ""
        return self._decode(ids[:-1] if self.cut_last else ids)

    def so_far(self, ids: Sequence[int]) -> str:
        """Complete characters only, ending before a stop string, holding back a tail that could begin one."""
        if self.tokenizer is None:
            return ""
        if self.stopped is not None:
            return self.stopped
        text = self._read(ids[:-1] if self.cut_last else ids)
        hold = max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold] if hold else text

    def hit_stop(self, ids: Sequence[int], checked_from: int = 0) -> bool:
        """Whether the text of ``ids`` now holds a stop string: only the tail the tokens added since the last call can
        complete is searched. On a hit, the whole text is decoded once and cut before the first. ``checked_from``
        (vLLM's ``min_tokens``): while ``ids`` holds fewer tokens nothing is looked for, and afterwards only a stop
        string that ends in the text of the ``checked_from``-th token or a later one counts."""
        checked = len(self._detok.text) if self._detok is not None else 0
        text = self._read(ids)
        if len(ids) < checked_from:
            self._floor = len(text)  # a stop string ending in the text so far never counts
            return False
        floor = self._floor
        if find_stop(text, self.stop, max(checked, floor)) is None:
            return False
        whole = self._decode(ids)
        # the first stop string ending past the floor (the start of the text, without min_tokens)
        hit = first_stop(whole, self.stop, floor)
        if hit is None and floor:
            return False  # what the incremental search found ends before the floor
        if hit is None:  # found in the incremental text only (a tokenizer whose whole decode spells it otherwise)
            whole, hit = self._detok.text, first_stop(self._detok.text, self.stop)
        self.stopped = whole[: hit[0] + (len(hit[1]) if self.include_stop else 0)]
        return True
