"""Many requests at once on the llama.cpp verifier (``metasd serve`` on ``verifier: {backend: llama.cpp}``): the
scheduler's ``BatchVerifier`` contract - verify every running request's draft in one forward, commit each row's
accepted path, rows joining after a prefill and leaving - over one llama.cpp context.

Layout. llama.cpp's KV cache is unified: one pool of cells for every sequence, each cell tagged with the sequences
that see it. A request holds one sequence (its committed prefix, from the start of its prefill to its end); the rows
of the scheduler map to those sequences, so a request that leaves frees its cells (``seq_rm``) and the last row
takes its index without a copy. A verify feeds every row's pending token and draft in one ``llama_decode``: a chain's
nodes go into the row's own sequence; a tree gets, per leaf, a temporary sequence that first shares the row's prefix
(``seq_cp``), each node belonging to the sequences of the leaves below it - the ancestor mask, as in
``LlamaCppVerifier``. A token sees only cells of its own sequences, so no request sees another's. The build holds 256
sequences: one per request, the rest for leaves, so a request's drafts are cut to ``node_limit`` nodes (31 at
``max_batch`` 8; a tree has at most as many leaves as nodes). Commit, per row:
the leaf below the last accepted node gives the path; its cells past the path are cut, the path's cells join the
row's sequence, and every temporary sequence is dropped (cells no sequence holds any more are free).

Prefill. A joining request's prompt goes into its sequence in chunks, as on torch, but a chunk is not decoded alone:
it waits for the step's verify and goes into the same ``llama_decode`` ahead of the drafts (``defer``), so the running
requests' tokens ride along with the prompt's, as in llama.cpp's own server. A decode that fails marks the sequences
whose prompt it held, and those requests fail at their next step instead of running on missing cells.

Memory. The context's cells are the KV budget: a request is admitted with its reservation (prompt + max_new_tokens
+ the widest draft + 1, rounded up to 256 positions, as ``BatchCache``) when the reservations fit in the cells
beside the prefix cache's entries (``CellBudget``; ``keep_prefixes``, llama_cpp_prefix.py); nothing is allocated after
the context is made. The drafters' own (torch) caches are not counted
here: they grow with the requests' lengths in host memory.
"""
from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

import torch

from .batch_verifier import SlotVerifier
from .kv_memory import RESERVATION_BUCKET, KVBudgetError, KVGeometry, bucketed
from .llama_cpp_prefix import DEFAULT_MAX_ENTRIES, LlamaCppPrefixCache
from .llama_cpp_verifier import leaf_sequences
from .logprobs import PROMPT_LOGPROBS_CHUNK, TokenLogprob, token_logprobs
from .tree import Draft
from .verifier import VerifierOutput

__all__ = ["CellBudget", "LlamaCppBatchVerifier", "LlamaCppPrefill"]

log = logging.getLogger(__name__)


