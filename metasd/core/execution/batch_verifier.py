"""The verifier of many requests at once: one forward scores the drafts of every running request (``BatchVerifier``),
and each request sees its part of it through a ``SlotVerifier`` - what ``Request`` needs of a verifier (its hidden
states, ``commit``), so acceptance, commit, feedback and rewards are the same code as for one request.

A request joins after a prefill of its own (batch 1, in chunks: ``Prefill``), whose cache is copied into a row of
the ``BatchCache``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from .batch_cache import BatchCache, RowCache
from .batch_runner import BatchGraphRunner
from .hidden import HiddenStore
from .kv_cache import cache_kwargs
from .kv_memory import KVGeometry
from .prefix_cache import PrefixEntry
from .staging import to_device
from .logprobs import PROMPT_LOGPROBS_CHUNK, TokenLogprob, token_logprobs
from .tree import Draft
from .verifier import Verifier, VerifierOutput


def batch_inputs(lengths: Sequence[int], pendings: Sequence[int], drafts: Sequence[Draft]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of one forward over B requests (host tensors): ids [B, N] (row b: its pending token, its draft's nodes -
    0 where the draft's tokens are still on the device, ``Draft.on_host`` - then padding), position ids [B, N] (row
    b's length + depth; padding continues from there) and the 4-D mask [B, 1, N, W] (W = max length + N): row b's
    query i sees columns < length[b] (its committed prefix) and the columns length[b] + j of its tree ancestors j and
    itself; a padding query sees its prefix and itself (so its attention stays finite), and no query sees another
    row's new tokens or padding.

    lengths: cached positions of each row; pendings: each row's pending token; drafts: each row's draft."""
    B = len(drafts)
    N = 1 + max((len(d) for d in drafts), default=0)
    W = max(lengths, default=0) + N
    ids = [[0] * N for _ in range(B)]  # [B, N]
    pos: list[list[int]] = []  # [B, N]
    prefix = torch.arange(W) < torch.tensor(lengths, dtype=torch.long)[:, None]  # [B, W]: each row's committed prefix
    mask = prefix[:, None, None, :].repeat(1, 1, N, 1)  # [B, 1, N, W]
    pad_rows: list[int] = []  # padding queries, each seeing itself: (row, query, column)
    pad_queries: list[int] = []
    pad_columns: list[int] = []
    for b, (length, pending, draft) in enumerate(zip(lengths, pendings, drafts)):
        n, layout = len(draft), draft.layout  # the tree's depths and ancestor mask, computed once per shape
        ids[b][0] = pending
        if draft.on_host:  # else its tokens are on the device: ``BatchVerifier.verify`` writes them there
            ids[b][1: n + 1] = draft.tokens.tolist()
        pos.append([length + d for d in layout.depths] + list(range(length + n + 1, length + N)))
        mask[b, 0, : n + 1, length: length + n + 1] = layout.mask  # [n+1, n+1]
        pad = range(n + 1, N)
        pad_rows += [b] * len(pad)
        pad_queries += pad
        pad_columns += [length + i for i in pad]
    if pad_rows:
        mask[pad_rows, 0, pad_queries, pad_columns] = True
    return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), mask


class SlotVerifier:
    """One running request's view of the batched verifier: what ``Request`` reads of a verifier (``model``,
    ``device``, ``name``, ``hidden``) and its ``commit``, which keeps the accepted rows' hidden states and records
    the cache rows to keep for the batch's commit (``BatchVerifier.commit``). ``row``: its row in the cache."""

    def __init__(self, verifier: Verifier, hidden: HiddenStore | None):
        self.base = verifier
        self.model = verifier.model
        self.name = verifier.name
        self.context_length = verifier.context_length
        self.hidden = hidden
        self.row: int | None = None
        self.kept: torch.Tensor | None = None  # rows of the last verified block to keep, until the batch commit

    @property
    def device(self) -> torch.device:
        return self.base.device

    def verify(self, pending: int, draft: Draft) -> VerifierOutput:
        raise RuntimeError("a scheduled request is verified by its scheduler's batched forward")

    def commit(self, path: Sequence[int], out: VerifierOutput | None = None) -> torch.Tensor:
        rows = torch.tensor([0] + [i + 1 for i in path], dtype=torch.long)
        self.kept = rows
        if self.hidden is not None:
            if out is None:
                raise ValueError("SlotVerifier.commit: the verify output is needed to keep the hidden states in step")
            self.hidden.append(out.hidden, rows.to(self.device))
        return rows


