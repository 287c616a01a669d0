"""The prefix cache on the llama.cpp backend (``metasd serve --backend llama.cpp``): finished requests' positions kept
in the llama.cpp context itself, to start later requests that continue them - the next turn of a chat - without
prefilling that prefix again, as llama.cpp's own server reuses its slots' prompts.

llama.cpp's KV cache is unified: a cell belongs to a set of sequences. An entry is a sequence of its own that takes
the finished request's committed cells before the request's sequence is dropped (``seq_cp``: the cells' sequence sets
grow, nothing is copied); a request that hits it gets the entry's first n cells the same way, and its prefill starts at
position n. Those cells hold exactly what the finished request's decodes computed, so the request continues from the
very values the earlier one attended to.

Memory: an entry holds its cells until it is evicted; they count inside the context's cells (``CellBudget`` admits a
reservation only beside them), and an admission that does not fit evicts entries, least recently used first, before it
waits. A cell an entry shares with a running request counts twice (in the entry and in the request's reservation): the
budget errs on the safe side. Sequences: an entry holds one of the context's sequence ids, which the trees' leaves
share, so a prefix cache of E entries takes E sequences from the leaves (``LlamaCppBatchVerifier.keep_prefixes``: the
scheduler's drafts are cut to fewer nodes). The model drafters' own positions are kept with an entry as on torch
(host memory, bounded by ``drafter_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .prefix_cache import KVPrefix, PrefixCache, PrefixEntry

#: the most entries by default: each holds one of the context's 256 sequences
DEFAULT_MAX_ENTRIES = 16


@dataclass(eq=False)
class SequenceEntry(PrefixEntry):
    """One stored prefix on llama.cpp: its token ids, the context sequence holding their cells (``seq``; no keys or
    values outside the context) and the model drafters' own positions (``PrefixEntry.drafters``)."""

    seq: int = -1

    @property
    def nbytes(self) -> int:  # the host memory it holds: its drafters' positions (its cells are in the context)
        return sum(d.nbytes for d in self.drafters.values())


class LlamaCppPrefixCache(PrefixCache):
    """``PrefixCache`` over a ``LlamaCppBatchVerifier``'s context (module docstring): the same lookups, drafter starts,
    statistics and eviction order; entries are sequences. ``drafter_bytes``: the most host memory the entries' drafter
    positions may hold (default: as much as the context's verifier cells)."""

    def __init__(self, owner, min_tokens: int = 16, max_entries: int = DEFAULT_MAX_ENTRIES, drafters: bool = True,
                 drafter_bytes: int | None = None):
        super().__init__(owner.cache, min_tokens=min_tokens, max_entries=max_entries, drafters=drafters)
        self.owner = owner
        self.drafter_bytes = owner.cache.budget_bytes if drafter_bytes is None else drafter_bytes

    @property
    def held_cells(self) -> int:
        return sum(e.length for e in self.entries)

    def _pin(self) -> None:
        c = self.cache
        c.pinned_cells = self.held_cells
        c.pinned_bytes = c.pinned_cells * c.geometry.bytes_per_token

    def _over(self, n: int, drafters: dict[str, KVPrefix]) -> bool:
        c = self.cache
        return (sum(c.reserved.values()) + self.held_cells + n > c.cells
                or self.held_bytes + sum(kv.nbytes for kv in drafters.values()) > self.drafter_bytes)

    def _copy(self, ids: torch.Tensor, row: int, drafters: dict[str, KVPrefix]) -> PrefixEntry:
        """A sequence of its own takes row ``row``'s first ``len(ids)`` cells (they stay when the row's sequence is
        dropped)."""
        seq = self.owner.take_sequence()
        try:
            self.owner.share(self.owner.row_sequence(row), seq, len(ids))
        except BaseException:
            self.owner.drop_sequence(seq)
            raise
        return SequenceEntry(ids, [], [], self._clock, drafters, seq=seq)

    def _remove(self, entry: PrefixEntry) -> None:
        super()._remove(entry)
        self.owner.drop_sequence(entry.seq)

    def fit(self) -> None:
        """Entries beyond the cells beside the reservations (none are made so; kept for the scheduler's contract)
        give way, least recently used first."""
        while self.entries and sum(self.cache.reserved.values()) + self.held_cells > self.cache.cells:
            self._evict_one()
        self._pin()

    def forget(self) -> None:
        """The context was cleared (``LlamaCppBatchVerifier.reset``): every entry's cells are gone with it."""
        self.entries.clear()
        self._pin()
