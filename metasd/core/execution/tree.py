"""Drafts as token trees: a chain is the special case where every node's parent is the previous node.

Node indices are 0..n-1 in topological order (``parents[i] < i``); ``parents[i] == -1`` means the node
continues the last committed token (the "root", which the verifier scores at index 0 of its output).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import torch

from .host_read import read_together
from .staging import to_device


class DeviceTokens:
    """Draft tokens drafted on a device and not read by the host yet (docs/architecture.md#where-tensors-live).

    A chain drafted on the device is fed to the verifier from there; the host reads it once, beside the verifier's
    choices (``read_with``: one transfer for both), so a greedy chain step reads the device once. The read is kept:
    every later reader (the drafter's own bookkeeping, the request's commit) takes the host copy.

    values: [n] int64 on the device."""

    def __init__(self, values: torch.Tensor, source: "DeviceTokens | None" = None):
        self.values = values.reshape(-1).long()
        self._source = source  # the tokens these are the first of (read together: one read for both)
        self._host: list[int] | None = None

    def __len__(self) -> int:
        return self.values.numel()

    def prefix(self, n: int) -> "DeviceTokens":
        """The first ``n`` tokens, read when these are (and these when they are)."""
        return DeviceTokens(self.values[:n], self._source or self)

    @property
    def read(self) -> bool:
        return self._host is not None or (self._source is not None and self._source.read)

    @property
    def root(self) -> "DeviceTokens":
        """The tokens these are the first of (or these): what a joint read reads."""
        return self._source or self

    def fill(self, host: list[int]) -> None:
        """The tokens as read by a joint read (``read_choices``)."""
        self._host = host

    def host(self) -> list[int]:
        """The tokens as host ints (the host read, the first time)."""
        if self._host is None:
            self._host = self._source.host()[: len(self)] if self._source is not None else self.values.tolist()
        return self._host

    def read_with(self, other: torch.Tensor) -> list:
        """``other.tolist()``, read in the same transfer as these tokens where they are unread and on its device."""
        if self._source is not None:
            out = self._source.read_with(other)
            self.host()
            return out
        if self._host is not None or other.device != self.values.device or other.dtype != self.values.dtype:
            return other.tolist()
        self._host, out = read_together([self.values, other])
        return out


class Draft:
    """One proposal of a drafter: a chain or a tree of tokens.

    tokens:  [n] int64 draft tokens, on the host (CPU); given as ``DeviceTokens``, they stay on the drafter's device
             until the acceptance reads them beside the verifier's choices (``read_with``) - ``tokens`` reads them
             then, or at once when something asks first (a host read)
    parents: [n] int64 parent node index, -1 for children of the root (the last committed token), on the host
    probs:   [n, vocab] float or None, on the drafter's device. Row i is the (processed) drafter distribution q that
             node i's token was drawn from, before removing siblings drawn earlier. None: the draft has no
             probabilities (n-gram, argmax drafts) and is verified by sample-and-match.

    Where tensors live (docs/architecture.md#where-tensors-live): the tree's shape is small and read by the host
    anyway (masks, acceptance), so parents are host tensors; tokens are host tensors too, except a chain drafted on
    a device, which the verifier takes from there (``device_tokens``) - other device tensors given here are copied
    to the host: a host read.
    without_replacement: siblings were drawn without replacement from ``probs`` (RSD trees); recursive
             rejection then renormalises q after each rejected sibling.
    catch_up: committed tokens the drafter had to feed this step beyond the pending one (tokens committed by
             other drafters' steps or the prompt: the cost of switching to it), summed in the request's stats.
    meta:    drafter-specific figures of this step (for analysis; nothing in the engine reads them).
    """

    def __init__(self, tokens, parents, probs: torch.Tensor | None = None, without_replacement: bool = True,
                 meta: dict | None = None, catch_up: int = 0):
        self._device: DeviceTokens | None = tokens if isinstance(tokens, DeviceTokens) else None
        self._tokens = None if self._device is not None else \
            torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
        self.parents = torch.as_tensor(parents, dtype=torch.long).reshape(-1).cpu()
        self.probs, self.without_replacement, self.catch_up = probs, without_replacement, catch_up
        self.meta = {} if meta is None else meta
        n = len(self.parents)
        given = len(self._device) if self._device is not None else len(self._tokens)
        if given != n:
            raise ValueError(f"Draft: tokens ({given},) and parents ({n},) differ in length")
        self.layout = tree_layout(tuple(self.parents.tolist()))  # checks the parents; shared by drafts of one shape
        if self.probs is not None and self.probs.shape[0] != n:
            raise ValueError(f"Draft: probs has {self.probs.shape[0]} rows for {n} tokens")

    def __repr__(self) -> str:
        tokens = self._tokens.tolist() if self._tokens is not None else f"<{len(self)} on the device>"
        return f"Draft(tokens={tokens}, parents={self.parents.tolist()}, meta={self.meta})"

    @property
    def tokens(self) -> torch.Tensor:
        """[n] int64 on the host (tokens left on the device are read now, unless the acceptance read them)."""
        if self._tokens is None:
            self._tokens = torch.tensor(self._device.host(), dtype=torch.long)
        return self._tokens

    def device_tokens(self, device: torch.device) -> torch.Tensor:
        """[n] int64 on ``device``: the drafted tensor itself where it is there, else the host tokens staged there
        (no host read either way)."""
        d = self._device
        if d is not None and d.values.device == torch.device(device):
            return d.values
        return to_device(self.tokens, device)

    @property
    def on_host(self) -> bool:
        """Whether the host has the tokens (given so, or read): else they are on the device, unread."""
        return self._tokens is not None or self._device is None or self._device.read

    def unread_on(self, device: torch.device) -> DeviceTokens | None:
        """The drafted tokens (``DeviceTokens.root``) where they are on ``device`` and unread, else None."""
        d = self._device
        return d.root if not self.on_host and d.values.device == device else None

    def read_with(self, other: torch.Tensor) -> list:
        """``other.tolist()``, read in the same host read as the draft's tokens where those are still on its device."""
        return self._device.read_with(other) if self._tokens is None and self._device is not None else other.tolist()

    @classmethod
    def chain(cls, tokens, probs: torch.Tensor | None = None, catch_up: int = 0, **meta) -> "Draft":
        n = len(tokens) if isinstance(tokens, DeviceTokens) else torch.as_tensor(tokens).numel()
        return cls(tokens, torch.arange(n) - 1, probs, meta=dict(meta), catch_up=catch_up)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return self.layout.is_chain

    def depths(self) -> torch.Tensor:
        """[n] depth of each node; children of the root have depth 1."""
        return torch.tensor(self.layout.depths[1:], dtype=torch.long)

    @property
    def depth(self) -> int:
        return max(self.layout.depths)

    def paths(self) -> list[list[int]]:
        """The draft tokens before each row of its verified logits: [] for row 0 (after the committed tokens), then
        for row i+1 node i's path - its ancestors' tokens, then its own."""
        rows: list[list[int]] = [[]]
        tokens = self.tokens.tolist() if len(self) else []
        for i, parent in enumerate(self.parents.tolist()):  # a parent comes before its children
            rows.append(rows[parent + 1] + [tokens[i]])
        return rows

    def truncated(self, max_depth: int) -> "Draft":
        """The sub-tree of nodes at depth <= max_depth (keeps topological indices consistent)."""
        if max_depth >= self.depth:
            return self
        if self.is_chain:  # its first nodes (tokens left where they are)
            return self.first(max_depth)
        keep = (self.depths() <= max_depth).nonzero().squeeze(-1)
        remap = torch.full((len(self),), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        probs = None if self.probs is None else self.probs[to_device(keep, self.probs.device)]
        return Draft(self.tokens[keep], parents, probs, self.without_replacement, dict(self.meta), self.catch_up)

    def first(self, n: int) -> "Draft":
        """The draft's first ``n`` nodes (topological order: an ancestor-closed subtree, node indices unchanged) - a
        node budget. Exact under every acceptance rule: later siblings are dropped, never reordered."""
        if n >= len(self):
            return self
        probs = None if self.probs is None else self.probs[:n]
        tokens = self.tokens[:n] if self._tokens is not None else self._device.prefix(n)
        return Draft(tokens, self.parents[:n], probs, self.without_replacement, dict(self.meta), self.catch_up)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[n] parents -> [n] depths (root children: 1). On host lists: a tree is a few dozen nodes, and one tensor
    element write costs more than the whole loop."""
    return torch.tensor(depths_of(parents.tolist()), dtype=torch.long)


def depths_of(parents: Sequence[int]) -> list[int]:
    """``node_depths`` on a host list of parents (each before its children)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[n+1, n+1] bool: row i may attend column j iff j is i or an ancestor of i.

    Index 0 is the root (the last committed token); node i of the draft is index i+1.
    """
    return tree_layout(tuple(parents.tolist())).mask.clone()


class TreeLayout(NamedTuple):
    """What a step needs of a tree's shape, computed once per shape (``tree_layout``). Index 0 is the root, node i of
    the draft index i+1."""

    depths: tuple[int, ...]  # [n+1]: the root's 0, then each node's depth (the root's children: 1)
    mask: torch.Tensor  # [n+1, n+1] bool, ``ancestor_mask``'s (shared: read it, never write into it)
    children: tuple[tuple[int, ...], ...]  # ``children_lists``'
    is_chain: bool


@functools.lru_cache(maxsize=1024)
def tree_layout(parents: tuple[int, ...]) -> TreeLayout:
    """The layout of the tree of ``parents`` (each node's parent before it, -1: the root); ``ValueError`` for parents
    that are not such a tree. Cached: a static tree has one shape, a dynamic one a few, and building the mask for every
    request at every step cost more than the rest of a batch's inputs."""
    if any(not -1 <= p < i for i, p in enumerate(parents)):
        raise ValueError(f"Draft: parents must satisfy -1 <= parents[i] < i, got {list(parents)}")
    n = len(parents)
    rows = [[False] * (n + 1) for _ in range(n + 1)]
    rows[0][0] = True
    for i, p in enumerate(parents):
        row = rows[i + 1] = rows[p + 1].copy()  # the parent's ancestors (topological order: already complete)
        row[i + 1] = True
    kids: list[list[int]] = [[] for _ in range(n + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return TreeLayout((0, *depths_of(parents)), torch.tensor(rows, dtype=torch.bool), tuple(map(tuple, kids)),
                      all(p == i - 1 for i, p in enumerate(parents)))


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """Children (node indices, in draft order) of the root (entry 0) and of each node i (entry i+1)."""
    return [list(kids) for kids in tree_layout(tuple(parents.tolist())).children]