class Prefill:
    """A joining request's prefill: its ``token_ids`` into ``cache`` (the batched cache's row staged for it,
    ``BatchCache.stage``), ``chunk`` tokens per call of ``step``, with the hidden states of ``layers`` for the drafters
    that read them; with ``prefix`` (an entry of the prefix cache and how many of its positions are this prompt's) it
    starts after them. With ``score`` (the tokens that follow each position: the prompt's tokens 1..T) it keeps their
    raw log-probabilities in ``scores`` (``top`` alternatives each; ``Verifier.prefill``).

    The scheduler gives it the whole prompt (``BatchVerifier.prefills_prompt``): its last forward keeps the logits after
    the prompt's last token in ``last_logits`` ([1, vocab]), from which the request draws its first token as soon as
    the prompt is in (``Request.first_token``) - a step's pending token is then that first token."""

    def __init__(self, verifier: Verifier, token_ids: list[int], layers: Sequence[int],
                 cache: RowCache, score: Sequence[int] | None = None, top: int = 0,
                 prefix: tuple[PrefixEntry, int] | None = None):
        self.model = verifier.model
        self.device = verifier.device
        self.ids = list(token_ids)
        self.layers = tuple(sorted(set(layers)))
        self.hidden = HiddenStore(self.layers) if self.layers else None
        self.cache = cache  # where the prompt's keys and values go: its row of the batched cache
        self.done = 0
        if prefix is not None:  # its first n positions from the prefix cache: the prefill starts after them
            entry, n = prefix
            for layer, keys, values in zip(self.cache.layers, entry.keys, entry.values):
                layer.k_buf[0, :, :n] = keys[:, :n]
                layer.v_buf[0, :, :n] = values[:, :n]
            self.cache.set_length(n)
            self.done = n
        self.score, self.top = (list(score), top) if score is not None else (None, 0)
        self.scores: list[TokenLogprob] | None = [] if score is not None else None
        self.last_logits: torch.Tensor | None = None  # [1, vocab]: after the last token, once the prefill is done
        if not self.ids and self.hidden is not None:
            self.hidden.append({layer: torch.empty(0, verifier.hidden_size, dtype=verifier.dtype, device=self.device)
                                for layer in self.layers})

    @property
    def finished(self) -> bool:
        return self.done >= len(self.ids)

    @torch.inference_mode()
    def step(self, chunk: int) -> int:
        """Prefill the next ``chunk`` tokens at most; returns how many."""
        if self.score is not None:
            chunk = min(chunk, PROMPT_LOGPROBS_CHUNK)
        part = self.ids[self.done: self.done + chunk]
        if not part:
            return 0
        out = self.model(input_ids=to_device([part], self.device, torch.long),
                         **cache_kwargs(self.model, self.cache), use_cache=True,
                         logits_to_keep=1 if self.score is None else 0, output_hidden_states=bool(self.layers))
        if self.hidden is not None:
            self.hidden.append({layer: out.hidden_states[layer][0] for layer in self.layers})
        if self.score is not None:  # (its last row, after the prompt's last token, scores no prompt token)
            self.scores += token_logprobs(out.logits[0], self.score[self.done: self.done + len(part)], self.top)
        self.done += len(part)
        if self.finished:
            self.last_logits = out.logits[0, -1:]  # [1, vocab]
        return len(part)


