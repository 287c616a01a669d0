"""Drafts as token trees: a chain is the special case where every node's parent is the previous node.

Node indices are 0..n-1 in topological order (``parents[i] < i``); ``parents[i] == -1`` means the node
continues the last committed token (the "root", which the verifier scores at index 0 of its output).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .staging import to_device


@dataclass
class Draft:
    """One proposal of a drafter: a chain or a tree of tokens.

    tokens:  [n] int64 draft tokens, on the host (CPU)
    parents: [n] int64 parent node index, -1 for children of the root (the last committed token), on the host
    probs:   [n, vocab] float or None, on the drafter's device. Row i is the (processed) drafter distribution q that
             node i's token was drawn from, before removing siblings drawn earlier. None: the draft has no
             probabilities (n-gram, argmax drafts) and is verified by sample-and-match.

    Where tensors live (docs/architecture.md#where-tensors-live): the tree's shape is small and read by the host
    anyway (masks, acceptance), so tokens and parents are host tensors - a drafter working on a device reads its draft
    once and hands over host values (device tensors given here are copied to the host: a host read).
    without_replacement: siblings were drawn without replacement from ``probs`` (RSD trees); recursive
             rejection then renormalises q after each rejected sibling.
    catch_up: committed tokens the drafter had to feed this step beyond the pending one (tokens committed by
             other drafters' steps or the prompt: the cost of switching to it), summed in the request's stats.
    meta:    drafter-specific figures of this step (for analysis; nothing in the engine reads them).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    without_replacement: bool = True
    meta: dict = field(default_factory=dict)
    catch_up: int = 0

    def __post_init__(self):
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1).cpu()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1).cpu()
        if self.tokens.shape != self.parents.shape:
            raise ValueError(f"Draft: tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} differ in length")
        n = len(self.tokens)
        if n and not bool((self.parents < torch.arange(n)).all() and (self.parents >= -1).all()):
            raise ValueError(f"Draft: parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}")
        if self.probs is not None and self.probs.shape[0] != n:
            raise ValueError(f"Draft: probs has {self.probs.shape[0]} rows for {n} tokens")

    @classmethod
    def chain(cls, tokens, probs: torch.Tensor | None = None, catch_up: int = 0, **meta) -> "Draft":
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).cpu()
        return cls(tokens, torch.arange(len(tokens)) - 1, probs, meta=dict(meta), catch_up=catch_up)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(len(self)) - 1).all())

    def depths(self) -> torch.Tensor:
        """[n] depth of each node; children of the root have depth 1 (computed once per ``parents`` tensor: a step
        reads it several times)."""
        cached = self.__dict__.get("_depths")
        if cached is None or cached[0] is not self.parents:
            cached = self.__dict__["_depths"] = (self.parents, node_depths(self.parents))
        return cached[1]

    @property
    def depth(self) -> int:
        return int(self.depths().max()) if len(self) else 0

    def truncated(self, max_depth: int) -> "Draft":
        """The sub-tree of nodes at depth <= max_depth (keeps topological indices consistent)."""
        if max_depth >= self.depth:
            return self
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
        return Draft(self.tokens[:n], self.parents[:n], probs, self.without_replacement, dict(self.meta), self.catch_up)


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
    n = len(parents)
    rows = [[False] * (n + 1) for _ in range(n + 1)]
    rows[0][0] = True
    for i, p in enumerate(parents.tolist()):
        row = rows[i + 1] = rows[p + 1].copy()  # the parent's ancestors (topological order: already complete)
        row[i + 1] = True
    return torch.tensor(rows, dtype=torch.bool)


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """Children (node indices, in draft order) of the root (entry 0) and of each node i (entry i+1)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents.tolist()):
        kids[p + 1].append(i)
    return kids
