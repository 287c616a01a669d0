"""A draft tree grown level by level in a drafter's KV cache (``GrowingTree``: nodes, their cache slots and
the ancestor-only 4-D attention mask of each level's batched forward), and Gumbel sampling without
replacement for RSD trees (Gumbel-top-k siblings, stochastic beam search's conditional Gumbel)."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from metasd.core.execution.draft_batch import Drafting
from metasd.core.execution.host_read import HostRead


class GrowingTree:
    """A draft tree being built on top of ``base`` committed tokens, and its place in the drafter cache.

    Node i has ``tokens[i]``, ``parents[i]`` (-1: child of the last committed token), ``depths[i]`` (root
    children: 1) and ``slots[i]``: its offset in the drafter cache after the committed tokens, or -1
    while it has not been fed (only expanded nodes are fed).
    """

    def __init__(self, base: int):
        self.base = base
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.slots: list[int] = []
        self.n_fed = 0
        self.forwards = 0  # drafter forwards spent on this tree (the root's logits come from the catch-up)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.slots.append(-1)
        return len(self.tokens) - 1

    def path(self, i: int) -> list[int]:
        """Node i and its ancestors, root side first."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def inputs(self, feed: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [1, 1, q, kv] (bool, True = attend) and position ids [1, q] for feeding ``feed``.

        kv = base + already fed nodes + q. A query attends every committed position, the cache slots of
        its fed ancestors and itself. Every ancestor of a fed node must have been fed before.
        """
        q = len(feed)
        past = self.base + self.n_fed
        mask = torch.zeros(q, past + q, dtype=torch.bool)
        mask[:, : self.base] = True
        for row, node in enumerate(feed):
            if self.slots[node] >= 0:
                raise ValueError(f"node {node} was already fed")
            for a in self.path(node)[:-1]:
                if self.slots[a] < 0:
                    raise ValueError(f"node {node}: ancestor {a} was never fed")
                mask[row, self.base + self.slots[a]] = True
            mask[row, past + row] = True
        positions = torch.tensor([self.base - 1 + self.depths[n] for n in feed], dtype=torch.long)
        return mask[None, None], positions[None]

    def mark_fed(self, feed: Sequence[int]) -> None:
        for node in feed:
            self.slots[node] = self.n_fed
            self.n_fed += 1
        self.forwards += 1


def read_topk(scores: torch.Tensor, k: int) -> Drafting:
    """The ``k`` best entries of each row of ``scores`` [rows, vocab] (values, indices), read by the host in one
    transfer: both go in one float32 tensor (token ids below 2**24 are exact in float32), a ``HostRead`` the drafting
    loop yields (a batch of requests' are read in one). Returns (values, indices), [rows][k] each."""
    vals, idx = scores.topk(k, dim=-1)  # [rows, k] each, on the device
    both = yield HostRead(torch.stack([vals.float(), idx.float()]))
    return both[0], [[int(i) for i in row] for row in both[1]]


def gumbel_top_k(logq: torch.Tensor, k: int, generator: torch.Generator | None) -> list[int]:
    """Indices of k draws without replacement from softmax(logq), in draw order (Gumbel-top-k).

    Zero-probability entries (-inf) are never drawn: k is capped at the number of finite entries.
    """
    # log q + Gumbel = log q - log E with E ~ Exp(1), drawn on logq's device (from the request's generator)
    noise = torch.empty(logq.shape, dtype=noise_dtype(logq.device), device=logq.device).exponential_(generator=generator)
    keys = logq.to(noise.dtype) - noise.log()
    k = min(k, logq.shape[-1])
    top = keys.topk(k)
    vals, idx = torch.stack([top.values, top.indices.to(noise.dtype)]).tolist()  # one host read
    return [int(i) for v, i in zip(vals, idx) if v != float("-inf")]  # zero-probability tokens are never drawn


def noise_dtype(device: torch.device) -> torch.dtype:
    """float64 for Gumbel keys where the device has it (ties between near-equal keys stay rare), else float32."""
    return torch.float32 if device.type == "mps" else torch.float64


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a <= 0, stable at both ends."""
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def conditional_gumbel(parent_value: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """Stochastic beam search: shift children's perturbed log-probs so their maximum equals the parent's.

    parent_value: [B, 1] perturbed value T of each parent; perturbed: [B, V] phi(child) + Gumbel.
    Returns -log(exp(-T) - exp(-Z) + exp(-G)) with Z = max over the row (Kool et al. 2019, appendix),
    computed as T - softplus(T - G + log(1 - exp(G - Z))). Monotone in G within a row.
    """
    z = perturbed.max(-1, keepdim=True).values
    v = parent_value - perturbed + _log1mexp(perturbed - z)
    softplus = v.clamp(min=0) + torch.log1p(torch.exp(-v.abs()))
    return parent_value - softplus