#: rope types whose frequencies depend on the longest position of the batch (so one row's rotation would depend on the
#: others' lengths): refused by the batched verifier
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
#: attention implementations that take the batch's boolean 4-D mask as it is meant (sdpa: True = attend); eager adds
#: the mask to the scores (a boolean mask then adds 0 or 1 instead of masking), flash attention ignores it
MASKED_ATTENTION = ("sdpa",)


def check_batchable(model: PreTrainedModel, name: str) -> None:
    """Refuse, naming the model and the setting, a model the batched verifier would get silently wrong: layers other
    than full attention (sliding windows), a rope type that reads the batch's longest position, an attention
    implementation that does not apply a boolean 4-D mask."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None) or ()
    if any(t != "full_attention" for t in types):
        raise NotImplementedError(f"{name}: the batched verifier supports full-attention layers only; "
                                  f"this model has layer types {sorted(set(types))}")
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(cfg, key, None)
        kind = (rope or {}).get("rope_type", (rope or {}).get("type")) if isinstance(rope, dict) else None
        if kind in BATCH_DEPENDENT_ROPE:
            raise NotImplementedError(f"{name}: {key}.rope_type={kind!r} scales positions by the longest sequence in "
                                      f"the batch, so one request's output would depend on the others'; the batched "
                                      f"verifier refuses it (rope types {list(BATCH_DEPENDENT_ROPE)})")
    attn = getattr(cfg, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
    if attn not in MASKED_ATTENTION:
        raise NotImplementedError(f"{name}: attn_implementation={attn!r} does not apply the batch's boolean tree mask "
                                  f"as written; load the model with attn_implementation='sdpa'")


class BatchVerifier:
    """Scores the drafts of the running requests (rows 0..B-1 of ``cache``) in one forward of the verifier's model.
    ``budget_bytes``: the KV budget of the rows (None: none); ``extra_bytes_per_token``: what each reserved position
    costs beside the verifier's cache (the drafters' own caches); ``dense_extra_bytes_per_token``: what each row
    position costs in caches shaped like the rows (``BatchCache.followers``: the drafters' rows)."""

    def __init__(self, verifier: Verifier, slots: int, hidden_layers: Sequence[int] = (), *,
                 budget_bytes: int | None = None, extra_bytes_per_token: int = 0, dense_extra_bytes_per_token: int = 0):
        backend = getattr(verifier, "backend", "torch")
        if backend != "torch":
            raise ValueError(f"the scheduler (metasd serve, batched generation) batches torch verifiers only; "
                             f"{verifier.name} runs on {backend} (one request at a time: Engine.generate)")
        self.verifier = verifier
        self.model: PreTrainedModel = verifier.model
        self.hidden_layers = tuple(sorted(set(hidden_layers)))
        check_batchable(self.model, verifier.name)
        self.cache = BatchCache(KVGeometry.of(self.model), slots, budget_bytes=budget_bytes,
                                extra_bytes_per_token=extra_bytes_per_token,
                                dense_extra_bytes_per_token=dense_extra_bytes_per_token)
        self.forwards = 0  # forwards run (tests count them)
        # the verifier's graph setting (``Verifier(graphs=, fixed_shapes=)``): forwards padded to fixed shapes,
        # replayed from CUDA graphs where it captures (batch_runner.py)
        self.runner = (BatchGraphRunner(self.model, self.cache, capture=verifier.capture,
                                        hidden_layers=self.hidden_layers)
                       if getattr(verifier, "fixed_shapes", False) else None)

    def padded(self, batch: int, tokens: int) -> tuple[int, int]:
        """(rows, tokens a row) a forward of ``batch`` rows x ``tokens`` tokens a row runs: padded to its bucket with
        fixed shapes, as it is without."""
        return self.runner.padded(batch, tokens) if self.runner is not None else (batch, tokens)

    @property
    def padding(self):
        """``padded`` where forwards run at fixed shapes (what the allocator prices a step at), else None."""
        return self.padded if self.runner is not None else None

    @torch.inference_mode()
    def verify(self, pendings: Sequence[int], drafts: Sequence[Draft]) -> list[VerifierOutput]:
        """Rows 0..B-1: score [pending] + draft of each in one forward; the cache holds the new tokens until
        ``commit``. Returns one ``VerifierOutput`` per row, as ``Verifier.verify`` would: logits [n_b + 1, vocab]."""
        B = len(drafts)
        lengths = self.cache.lengths[:B]
        ids, pos, mask = batch_inputs(lengths, pendings, drafts)  # [B, N], [B, N], [B, 1, N, W]
        width = self.cache.prepare(B, ids.shape[1])
        assert width == mask.shape[-1]
        device = self.verifier.device
        # a chain drafted on the device: written there, not read by the host
        on_device = {b: draft.device_tokens(device) for b, draft in enumerate(drafts) if not draft.on_host}
        if self.runner is not None and self.runner.fits(B, ids.shape[1]):
            at_1 = {b: (1, tokens) for b, tokens in on_device.items()}  # after the row's pending token
            logits, hidden_states = self.runner.forward(ids, pos, mask, at_1)  # [B, N, vocab], {l: [B, N, d]}
        else:
            ids = to_device(ids, device)
            for b, tokens in on_device.items():
                ids[b, 1: len(tokens) + 1] = tokens
            out = self.model(input_ids=ids, position_ids=to_device(pos, device),
                             attention_mask=to_device(mask, device), **cache_kwargs(self.model, self.cache),
                             use_cache=True, output_hidden_states=bool(self.hidden_layers))
            logits = out.logits  # [B, N, vocab]
            hidden_states = {layer: out.hidden_states[layer] for layer in self.hidden_layers}
        self.forwards += 1
        choices = logits.argmax(-1)  # [B, N]: every row's greedy choices in one kernel (read at once: read_choices)
        results = []
        for b, draft in enumerate(drafts):
            n = len(draft) + 1
            hidden = {layer: h[b, :n] for layer, h in hidden_states.items()}
            results.append(VerifierOutput(logits[b, :n], hidden, choices[b, :n]))
        return results

    def commit(self, slots: Sequence[SlotVerifier | None]) -> None:
        """After the forward: each row keeps what its request committed (``SlotVerifier.kept``); None: a row whose
        request left during the step (its row is freed afterwards)."""
        kept = []
        for s in slots:
            kept.append(None if s is None or s.kept is None else s.kept)
            if s is not None:
                s.kept = None
        self.cache.commit(kept)

    #: a prefill takes the whole prompt and keeps the logits after it (``Prefill.last_logits``): the first token comes
    #: with the prefill, not after a step (a backend without it prefills all but the last token, which stays pending)
    prefills_prompt = True

    def start_prefill(self, token_ids: list[int], layers: Sequence[int] = (), score: Sequence[int] | None = None,
                      top: int = 0, prefix: tuple[PrefixEntry, int] | None = None) -> Prefill:
        """A joining request's prefill (``Prefill``), straight into a free row of the batched cache that its
        reservation allocated (``BatchCache.stage``): a prefill allocates nothing."""
        row = self.cache.stage()
        try:
            return Prefill(self.verifier, token_ids, layers, row, score, top, prefix)
        except BaseException:
            self.cache.unstage(row)
            raise

    def abandon(self, prefill: Prefill) -> None:
        """A request left during its prefill: its staged row is free again."""
        self.cache.unstage(prefill.cache)

    def join(self, slot: SlotVerifier, prefill: Prefill) -> None:
        """A prefilled request joins: its staged row becomes a running row (nothing is copied out of it)."""
        slot.row = self.cache.join_staged(prefill.cache)

    def remove(self, row: int) -> int | None:
        return self.cache.remove(row)

    def reset(self) -> None:
        """Drop every row (after a step broke: their requests failed)."""
        self.cache.reset()
