"""Text <-> token translation between a verifier's tokenizer and a drafter's own (cross-tokenizer drafting).

A drafter of another model family drafts in its own tokens; the verifier checks drafts in its tokens. The two meet in
text (docs/algorithms.md#cross-tokenizer-drafting):

- ``IncrementalDecoder``: the verifier's committed ids -> the committed text, a few ids at a time (each step decodes
  the new ids with a few ids of context before them, and holds back ids that end inside a character);
- ``TokenBridge.view``: the committed text -> the drafter's own ids of it, kept up to date incrementally: each step
  re-encodes only a tail window (from ``window`` drafter tokens before the end), keeps every token before the window,
  and checks that the re-encoded window starts at a token boundary of the kept part (else the window grows);
- ``TokenBridge.draft_text`` / ``TokenBridge.to_verifier``: drafted ids -> their text -> the verifier's ids of that
  text continuing the committed ids; ``complete=False`` drops a trailing partial token (a verifier token whose text
  reaches the end of the drafted text may still grow into a longer token once more text follows) - the drafter
  keeps it, which measured faster (docs/algorithms.md#cross-tokenizer-drafting).

Nothing here decides what the verifier accepts: a translated draft carries no probabilities and is verified by
sample-and-match (or greedy matching), which is exact for any draft. Translation only decides how many tokens are
accepted.
"""
from __future__ import annotations

from typing import Sequence

#: text both tokenizers must encode and decode back unchanged (after the verifier's own round trip of it): words,
#: runs of spaces, tabs and newlines, code, punctuation, digits, accented and CJK characters and an emoji
PROBE_TEXT = ("Hello, world!  Two  spaces,\ttab and\n\nnew lines.\n"
              "def f(x):\n    return x ** 2  # 3.14, 1e-9, [1, 2]; {'a': \"b\"}\n"
              "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \u4e2d\u6587 \u2713 \u2192 \U0001F642\n"
              "  trailing spaces  \n")

REPLACEMENT = "\ufffd"  # what decoding gives for the bytes of a character that is not complete yet


class TokenBridgeError(ValueError):
    """A drafter cannot draft with its own tokenizer for this verifier (the message names the drafter and both
    models)."""


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


class IncrementalDecoder:
    """Committed ids -> text, a few ids at a time (the prefix/read offsets of streaming detokenizers).

    ``feed`` decodes the new ids together with up to ``context`` ids before them and keeps the part of the text
    after those: a decoder that drops the leading space of the first token, or bytes of a character split over
    several ids, see the same neighbourhood as in a decode of the whole sequence. Ids whose text ends inside a
    character (a trailing replacement character) are held back until later ids complete it (``held``), at most
    ``max_held`` ids; then their text is taken as it is.
    """

    def __init__(self, tokenizer, context: int = 4, max_held: int = 4):
        self.tokenizer = tokenizer
        self.context = context
        self.max_held = max_held
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self._read = 0  # ids whose text is in self.text

    @property
    def held(self) -> int:
        """Ids fed whose text is not in ``text`` yet (they end inside a character)."""
        return len(self.ids) - self._read

    def feed(self, ids: Sequence[int]) -> None:
        self.ids.extend(int(i) for i in ids)
        if self._read == len(self.ids):
            return
        start = max(0, self._read - self.context)
        before = _decode(self.tokenizer, self.ids[start:self._read]) if start < self._read else ""
        ends = range(len(self.ids), max(self._read, len(self.ids) - self.max_held - 1), -1)
        for end in ends:  # the longest run of new ids that ends a character, holding back at most max_held ids
            text = _decode(self.tokenizer, self.ids[start:end])
            if not text.endswith(REPLACEMENT):
                break
        else:
            if len(self.ids) - self._read <= self.max_held:
                return  # hold them all until a later id completes the character
            end = len(self.ids)  # a replacement character that stays one (undecodable bytes): take the text as it is
            text = _decode(self.tokenizer, self.ids[start:end])
        self.text += text[len(before):]
        self._read = end