class CellBudget:
    """Admission over the llama.cpp context's KV cells: what the scheduler asks of a ``BatchCache`` (``lengths``,
    ``fits`` / ``reserve`` / ``release``, ``check_admissible``, ``held_bytes``, ...), in cells. ``cells``: the
    context's positions; ``slots``: rows at most; ``geometry``: the verifier's KV shape (bytes for the metrics)."""

    def __init__(self, cells: int, slots: int, geometry: KVGeometry, bucket: int = RESERVATION_BUCKET):
        self.cells = int(cells)
        self.slots = slots
        self.geometry = geometry
        self.bucket = bucket
        self.lengths = [0] * slots  # row b's cached positions (its committed tokens but the pending one)
        self.active = 0
        self.reserved: dict[Hashable, int] = {}
        self.pinned_cells = 0  # held by the prefix cache's entries (llama_cpp_prefix.py)
        self.pinned_bytes = 0
        self.budget_bytes = self.cells * geometry.bytes_per_token

    @property
    def held_bytes(self) -> int:
        """Bytes of the cells reserved now."""
        return sum(self.reserved.values()) * self.geometry.bytes_per_token + self.pinned_bytes

    def check_admissible(self, tokens: int) -> int:
        """The reservation for ``tokens`` positions; ``KVBudgetError`` when the context could never hold it."""
        need = bucketed(tokens, self.bucket)
        if need > self.cells:
            raise KVBudgetError(f"needs a KV reservation of {need} positions ({tokens} rounded up to {self.bucket}s); "
                                f"the llama.cpp context holds {self.cells} (verifier: {{context: ...}} in the pool)")
        return need

    def fits(self, tokens: int) -> bool:
        """Whether a reservation of ``tokens`` positions fits beside those held now."""
        return (len(self.reserved) < self.slots
                and sum(self.reserved.values()) + self.pinned_cells + bucketed(tokens, self.bucket) <= self.cells)

    def reserve(self, key: Hashable, tokens: int) -> int:
        need = self.check_admissible(tokens)
        if key in self.reserved:
            raise ValueError(f"CellBudget: {key!r} already holds a reservation")
        if not self.fits(tokens):
            raise RuntimeError(f"CellBudget: a reservation of {need} positions does not fit now (ask fits() first)")
        self.reserved[key] = need
        return need

    def release(self, key: Hashable) -> None:
        self.reserved.pop(key, None)

    def shrink(self) -> bool:
        return False  # the context is allocated once

    def reset(self) -> None:
        self.lengths = [0] * self.slots
        self.active = 0

    def describe(self) -> dict[str, Any]:
        return {"slots": self.slots, "cells": self.cells, "active": self.active,
                "reserved": sum(self.reserved.values()), "held_bytes": self.held_bytes,
                "budget_bytes": self.budget_bytes}


class LlamaCppPrefill:
    """A joining request's prefill on llama.cpp: every prompt token but the last into its own sequence ``seq``,
    ``chunk`` tokens per ``step``; ``score`` / ``top``: the prompt's log-probabilities, as ``Prefill``'s."""

    hidden = None  # llama.cpp hands out no hidden states

    def __init__(self, owner: "LlamaCppBatchVerifier", seq: int, token_ids: list[int],
                 score: Sequence[int] | None = None, top: int = 0):
        self.owner = owner
        self.seq = seq
        self.ids = list(token_ids)
        self.done = 0
        self.score, self.top = (list(score), top) if score is not None else (None, 0)
        self.scores: list[TokenLogprob] | None = [] if score is not None else None

    @property
    def finished(self) -> bool:
        return self.done >= len(self.ids)

    @torch.inference_mode()
    def step(self, chunk: int) -> int:
        """Prefill the next ``chunk`` tokens at most; returns how many."""
        v = self.owner.verifier
        chunk = min(chunk, v.batch_tokens, PROMPT_LOGPROBS_CHUNK if self.score is not None else chunk)
        part = self.ids[self.done: self.done + chunk]
        if not part:
            return 0
        self.owner.check(self.seq)
        if self.score is None:  # decoded with the next verify (the running rows' tokens ride along), or sooner
            self.owner.defer(self.seq, part, self.done)
        else:
            logits = v._decode(part, range(self.done, self.done + len(part)), [(self.seq,)] * len(part), True)
            self.scores += token_logprobs(logits, self.score[self.done: self.done + len(part)], self.top)
        self.done += len(part)
        return len(part)


