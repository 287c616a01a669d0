"""The verifier's prefix cache: finished requests' KV, kept to start later requests that share a prefix with them - the
next turn of a chat (its history is the last turn's prompt and answer), a system prompt many requests share - without
prefilling that prefix again (docs/serving.md#prefix-caching).

An entry is one finished request's committed positions copied out of its row of the batched cache (``BatchCache``):
per layer [kv_heads, length, head_dim] keys and values, and the token ids they hold. A joining request looks up the
entry with the longest common prefix with its prompt and its prefill starts after that many positions. Keys and
values depend only on the tokens before them, so a reused prefix holds what a prefill would compute - up to the
floating-point order of the forwards that computed it (the batched verify forwards of the earlier request), which in
bf16 can flip a near-tie of the top two logits, as batching itself can (docs/models.md#bf16-and-greedy-identity).

An entry also keeps the model drafters' own positions of the text, by pool entry name (``PrefixEntry.drafters``), so
that a request continuing it starts those drafters there (``Drafter.resume``) rather than reading the prefix again at
their first catch-up.

Memory: the entries' bytes (the drafters' included) are held inside the scheduler's KV budget
(``BatchCache.pinned_bytes``); an admission that does not fit evicts entries, least recently used first, before it
waits; an entry that would not fit beside the reservations is not stored. An entry is copied while its request's row is
still allocated, so until that row is freed the cache can hold up to that entry more than its budget; the scheduler
calls ``fit`` right after (rows shrink, or entries are evicted, least recently used first), before the request's end or
its step is reported (``jobs.free_row``). Only a reader in another thread (the server's ``vllm:kv_cache_usage_perc``)
can catch that moment, as it can catch a reallocation holding old and new buffers at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .batch_cache import BatchCache

log = logging.getLogger(__name__)


@dataclass(eq=False)  # compared by identity (removing one must not compare tensors)
class KVPrefix:
    """A cache's first positions copied out: the token ids they hold and, per layer, keys and values
    [kv_heads, length, head_dim]."""

    ids: torch.Tensor  # [length] int64, on the host
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def common_length(self, query: torch.Tensor) -> int:
        """How many of its first ids equal ``query``'s first ids ([n] int64, on the host)."""
        n = min(len(query), self.length)
        diff = (self.ids[:n] != query[:n]).nonzero()
        return int(diff[0]) if len(diff) else n


@dataclass(eq=False)
class PrefixEntry(KVPrefix):
    """One stored prefix: the verifier's positions (``KVPrefix``) and, by pool entry name, the model drafters' own
    (``Drafter.kv_prefix``: the positions each had read of the same text, often fewer), so that a request continuing
    it starts its drafters there too instead of their catch-up reading the whole prefix again."""

    last_used: int = 0
    drafters: dict[str, KVPrefix] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(d.nbytes for d in self.drafters.values())