class TokenBridge:
    """Translation between ``verifier_tokenizer``'s ids and ``drafter_tokenizer``'s, through text, for one drafter.

    Checked at construction (``TokenBridgeError`` naming the drafter and both models): both tokenizers exist, the
    drafter's reports character offsets (a fast tokenizer), and both give back ``PROBE_TEXT`` - as the verifier
    writes it - unchanged after an encode and a decode.

    Per request (``begin``): ``view(committed)`` gives the drafter's ids of the committed text, ``draft_text`` the
    text of drafted ids, ``to_verifier`` the verifier ids of a drafted text.
    """

    def __init__(self, verifier_tokenizer, drafter_tokenizer, *, drafter: str, verifier_model: str,
                 drafter_model: str, window: int = 8, lookback: int = 3, stop_ids: Sequence[int] = ()):
        who = f"drafter {drafter!r} (model {drafter_model!r}, tokenizer: own) for verifier {verifier_model!r}"
        if drafter_tokenizer is None:
            raise TokenBridgeError(f"{who}: the drafter model has no tokenizer, so its drafts cannot be translated; "
                                   f"give a model whose folder holds its tokenizer")
        if verifier_tokenizer is None:
            raise TokenBridgeError(f"{who}: the verifier has no tokenizer, so drafts cannot be translated into its "
                                   f"tokens")
        if window < 1 or lookback < 1:
            raise ValueError(f"{who}: window and lookback must be >= 1, got {window} and {lookback}")
        self.verifier_tokenizer, self.drafter_tokenizer = verifier_tokenizer, drafter_tokenizer
        self.who = who
        self.window, self.lookback = window, lookback
        probe = _decode(verifier_tokenizer, _encode(verifier_tokenizer, PROBE_TEXT))
        if not probe.strip():
            raise TokenBridgeError(f"{who}: the verifier's tokenizer encodes the probe text {PROBE_TEXT[:30]!r}... to "
                                   f"nothing, so drafted text cannot be translated into its tokens")
        back = _decode(verifier_tokenizer, _encode(verifier_tokenizer, probe))
        if back != probe:
            raise TokenBridgeError(f"{who}: the verifier's tokenizer does not give its own text back after an encode "
                                   f"and a decode ({_first_difference(probe, back)})")
        try:
            _encode_offsets(drafter_tokenizer, probe)
        except (NotImplementedError, ValueError, TypeError, KeyError) as e:
            raise TokenBridgeError(f"{who}: the drafter's tokenizer ({type(drafter_tokenizer).__name__}) gives no "
                                   f"character offsets ({e}); cross-tokenizer drafting needs a fast tokenizer"
                                   ) from None
        back = _decode(drafter_tokenizer, _encode(drafter_tokenizer, probe))
        if back != probe:
            raise TokenBridgeError(f"{who}: the drafter's tokenizer cannot round-trip the verifier's text: "
                                   f"decode(encode(text)) != text on a probe text ({_first_difference(probe, back)})")
        # ids the drafter's tokenizer puts before a text of its own accord (a BOS its model expects)
        plain = _encode(drafter_tokenizer, "a")
        full = list(drafter_tokenizer("a", add_special_tokens=True)["input_ids"])
        self.prefix = full[: len(full) - len(plain)] if full[len(full) - len(plain):] == plain else []
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        #: stop ids whose token the verifier has as a special token of its own (a shared chat format's end of turn,
        #: '<|im_end|>'): a draft keeps it, in the verifier's id, and ends there
        self.shared_stops = frozenset(i for i in self.stop_ids if _special_content(drafter_tokenizer, i)
                                      in _special_tokens(verifier_tokenizer))
        self.begin()

    # ---------------------------------------------------------------- the drafter's view of the committed text
    def begin(self) -> None:
        """A new request: forget the committed text."""
        self.decoder = IncrementalDecoder(self.verifier_tokenizer)
        self.ids: list[int] = []  # the drafter's ids of self.decoder.text (self.prefix first)
        self.spans: list[tuple[int, int]] = []  # character span of each id in the text ((0, 0) for the prefix)
        self.reencoded = 0  # drafter ids re-encoded by the last view() (the window), for tests and figures

    @property
    def text(self) -> str:
        return self.decoder.text

    def view(self, committed: Sequence[int]) -> list[int] | None:
        """The drafter's ids of the text of ``committed`` (the verifier's committed ids of this request, which only
        grow between calls); None while the last committed ids end inside a character (nothing to draft from)."""
        self.reencoded = 0
        fed = self.decoder.ids
        if len(committed) < len(fed) or list(committed[len(fed) - 1: len(fed)]) != fed[len(fed) - 1:]:
            self.begin()  # not a continuation of what was fed (a new request without begin)
            fed = self.decoder.ids
        old = len(self.decoder.text)
        self.decoder.feed(committed[len(fed):])
        if len(self.decoder.text) != old or not self.ids:
            self._reencode_tail()
        return None if self.decoder.held else list(self.ids)

    def _reencode_tail(self) -> None:
        text, n_prefix = self.decoder.text, len(self.prefix) if self.ids[: len(self.prefix)] == self.prefix else 0
        if not self.ids:
            self._encode_all(text)
            return
        r = max(n_prefix, len(self.ids) - self.window)  # first kept-id index to re-encode
        while r > n_prefix:
            r = self._clean_boundary(r, n_prefix)
            if r <= n_prefix + 1:  # the whole text: no kept token before the window to anchor it on
                break
            # encode from the start of token r - 1 (its own ids are dropped: whatever a tokenizer adds at the start
            # of a text, e.g. a space before the first word, lands there) and keep the ids from token r's start on
            base = self.spans[r - 1][0]
            ids, spans = _encode_offsets(self.drafter_tokenizer, text[base:])
            anchor = self.spans[r][0] - base
            j = next((j for j, (s, _) in enumerate(spans) if s >= anchor), None)
            if j is not None and j > 0 and spans[j][0] == anchor and spans[j - 1][1] <= anchor:
                self.reencoded = len(ids) - j
                del self.ids[r:], self.spans[r:]
                self.ids += ids[j:]
                self.spans += [(s + base, e + base) for s, e in spans[j:]]
                return
            r -= self.window  # the boundary moved: take a longer window
        self._encode_all(text)

    def _clean_boundary(self, r: int, n_prefix: int) -> int:
        """The last index <= r where a token starts after the end of the one before it (not inside a character)."""
        while r > n_prefix + 1:
            (start0, end0), (start1, _) = self.spans[r - 1], self.spans[r]
            if end0 <= start1 and start0 < start1:
                break
            r -= 1
        return r

    def _encode_all(self, text: str) -> None:
        ids, spans = _encode_offsets(self.drafter_tokenizer, text)
        prefix = [] if ids[: len(self.prefix)] == self.prefix else list(self.prefix)
        self.ids = prefix + ids
        self.spans = [(0, 0)] * len(prefix) + spans
        self.reencoded = len(ids)

    # ---------------------------------------------------------------- drafts: drafter ids -> text -> verifier ids
    def draft_text(self, view: Sequence[int], drafted: Sequence[int]) -> tuple[str, bool]:
        """(text of ``drafted``, the drafter ids drafted after ``view``; whether it is complete). The text ends before
        the first stop id (the drafter's EOS or another special token), or after it when the verifier has the same
        special token (``shared_stops``): then nothing follows and it is complete. A trailing part of a character is
        cut off."""
        drafted = list(drafted)
        stop = next((i for i, t in enumerate(drafted) if t in self.stop_ids), None)
        complete = stop is not None
        if complete:
            drafted = drafted[:stop + (drafted[stop] in self.shared_stops)]
        if not drafted:
            return "", complete
        ctx = list(view[-self.lookback:]) if view else []
        while ctx and _decode(self.drafter_tokenizer, ctx).startswith(REPLACEMENT):  # context starting mid-character
            ctx = ctx[1:]
        before = _decode(self.drafter_tokenizer, ctx)
        text = _decode(self.drafter_tokenizer, ctx + drafted)[len(before):]
        cut = text.rstrip(REPLACEMENT)
        return cut, complete and cut == text

    def to_verifier(self, committed: Sequence[int], text: str, complete: bool = False) -> list[int]:
        """Verifier ids that continue ``committed`` with ``text`` (or with the longest part of it their text spells).

        The text is encoded after the text of the last j committed ids (j = ``lookback`` .. 1) as long as the
        encoding gives those j ids back first, so a tokenizer's rules across the boundary (a leading space, merged
        whitespace) are those of the whole text; when none does (the text continues inside the last committed
        token's word), it is encoded on its own. Ids whose text stops matching the drafted text are cut (a character
        the verifier has no token for). Unless ``complete``, the last id is dropped: its text reaches the end of the
        drafted text, so it may still grow into a longer token once more text follows (a partial token); an id
        followed by drafted text that could not be spelled is kept.
        """
        if not text:
            return []
        committed = list(committed)
        tail, out = [], None
        for j in range(min(self.lookback, len(committed)), 0, -1):
            tail = committed[-j:]
            tail_text = _decode(self.verifier_tokenizer, tail)
            if REPLACEMENT in tail_text:
                continue
            enc = _encode(self.verifier_tokenizer, tail_text + text)
            if enc[:j] == tail:
                out = enc[j:]
                break
        if out is None:
            tail = committed[-1:] if committed else []
            out = _encode(self.verifier_tokenizer, text)
        out, to_the_end = self._spelled(tail, out, text)
        if out and to_the_end and not complete:
            out = out[:-1]
        return out

    def _spelled(self, tail: list[int], ids: list[int], text: str) -> tuple[list[int], bool]:
        """The longest prefix of ``ids`` whose text, after ``tail``'s, is a prefix of ``text``; and whether that is all
        of ``text`` (else the text goes on after the ids kept, so the last of them is complete)."""
        base = _decode(self.verifier_tokenizer, tail)
        whole = _decode(self.verifier_tokenizer, tail + ids)
        if whole.startswith(base) and text.startswith(whole[len(base):]):
            return ids, len(whole) - len(base) == len(text)
        for n in range(len(ids) - 1, 0, -1):
            part = _decode(self.verifier_tokenizer, tail + ids[:n])
            if part.startswith(base) and text.startswith(part[len(base):]) and not part.endswith(REPLACEMENT):
                return ids[:n], False
        return [], False


def _special_content(tokenizer, token_id: int) -> str | None:
    token = tokenizer.convert_ids_to_tokens(int(token_id))
    return token if isinstance(token, str) else None


def _special_tokens(tokenizer) -> set[str]:
    """The verifier's special tokens and the added tokens it matches in text as a whole ('<|im_end|>')."""
    out = set(getattr(tokenizer, "all_special_tokens", None) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out.update(str(t) for t in decoder.values())
    return out


def _first_difference(expected: str, got: str) -> str:
    i = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    return f"first difference at character {i}: expected {expected[i:i + 12]!r}, got {got[i:i + 12]!r}"
