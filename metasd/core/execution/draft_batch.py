"""Drafter forwards of many requests in one (batched drafting, docs/architecture.md#batched-drafting).

A model drafter writes its drafting loop as a generator (``Drafter.drafting``) that yields a ``Feed`` for every
forward it needs - the tokens to feed after its own cache, their attention mask and positions - and gets the logits
back. ``drive`` runs one such loop alone (``Engine.generate``: each feed is one forward, exactly the forward the loop
made itself before). The scheduler advances the loops of all its running requests together and runs the feeds of
one round that share a model as ONE forward (``feed_groups``, ``run_group``): row b feeds its q_b tokens after its own cache's L_b
positions, padded to Q = max q_b; each row's keys and values are written into its own cache (``StackedCache``) and the
forward attends over W = max(L_b + Q) columns of the rows side by side, under a mask [B, 1, Q, W] that shows row b
its own prefix and what its feed's mask allows - never another row, never padding. So one drafter forward per level
serves the whole batch, as the verifier's forward does.

A drafter whose forward has no cache - a draft head over the verifier's hidden states (the block drafter's heads, the
hidden-state drafter's head) - yields a ``RowFeed`` instead: the rows it scores; the round's row feeds of one module
run as ONE call over their rows stacked, every row's output its own (the module treats rows independently). A
recurrence network that keeps its keys and values itself (the hidden-state drafter's ``HiddenStateNet.step``) yields a
``PackedFeed``: the round's packed feeds of one network run as ONE step over their rows packed into one sequence -
their pasts side by side, a block-diagonal mask that shows each feed its own past and its own causal block, no padding.
A one-shot block drafter (TreeFlash's backbone over each request's own context) yields a ``BlockFeed``: the round's
block feeds of one model run as ONE forward of their blocks, each context padded to the longest and masked.

A steered drafter (SD², drafters/steered.py) adds biases to its model's activations through forward hooks; its feed
says which (``Steer``: the hooks' ``injector``, the step's bias and which fed positions take it), and a group of steered
feeds of one injector runs as one forward with every row's own bias stacked [B, 1, n_steered, d_out] and its own
position mask padded [B, Q, 1] - the hooks add row b's bias to row b only.

What stays alone: a feed that must run inside a context of its own (``around``), a feed longer than ``LONG_FEED``
tokens (a new request's prompt: padding the others to it would cost more than its own forward), a model whose cache
has sliding-window layers, and a group of one.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Generator, Sequence

import torch
from torch import nn
from transformers import Cache

from .host_read import HostRead  # noqa: F401 - a drafting loop yields it, as it yields its feeds
from .kv_cache import cache_kwargs, cache_length
from .kv_memory import KVGeometry
from .staging import to_device
from .stacked_cache import StackedCache
from .static_cache import StaticKVCache

#: feeds longer than this run alone (a catch-up over a new request's prompt)
LONG_FEED = 16

#: a drafting loop: yields the forwards it needs, receives their logits, returns its draft (or anything)
Drafting = Generator["Feed | RowFeed | PackedFeed | BlockFeed", Any, Any]


@dataclass
class Feed:
    """One forward a drafting loop asks for: ``ids`` fed after the ``cache``'s L positions through ``model`` (and
    ``head``, a draft head over the base model's last hidden states, where the drafter has one). Returns logits
    [q, vocab] (the last row only, [1, vocab], with ``last_only``).

    mask: [q, L + q] bool (True = attend) over the cached positions and the fed ones; None: causal. positions: [q]
    position ids; None: L .. L + q - 1. steer: the activation biases a steered drafter adds in this forward (None:
    none). around: a context the forward must run in (anything acting on the shared model while this forward runs
    that cannot be told per row): such a feed runs alone."""

    model: nn.Module
    head: nn.Module | None
    cache: StaticKVCache
    ids: list[int] | torch.Tensor  # [q] host ints, or int64 on the model's device (draft tokens not read yet)
    mask: torch.Tensor | None = None  # [q, L + q] bool
    positions: torch.Tensor | None = None  # [q] int64
    last_only: bool = False
    steer: "Steer | None" = None
    around: Callable[[], ContextManager] | None = None

    @property
    def length(self) -> int:
        return int(self.ids.numel()) if isinstance(self.ids, torch.Tensor) else len(self.ids)

    def batch_key(self) -> tuple[int, int, int | None] | None:
        """Feeds with one key run in one forward; None: this one runs alone."""
        if self.around is not None or self.length > LONG_FEED or any(layer.is_sliding for layer in self.cache.layers):
            return None
        return id(self.model), id(self.head), None if self.steer is None else id(self.steer.injector)

    def run(self) -> torch.Tensor:
        """This feed alone: the forward the drafter ran itself before batched drafting - at a fixed shape where its
        cache is a row of a ``DraftRows`` (draft_rows.py: a request alone in a scheduler drafts captured too)."""
        rows = getattr(self.cache, "rows_owner", None)
        if rows is not None and rows.runs([self]):
            return rows.run_feeds([self])[0]
        return _run_alone(self)

    @staticmethod
    def run_together(feeds: Sequence["Feed"]) -> list[torch.Tensor]:
        return _run_batch(feeds)


@dataclass
class Steer:
    """The biases a steered drafter's hooks add in one forward (``drafters.steering_net.Injector``): ``delta``
    [n_steered, d_out], one per steered layer, added to the fed positions where ``mask`` [q, 1] is 1 (None: all of
    them). ``injector.active(delta, mask)`` is the context its hooks add them in; it takes a stacked delta
    [B, 1, n_steered, d_out] and mask [B, Q, 1] for a batched forward."""

    injector: Any
    delta: torch.Tensor  # [n_steered, d_out]
    mask: torch.Tensor | None = None  # [q, 1]

    def active(self) -> ContextManager:
        return self.injector.active(self.delta, self.mask)

    @staticmethod
    def stacked(feeds: Sequence["Feed"], Q: int) -> ContextManager:
        """The context of one forward of ``feeds`` (one injector; feed b's q_b tokens padded to Q): each row's own
        delta and mask, padding unsteered."""
        steers = [f.steer for f in feeds]
        if steers[0] is None:
            return nullcontext()
        delta = torch.stack([s.delta for s in steers])[:, None]  # [B, 1, n_steered, d_out]
        mask = delta.new_zeros(len(feeds), Q, 1)  # [B, Q, 1]
        for b, (f, s) in enumerate(zip(feeds, steers)):
            mask[b, : f.length] = 1.0 if s.mask is None else s.mask.to(mask.dtype)
        return steers[0].injector.active(delta, mask)


@dataclass
class RowFeed:
    """A forward without a cache a drafting loop asks for: ``module`` over ``rows`` [n, d] (and their ``positions``
    [n] where given: ``module(rows, positions)``), a module (or any callable) that computes every row on its own (a
    draft head over verifier hidden states: ``BlockHeads``; TreeFlash's context projection, logits and AR pass:
    ``BlockRows``). Returns ``module(rows)`` [n, ...], or a tuple of such tensors. Row feeds of one module run as one
    call over their rows stacked."""

    module: nn.Module | Callable[..., Any]
    rows: torch.Tensor  # [n, d]
    positions: torch.Tensor | None = None  # [n] int64

    @property
    def length(self) -> int:
        return int(self.rows.shape[0])

    def batch_key(self) -> tuple[str, int, bool]:
        return "rows", id(self.module), self.positions is None

    def run(self) -> Any:
        return self.module(self.rows) if self.positions is None else self.module(self.rows, self.positions)

    @staticmethod
    def run_together(feeds: Sequence["RowFeed"]) -> list[Any]:
        return _run_rows(feeds)


@dataclass
class PackedFeed:
    """One step of a recurrence network with keys and values of its own a drafting loop asks for: ``module.step(inputs,
    positions, past, mask)`` of a module with a ``dtype`` (``HiddenStateNet``: inputs [n, d] at ``positions`` [n]
    after ``past``, keys and values [n_kv, L, head_dim] each or None; causal). Returns the step's (outputs [n, d],
    (keys, values) [n_kv, n, head_dim]) for the loop to keep. Packed feeds of one network run as one step over their
    rows packed (``_run_packed``)."""

    module: nn.Module
    inputs: torch.Tensor  # [n, d]
    positions: torch.Tensor  # [n] int64
    past: tuple[torch.Tensor, torch.Tensor] | None  # [n_kv, L, head_dim] each

    @property
    def length(self) -> int:
        return int(self.inputs.shape[0])

    def batch_key(self) -> tuple[str, int]:
        return "packed", id(self.module)

    def run(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return self.module.step(self.inputs, self.positions, self.past)

    @staticmethod
    def run_together(feeds: Sequence["PackedFeed"]) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
        return _run_packed(feeds)


@dataclass
class BlockFeed:
    """One block forward of a one-shot block drafter a drafting loop asks for (``TreeFlashModel.forward``): the block
    ``block`` [1, B, d] at ``positions`` [1, B] over the request's own ``context`` (per layer (keys, values)
    [1, n_kv, n, head_dim]), with ``last_ctx`` [1, w] and ``skip`` [1, d] where the request has them. Returns
    h [1, B, d]. Block feeds of one model (and the same B, and the same of those two present) run as one forward of
    their blocks (``_run_blocks``)."""

    module: nn.Module
    block: torch.Tensor  # [1, B, d]
    positions: torch.Tensor  # [1, B] int64
    context: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, n_kv, n, head_dim] each
    last_ctx: torch.Tensor | None = None  # [1, w]
    skip: torch.Tensor | None = None  # [1, d]

    @property
    def length(self) -> int:
        return int(self.block.shape[1])

    def batch_key(self) -> tuple:
        return "block", id(self.module), self.length, self.last_ctx is None, self.skip is None

    def run(self) -> torch.Tensor:
        return self.module(self.block, self.positions, self.context, None, self.last_ctx, self.skip)

    @staticmethod
    def run_together(feeds: Sequence["BlockFeed"]) -> list[torch.Tensor]:
        return _run_blocks(feeds)


def forward_logits(model: nn.Module, head: nn.Module | None, cache: Cache, last_only: bool, **inputs) -> torch.Tensor:
    """One forward of a drafter model through ``cache`` (batch 1); next-token logits [rows, vocab] (the last row only
    when ``last_only``), from ``head`` (a draft head over the base model's hidden states) where given."""
    if head is None:
        return model(**inputs, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=int(last_only)).logits[0]
    base = model.base_model
    h = base(**inputs, **cache_kwargs(base, cache), use_cache=True).last_hidden_state[0]  # [n, d]
    return head(h[-1:] if last_only else h)


def batched_logits(model: nn.Module, head: nn.Module | None, cache: Cache, **inputs) -> torch.Tensor:
    """One forward of a drafter model of many rows through ``cache`` (``inputs``: ids, positions, mask [R, T, ...]);
    logits [R, T, vocab], from ``head`` (a draft head over the base model's hidden states) where given."""
    if head is None:
        return model(**inputs, **cache_kwargs(model, cache), use_cache=True).logits
    h = model.base_model(**inputs, **cache_kwargs(model.base_model, cache), use_cache=True).last_hidden_state
    return head(h.reshape(-1, h.shape[-1])).view(h.shape[0], h.shape[1], -1)  # [R, T, d] -> [R, T, vocab]


def run_feed(feed: Feed | RowFeed | PackedFeed | BlockFeed) -> Any:
    """A feed alone (its kind's ``run``): the forward the drafter ran itself before batched drafting."""
    return feed.run()


def _run_alone(feed: Feed) -> torch.Tensor:
    """A transformers-model feed alone: one forward of batch 1 through its own cache."""
    device = feed.model.device
    x = feed.ids.view(1, -1) if isinstance(feed.ids, torch.Tensor) else to_device([feed.ids], device, torch.long)
    inputs: dict[str, Any] = {"input_ids": x}
    if feed.mask is not None:
        inputs["attention_mask"] = to_device(feed.mask[None, None], device)
    if feed.positions is not None:
        inputs["position_ids"] = to_device(feed.positions[None], device)
    with feed.around() if feed.around is not None else nullcontext(), \
            feed.steer.active() if feed.steer is not None else nullcontext():
        return forward_logits(feed.model, feed.head, feed.cache, feed.last_only, **inputs)


def _run_rows(feeds: Sequence[RowFeed]) -> list[Any]:
    """Row feeds of one module in one call over their rows stacked; each feed's rows of the output (of each output,
    where the module returns a tuple)."""
    rows = torch.cat([f.rows for f in feeds])  # [sum n, d]
    out = (feeds[0].module(rows) if feeds[0].positions is None else
           feeds[0].module(rows, torch.cat([f.positions for f in feeds])))  # [sum n, ...] (or a tuple of them)
    sizes = [f.length for f in feeds]
    if isinstance(out, tuple):
        return list(zip(*(o.split(sizes) for o in out)))
    return list(out.split(sizes))


def _run_packed(feeds: Sequence[PackedFeed]) -> list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]:
    """Packed feeds of one network as one step: feed f's n_f rows after its L_f past positions, all rows in one sequence
    of N = sum n_f after the pasts concatenated (P = sum L_f columns), under a mask [N, P + N] that shows each row its
    own feed's past and the rows of its own feed up to itself - so each feed's outputs are what its step alone gives.
    Returns each feed's (outputs [n_f, d], (keys, values) [n_kv, n_f, head_dim])."""
    module = feeds[0].module
    device = feeds[0].inputs.device
    pasts = [0 if f.past is None else int(f.past[0].shape[1]) for f in feeds]
    ns = [f.length for f in feeds]
    P, N = sum(pasts), sum(ns)
    mask = torch.zeros(N, P + N, dtype=torch.bool, device=device)  # [N, P + N]
    past_at = row_at = 0
    for L, n in zip(pasts, ns):
        mask[row_at: row_at + n, past_at: past_at + L] = True
        mask[row_at: row_at + n, P + row_at: P + row_at + n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        past_at, row_at = past_at + L, row_at + n
    held = [f.past for f in feeds if f.past is not None]
    past = (torch.cat([k for k, _ in held], 1), torch.cat([v for _, v in held], 1)) if held else None
    inputs = torch.cat([f.inputs.to(module.dtype) for f in feeds])  # [N, d] (as step casts them)
    out, (keys, values) = module.step(inputs, torch.cat([f.positions for f in feeds]), past, mask)
    return [(o, (k, v)) for o, k, v in zip(out.split(ns), keys.split(ns, 1), values.split(ns, 1))]


def _run_blocks(feeds: Sequence[BlockFeed]) -> list[torch.Tensor]:
    """Block feeds of one model as one forward of A blocks: each request's context keys and values padded to the
    longest n (zeros) and masked out (``ctx_mask`` [A, n]); returns each feed's h [1, B, d]."""
    lengths = [int(f.context[0][0].shape[2]) for f in feeds]
    n = max(lengths)
    k0 = feeds[0].context[0][0]
    context = []
    for layer in range(len(feeds[0].context)):  # [A, n_kv, n, head_dim] each
        keys = k0.new_zeros(len(feeds), k0.shape[1], n, k0.shape[3])
        values = torch.zeros_like(keys)
        for a, (f, m) in enumerate(zip(feeds, lengths)):
            keys[a, :, :m] = f.context[layer][0][0]
            values[a, :, :m] = f.context[layer][1][0]
        context.append((keys, values))
    mask = None
    if min(lengths) < n:
        mask = torch.arange(n, device=k0.device)[None, :] < torch.tensor(lengths, device=k0.device)[:, None]  # [A, n]
    cat = (lambda xs: None if xs[0] is None else torch.cat(xs))
    h = feeds[0].module(torch.cat([f.block for f in feeds]), torch.cat([f.positions for f in feeds]), context, mask,
                        cat([f.last_ctx for f in feeds]), cat([f.skip for f in feeds]))  # [A, B, d]
    return list(h.split(1))


def feed_inputs(feeds: Sequence[Feed], starts: Sequence[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The host inputs of one forward of ``feeds`` (feed b's q_b tokens after its cache's ``starts[b]`` positions,
    padded to Q = max q_b): ids [B, Q] (0 where a feed's ids are on the device: returned apart, row -> ids [q_b]),
    position ids [B, Q] and the mask [B, 1, Q, W] over W = max(L_b + Q) columns that shows row b its own prefix and
    what its feed's mask allows - never padding (a padding query sees itself only: finite, and read by no one)."""
    B = len(feeds)
    q = [f.length for f in feeds]
    Q = max(q)
    W = max(s + Q for s in starts)
    on_device = {b: f.ids.view(-1) for b, f in enumerate(feeds)
                 if isinstance(f.ids, torch.Tensor) and f.ids.device.type != "cpu"}
    ids = [[0] * Q for _ in range(B)]  # [B, Q]
    pos: list[list[int]] = []  # [B, Q]
    for b, (f, n, s) in enumerate(zip(feeds, q, starts)):
        if b not in on_device:
            ids[b][:n] = f.ids.view(-1).tolist() if isinstance(f.ids, torch.Tensor) else list(f.ids)
        pos.append((f.positions.tolist() if f.positions is not None else list(range(s, s + n)))
                   + list(range(s + n, s + Q)))
    query = torch.arange(Q)[None, :, None]  # [1, Q, 1]
    column = torch.arange(W)[None, None, :]  # [1, 1, W]
    start = torch.tensor(starts, dtype=torch.long)[:, None, None]  # [B, 1, 1]
    real = query < torch.tensor(q, dtype=torch.long)[:, None, None]  # [B, Q, 1]
    # causal: query i sees its prefix and the fed tokens up to itself; a padding query, itself
    mask = torch.where(real, column <= start + query, column == start + query)[:, None]  # [B, 1, Q, W]
    for b, (f, n, s) in enumerate(zip(feeds, q, starts)):
        if f.mask is not None:  # its own mask over its prefix and its tokens (a tree level's ancestors)
            mask[b, 0, :n, : s + n] = f.mask
    return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), mask, on_device


def _run_batch(feeds: Sequence[Feed]) -> list[torch.Tensor]:
    """Feeds of one model (same ``batch_key``) in one forward; their logits, each as ``run_feed`` returns them. Rows
    of one drafter's ``DraftRows`` (draft_rows.py) run there at a fixed shape; other caches side by side
    (``StackedCache``)."""
    rows = getattr(feeds[0].cache, "rows_owner", None)
    if rows is not None and rows.runs(feeds):
        return rows.run_feeds(feeds)
    model, head = feeds[0].model, feeds[0].head
    device = model.device
    B = len(feeds)
    q = [f.length for f in feeds]
    starts = [cache_length(f.cache) for f in feeds]
    Q = max(q)
    W = max(s + Q for s in starts)
    geometry = KVGeometry.of(model)
    for f in feeds:  # every row's buffers hold the W columns attention reads (allocated now if never used)
        f.cache.reserve(W)
        f.cache.allocate(geometry)
    ids, pos, mask, on_device = feed_inputs(feeds, starts)  # [B, Q] host, [B, Q], [B, 1, Q, W], {b: device ids}
    ids = to_device(ids, device)  # staged: no host wait (nor the device's tokens read)
    for b, tokens in on_device.items():
        ids[b, : q[b]] = tokens
    stacked = StackedCache([f.cache for f in feeds], starts, W)
    inputs = dict(input_ids=ids, position_ids=to_device(pos, device), attention_mask=to_device(mask, device),
                  use_cache=True)
    # the LM head runs over the positions some row reads: each row's last where every feed wants its last only
    keep = sorted({n - 1 for n in q}) if all(f.last_only for f in feeds) else None
    with Steer.stacked(feeds, Q):
        if head is None:
            logits = model(**inputs, **cache_kwargs(model, stacked), logits_to_keep=0 if keep is None else
                           to_device(keep, device, torch.long)).logits  # [B, len(keep) or Q, vocab]
        else:
            h = model.base_model(**inputs, **cache_kwargs(model.base_model, stacked)).last_hidden_state  # [B, Q, d]
            h = h if keep is None else h[:, keep]
            logits = head(h.reshape(-1, h.shape[-1])).view(B, h.shape[1], -1)
    column = {p: i for i, p in enumerate(keep)} if keep is not None else None
    out = []
    for b, (f, n, s) in enumerate(zip(feeds, q, starts)):
        f.cache.set_length(s + n)
        last = column[n - 1] if column is not None else n - 1
        out.append(logits[b, last: last + 1] if f.last_only else logits[b, :n])
    return out


def feed_groups(feeds: Sequence[Feed | RowFeed | PackedFeed | BlockFeed]) -> list[list[int]]:
    """Indices of ``feeds`` grouped into the forwards that run them: feeds sharing a ``batch_key`` together, the
    others one by one (in order)."""
    groups: dict[Any, list[int]] = {}
    alone: list[list[int]] = []
    for i, f in enumerate(feeds):
        key = f.batch_key()
        if key is None:
            alone.append([i])
        else:
            groups.setdefault(key, []).append(i)
    return alone + list(groups.values())


def run_group(feeds: Sequence[Feed | RowFeed | PackedFeed | BlockFeed]) -> list[Any]:
    """One group of ``feed_groups``: one forward (a group of one runs as ``run_feed``)."""
    return [feeds[0].run()] if len(feeds) == 1 else type(feeds[0]).run_together(feeds)


def drive(loop: Drafting, watch: Callable[[Any], None] | None = None) -> Any:
    """Run a drafting loop alone: each feed it yields is one forward (``watch``, where given, sees each feed before it
    runs). Returns what the loop returns. A loop left by an error (a failed forward) is closed at once, so what it
    holds - inference mode, a steering context - ends here, in its own thread, not whenever it is collected."""
    try:
        feed = next(loop)
        while True:
            if watch is not None:
                watch(feed)
            feed = loop.send(run_feed(feed))
    except StopIteration as done:
        return done.value
    finally:
        loop.close()