@dataclass
class PrefixCacheStats:
    """Counted in prompt tokens, as vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` (which the server exports
    from these): the prompts looked up, whole; the positions found, not prefilled again; entries stored and evicted."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    evicted: int = 0
    #: drafter cache positions a request started with from an entry instead of reading them (summed over drafters)
    drafter_hits: int = 0


class PrefixCache:
    """Stored prefixes of one verifier (module docstring). ``min_tokens``: a shorter match is not used (a prefill of
    a few tokens costs less than the copy); ``max_entries``: the most entries kept (0: none); ``drafters``: keep the model
    drafters' own positions in the entries too (``PrefixEntry``)."""

    def __init__(self, cache: BatchCache, min_tokens: int = 16, max_entries: int = 64, drafters: bool = True):
        self.cache = cache
        self.min_tokens = min_tokens
        self.max_entries = max_entries
        self.drafters = drafters
        self.entries: list[PrefixEntry] = []
        self.stats = PrefixCacheStats()
        self._clock = 0

    @property
    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def _pin(self) -> None:
        self.cache.pinned_bytes = self.held_bytes

    def lookup(self, prompt: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with the positions a prefill of ``prompt`` would compute (all its tokens
        but the last, which is pending) and that length; (None, 0) below ``min_tokens``. Counts the query (the whole
        prompt, as vLLM does) and the hit."""
        self.stats.queries += len(prompt)
        ids = prompt[:-1]
        if not ids or not self.entries:
            return None, 0
        query = torch.as_tensor(list(ids), dtype=torch.long)
        best, best_len = None, 0
        for entry in self.entries:
            common = entry.common_length(query)
            if common > best_len:
                best, best_len = entry, common
        if best is None or best_len < self.min_tokens:
            return None, 0
        self._clock += 1
        best.last_used = self._clock
        self.stats.hits += best_len
        return best, best_len

    def drafter_start(self, entry: PrefixEntry, name: str, prompt: Sequence[int]) -> tuple[KVPrefix, int] | None:
        """Where drafter ``name`` of a request whose prompt hit ``entry`` starts: the entry's positions of that drafter
        and how many of them hold the prompt's first tokens (its pending last token excepted); None below
        ``min_tokens`` or when the entry keeps none of that drafter. Counts the hit."""
        kept = entry.drafters.get(name)
        if kept is None:
            return None
        common = kept.common_length(torch.as_tensor(list(prompt[:-1]), dtype=torch.long))
        if common < self.min_tokens:
            return None
        self.stats.drafter_hits += common
        return kept, common

    def store(self, ids: Sequence[int], row: int, drafters: dict[str, KVPrefix] | None = None) -> bool:
        """Copy row ``row``'s first ``len(ids)`` positions of the batched cache as an entry for ``ids``, with the model
        drafters' own positions ``drafters`` (by name; their bytes count as the entry's). Not stored when shorter than
        ``min_tokens``, already held by an entry that extends it, or when it would not fit the budget beside the
        reservations; an entry it extends is replaced. Returns whether it was stored."""
        n = len(ids)
        drafters = {name: kv for name, kv in (drafters or {}).items() if kv.length >= self.min_tokens} \
            if self.drafters else {}
        if n < self.min_tokens or n > self.cache.lengths[row] or self.max_entries < 1:
            return False
        new = torch.as_tensor(list(ids), dtype=torch.long)
        for entry in list(self.entries):
            m = min(n, entry.length)
            if torch.equal(entry.ids[:m], new[:m]):
                if entry.length >= n:
                    self._clock += 1
                    entry.last_used = self._clock
                    return False  # held already
                self._remove(entry)  # the new one covers it
        while self.entries and (len(self.entries) >= self.max_entries or self._over(n, drafters)):
            self._evict_one()
        if self._over(n, drafters):
            self._pin()
            return False
        self._clock += 1
        self.entries.append(self._copy(new, row, drafters))
        self.stats.stored += 1
        self._pin()
        return True

    def _copy(self, ids: torch.Tensor, row: int, drafters: dict[str, KVPrefix]) -> PrefixEntry:
        """The entry of row ``row``'s first ``len(ids)`` positions: its keys and values copied out of the rows."""
        n = len(ids)
        keys = [layer.keys[row, :, :n].clone() for layer in self.cache.layers]
        values = [layer.values[row, :, :n].clone() for layer in self.cache.layers]
        return PrefixEntry(ids, keys, values, self._clock, drafters)

    def _over(self, n: int, drafters: dict[str, KVPrefix]) -> bool:
        """Whether an entry of ``n`` positions (and ``drafters``' bytes) would pass the budget beside the entries and
        the rows the reservations need (rows allocated beyond them are freed by ``fit``)."""
        c = self.cache
        if c.budget_bytes is None:
            return False
        extra = n * c.geometry.bytes_per_token + sum(kv.nbytes for kv in drafters.values())
        return c.bytes_for(list(c.reserved.values())) + self.held_bytes + extra > c.budget_bytes

    def fit(self) -> None:
        """Between steps: when the cache holds more than its budget (rows allocated beyond the reservations beside
        entries just stored), shrink the rows, then evict entries, least recently used first, until it does not."""
        c = self.cache
        if c.budget_bytes is None or c.held_bytes <= c.budget_bytes:
            return
        c.shrink()
        while c.held_bytes > c.budget_bytes and self.entries:
            self._evict_one()
            self._pin()

    def _evict_one(self) -> None:
        self._remove(min(self.entries, key=lambda e: e.last_used))
        self.stats.evicted += 1

    def _remove(self, entry: PrefixEntry) -> None:
        self.entries.remove(entry)

    def evict_for(self, tokens: int) -> bool:
        """Evict entries, least recently used first, until a reservation of ``tokens`` fits; whether it fits. It runs
        inside the scheduler's admission: should it fail, the error is logged and every entry dropped, so a broken
        cache costs its hits, never the scheduler."""
        try:
            while not self.cache.fits(tokens) and self.entries:
                self._evict_one()
                self._pin()
        except Exception:  # noqa: BLE001 - logged; the entries are dropped below
            log.exception("prefix cache: eviction failed; every stored prefix is dropped")
            self.clear()
        return self.cache.fits(tokens)

    def clear(self) -> None:
        for entry in list(self.entries):
            self._remove(entry)
        self._pin()