class LlamaCppBatchVerifier:
    """Scores the drafts of the running requests (rows 0..B-1) in one ``llama_decode`` of a ``LlamaCppVerifier``'s
    context (module docstring); ``BatchVerifier``'s interface, plus ``start_prefill`` and ``abandon`` for the
    requests' prefills, which run into the same context. ``kv_budget``: cells for the reservations (default: the
    whole context)."""

    def __init__(self, verifier, slots: int, hidden_layers: Sequence[int] = (), *, kv_budget: int | None = None):
        if hidden_layers:
            raise ValueError(f"{verifier.name}: the llama.cpp backend has no hidden states (layers "
                             f"{list(hidden_layers)} asked for); drafters that read them need "
                             f"verifier: {{backend: torch}}")
        if slots + 1 > verifier.max_sequences:
            raise ValueError(f"max_batch={slots}: the llama.cpp backend holds {verifier.max_sequences} sequences "
                             f"(one per request, the rest for draft trees' leaves)")
        cells = verifier.context_length if kv_budget is None else int(kv_budget)
        if cells > verifier.context_length:
            raise ValueError(f"kv_budget={kv_budget}: the llama.cpp context holds {verifier.context_length} positions "
                             f"(verifier: {{context: ...}} in the pool)")
        self.verifier = verifier
        self.model = verifier.model
        self.hidden_layers: tuple[int, ...] = ()
        #: the most draft nodes a row may verify: every row's tree leaves (at most its nodes) must find a sequence
        #: beside one per request, so a step never runs out of them (the scheduler cuts longer drafts to it)
        self.node_limit = (verifier.max_sequences - slots) // slots
        if self.node_limit < 8:
            log.warning("%s: max_batch=%d leaves %d draft nodes per request on the llama.cpp backend (its %d sequences "
                        "hold the requests and their trees' leaves)", verifier.name, slots, self.node_limit,
                        verifier.max_sequences)
        self.cache = CellBudget(cells, slots, KVGeometry.of(verifier.model))
        self.forwards = 0
        self._row_seq: list[int] = []  # sequence of each running row
        self._free = list(range(verifier.max_sequences - 1, -1, -1))  # free sequence ids (pop from the end)
        self._leaves: list[list[int] | None] = []  # per row of the verified block: its trees' per-node sequences
        #: prefill chunks not decoded yet, (sequence, tokens, first position): the next verify decodes them first, in
        #: the same llama_decode (``defer``)
        self._deferred: list[tuple[int, list[int], int]] = []
        self._broken: set[int] = set()  # sequences a failed decode left incomplete: their requests fail (``check``)
        self.prefixes = None  # the prefix cache whose entries hold sequences of this context (``keep_prefixes``)
        verifier.reset()

    def keep_prefixes(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> LlamaCppPrefixCache:
        """A prefix cache whose entries are sequences of this context (``llama_cpp_prefix.py``): at most
        ``max_entries``, and no more than a quarter of the sequences the requests leave to the leaves, which lose
        them (``node_limit`` shrinks to what is left)."""
        slots, spare = self.cache.slots, self.verifier.max_sequences - self.cache.slots
        entries = min(max_entries, spare // 4)
        self.node_limit = (spare - entries) // slots
        self.prefixes = LlamaCppPrefixCache(self, max_entries=entries)  # 0 (no sequence to spare): nothing is stored
        return self.prefixes

    # -------------------------------------------------------------- prefill, join, leave
    def start_prefill(self, token_ids: list[int], layers: Sequence[int] = (), score: Sequence[int] | None = None,
                      top: int = 0, prefix=None) -> LlamaCppPrefill:
        """A joining request's prefill into a sequence of its own (``Prefill``'s arguments): with ``prefix`` (entry,
        n) of the prefix cache, the sequence first takes the entry's first n cells and the prefill starts after them."""
        if layers:
            raise ValueError("the llama.cpp backend keeps no hidden states")
        prefill = LlamaCppPrefill(self, self._take(), token_ids, score, top)
        if prefix is not None:
            entry, n = prefix
            self.share(entry.seq, prefill.seq, n)
            prefill.done = n
        return prefill

    def abandon(self, prefill: LlamaCppPrefill) -> None:
        """A request left during its prefill: its chunks not decoded yet are dropped, its sequence's cells freed."""
        self._deferred = [c for c in self._deferred if c[0] != prefill.seq]
        self._drop(prefill.seq)

    def defer(self, seq: int, tokens: list[int], start: int) -> None:
        """A prefill chunk (positions ``start``.. of sequence ``seq``) to decode with the next verify: one llama_decode
        then carries the prompt tokens and the running rows' drafts, so decoding rides along with prefilling (as
        llama.cpp's own server batches them). Decoded at once when it cannot wait: its sequence already has a chunk
        waiting, or the waiting tokens would pass the context's batch."""
        if any(s == seq for s, _, _ in self._deferred) or \
                sum(len(t) for _, t, _ in self._deferred) + len(tokens) > self.verifier.batch_tokens:
            self.flush()
        self._deferred.append((seq, list(tokens), start))

    def flush(self) -> None:
        """Decode the waiting prefill chunks now (no logits). A failure marks their sequences broken (``check``)."""
        chunks, self._deferred = self._deferred, []
        if not chunks:
            return
        try:
            self.verifier._decode([t for _, ts, _ in chunks for t in ts],
                                  [p for _, ts, a in chunks for p in range(a, a + len(ts))],
                                  [(s,) for s, ts, _ in chunks for _ in ts], False)
        except BaseException:
            self._broken.update(s for s, _, _ in chunks)
            raise

    def check(self, seq: int) -> None:
        """Raise for a sequence whose prefill chunk a failed decode lost (its request must fail, not run on holes)."""
        if seq in self._broken:
            raise RuntimeError(f"{self.verifier.name}: a decode holding this request's prompt failed; its KV is "
                               f"incomplete")

    def join(self, slot: SlotVerifier, prefill: LlamaCppPrefill) -> None:
        self.check(prefill.seq)
        row = self.cache.active
        self._row_seq.append(prefill.seq)
        self.cache.lengths[row] = prefill.done
        self.cache.active += 1
        slot.row = row

    padding = None  # every forward runs at its exact shape (``BatchVerifier.padding``)

    @staticmethod
    def padded(batch: int, tokens: int) -> tuple[int, int]:
        """(rows, tokens a row) a forward runs: exactly the batch's."""
        return batch, tokens

    def remove(self, row: int) -> int | None:
        """Free ``row``'s sequence; the last row takes its index (no cells move). Returns the last row's old index
        when it moved, else None."""
        last = self.cache.active - 1
        if not 0 <= row <= last:
            raise ValueError(f"LlamaCppBatchVerifier: row {row} is not in use (rows 0..{last})")
        self._drop(self._row_seq[row])
        moved = None
        if row != last:
            self._row_seq[row] = self._row_seq[last]
            self.cache.lengths[row] = self.cache.lengths[last]
            moved = last
        self._row_seq.pop()
        self.cache.lengths[last] = 0
        self.cache.active = last
        return moved

    def reset(self) -> None:
        """Drop every row and prefill (after a step broke: their requests failed): the context is cleared, the stored
        prefixes with it."""
        self.verifier.reset()
        if self.prefixes is not None:
            self.prefixes.forget()
        self._row_seq, self._leaves, self._deferred, self._broken = [], [], [], set()
        self._free = list(range(self.verifier.max_sequences - 1, -1, -1))
        self.cache.reset()

    def _take(self) -> int:
        if not self._free:
            raise RuntimeError(f"the llama.cpp backend's {self.verifier.max_sequences} sequences are all in use "
                               f"(requests and draft-tree leaves): verify smaller trees or fewer requests at once")
        return self._free.pop()

    def _drop(self, seq: int) -> None:
        self.verifier.lib.llama_memory_seq_rm(self.verifier._memory, seq, -1, -1)
        self._broken.discard(seq)
        self._free.append(seq)

    # the prefix cache's sequences (llama_cpp_prefix.py)
    take_sequence, drop_sequence = _take, _drop

    def row_sequence(self, row: int) -> int:
        return self._row_seq[row]

    def share(self, source: int, target: int, n: int) -> None:
        """Sequence ``target`` also sees ``source``'s cells at positions 0..n-1 (no copy: the cells' sets grow)."""
        self.verifier.lib.llama_memory_seq_cp(self.verifier._memory, source, target, 0, n)

    # -------------------------------------------------------------- a verify
    @torch.inference_mode()
    def verify(self, pendings: Sequence[int], drafts: Sequence[Draft]) -> list[VerifierOutput]:
        """Rows 0..B-1: score [pending] + draft of each; the context holds the new tokens until ``commit``. Returns
        one ``VerifierOutput`` per row: logits [n_b + 1, vocab], no hidden states. Rows are split over several
        ``llama_decode`` calls only where their tokens exceed the context's batch."""
        v, B = self.verifier, len(drafts)
        if self._leaves:
            raise RuntimeError("LlamaCppBatchVerifier.verify called twice without a commit in between")
        tokens, positions, sequences, sizes = [], [], [], []
        leaves: list[list[int] | None] = []
        for seq in self._row_seq[:B]:
            self.check(seq)
        try:
            for b in range(B):
                draft, past, seq = drafts[b], self.cache.lengths[b], self._row_seq[b]
                n = len(draft)
                if past + n + 1 > v.context_length:
                    raise ValueError(f"{v.name}: {past + n + 1} positions exceed the llama.cpp context of "
                                     f"{v.context_length}")
                per_node = None if draft.is_chain else self._tree_sequences(seq, draft.parents.tolist())
                leaves.append(per_node)
                tokens.append([int(pendings[b]), *draft.tokens.tolist()])
                positions.append([past + d for d in draft.layout.depths])
                sequences.append(per_node or [(seq,)] * (n + 1))
                sizes.append(n + 1)
            if max(sizes, default=0) > v.batch_tokens:
                raise ValueError(f"{v.name}: a draft of {max(sizes) - 1} nodes exceeds the llama.cpp backend's "
                                 f"{v.batch_tokens - 1}")
            # waiting prefill chunks first, segments with no logits; a joining row's chunk also goes into its tree's
            # leaf sequences, which copied the row's prefix before these cells existed
            leaves_of = {self._row_seq[b]: per_node[0] for b, per_node in enumerate(leaves) if per_node is not None}
            chunks, self._deferred = self._deferred, []
            segments = [(ts, range(a, a + len(ts)), [(s, *leaves_of.get(s, ()))] * len(ts), False)
                        for s, ts, a in chunks]
            segments += [(tokens[b], positions[b], sequences[b], True) for b in range(B)]
            logits = []
            try:
                for group in _groups([len(g[0]) for g in segments], v.batch_tokens):  # each group one llama_decode
                    parts = [segments[i] for i in group]
                    out = v._decode([t for p in parts for t in p[0]], [x for p in parts for x in p[1]],
                                    [q for p in parts for q in p[2]],
                                    [p[3] for p in parts for _ in p[0]])
                    start = 0
                    for p in parts:
                        if p[3]:
                            logits.append(out[start: start + len(p[0])])
                            start += len(p[0])
            except BaseException:
                self._broken.update(s for s, _, _ in chunks)
                raise
        except BaseException:
            self._leaves = leaves
            self._release_leaves()
            raise
        self._leaves = leaves
        self.forwards += 1
        return [VerifierOutput(x, {}) for x in logits]

    def _tree_sequences(self, seq: int, parents: list[int]) -> list[list[int]]:
        """Per block row (0 = pending, i+1 = node i) of a tree in row sequence ``seq``: the temporary sequences of the
        leaves below it, each holding the row's prefix (``leaf_sequences``); none kept when they run out."""
        taken: list[int] = []

        def new_leaf() -> int:
            taken.append(self._take())
            self.verifier.lib.llama_memory_seq_cp(self.verifier._memory, seq, taken[-1], -1, -1)
            return taken[-1]

        try:
            return leaf_sequences(parents, new_leaf)
        except RuntimeError:
            for s in taken:
                self._drop(s)
            raise

    def _release_leaves(self) -> None:
        for per_node in self._leaves:
            if per_node is not None:
                for s in per_node[0]:  # the pending token's row lies above every leaf
                    self._drop(s)
        self._leaves = []

    def commit(self, slots: Sequence[SlotVerifier | None]) -> None:
        """After the verify: each row keeps its pending token and accepted nodes (``SlotVerifier.kept``) in its own
        sequence; None (or no ``kept``): a row whose request leaves, its new cells dropped."""
        lib, mem = self.verifier.lib, self.verifier._memory
        try:
            for b, slot in enumerate(slots):
                kept = None if slot is None else slot.kept
                if slot is not None:
                    slot.kept = None
                seq, past, per_node = self._row_seq[b], self.cache.lengths[b], self._leaves[b]
                end = past + (0 if kept is None else len(kept))
                if per_node is not None and kept is not None:
                    leaf = per_node[int(kept[-1])][0]  # a leaf below the last accepted row: it holds the path
                    lib.llama_memory_seq_rm(mem, leaf, end, -1)
                    lib.llama_memory_seq_cp(mem, leaf, seq, past, end)
                lib.llama_memory_seq_rm(mem, seq, end, -1)  # a chain's rejected nodes (a tree put none in seq)
                self.cache.lengths[b] = end
        finally:
            self._release_leaves()


def _groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive rows in groups of at most ``limit`` tokens each (every size <= limit)."""
    groups: list[list[int]] = [[]]
    total = 0
    for b, n in enumerate(sizes):
        if total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(b)
        total += n
    return [g for g in groups if g]
