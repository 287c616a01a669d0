"""Suffix decoding: draft the most frequent continuations of the longest suffix of the context seen before, from
a suffix trie over the request's own text and, optionally, over earlier requests (SuffixDecoding, arXiv 2411.04975).

``SuffixTrie`` is the structure (a depth-bounded suffix trie with occurrence counts and suffix links, updated one
token at a time), ``SuffixCache`` the cross-request store (a trie over whole earlier requests under a token bound,
oldest evicted first), ``SuffixDrafter`` the drafter (``type: suffix``).
"""
from __future__ import annotations

import heapq
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from metasd.core.decoding.drafter import (Bool, Counterfactual, Drafter, DrafterParams, Float, Int, StepContext,
                                          StepFeedback, check_params, counterfactual_of, register_drafter)
from metasd.core.execution.tree import Draft

from .suffix_trie import ROOT, SuffixCache, SuffixTrie

class SuffixParams(DrafterParams):
    """Pool-config ``params`` of the suffix drafter."""

    mode: Literal["tree", "chain"] = Field("tree", description="a frequency-ranked tree, or the most frequent chain")
    max_match: Int = Field(16, ge=1, description="longest context suffix matched")
    max_depth: Int = Field(8, ge=1, description="deepest draft token")
    max_nodes: Int = Field(16, ge=1, description="tree: most draft nodes")
    spec_factor: Float = Field(1.0, gt=0.0, description="at most spec_factor * match length draft tokens")
    min_prob: Float = Field(0.1, ge=0.0, le=1.0, description="draft a node only if its estimated probability >= this")
    cross_request: Bool = Field(False, description="also match the tokens of earlier requests")
    max_cached_tokens: Int = Field(20_000, ge=1, description="cross_request: cached tokens, oldest evicted")


@register_drafter
class SuffixDrafter(Drafter):
    """Suffix decoding (SuffixDecoding: Oliaro et al., arXiv 2411.04975; vLLM's ``suffix`` method): no model.

    Each step finds the longest suffix of the committed tokens (at most ``max_match`` tokens) that occurred before
    and drafts what followed it, ranked by frequency. The structure is a ``SuffixTrie`` of depth
    ``max_match + max_depth`` over the prompt and the text generated so far, fed incrementally as tokens commit
    (``max_match + max_depth`` node updates per token, independent of the request's length); the match is read
    off the request's frontier (the first node with a continuation, from the longest suffix down:
    ``max_match`` checks).

    From the matched node ``u`` (match length ``L``) a continuation ``v`` of ``u`` gets the estimated probability
    ``P(v) = P(parent) * count[v] / cont[parent]`` (``P(u) = 1``): the product of continuation frequencies
    along its path. A node is drafted only if ``P >= min_prob``; the draft has at most
    ``floor(spec_factor * L)`` tokens (SuffixDecoding's ``max_spec_factor``: longer matches earn longer drafts)
    and is at most ``min(max_depth, ctx.max_depth)`` deep.

    - ``mode: tree``: best-first by ``P`` (ties: the most recent continuation first), at most ``max_nodes``
      nodes; ``P`` falls along a path, so the draft is ancestor-closed and its nodes come in topological order.
    - ``mode: chain``: the most frequent continuation at each level.

    With ``cross_request: true`` the tokens of earlier requests (prompt and output, as far as this drafter saw
    them: up to its last step in the request) are kept in a ``SuffixCache`` of at most ``max_cached_tokens``
    tokens, oldest requests evicted first; the request's text is matched against it incrementally through suffix
    links (amortised O(1) per token). Choice between the two: the longer match wins and a tie goes to the
    request's own text. A tie goes to the request because its own counts describe this very text (its names,
    its repetitions, the verifier's answers to it), undiluted by other requests; a strictly longer cache match
    wins because the match length is the evidence SuffixDecoding scales its drafts by, and a short coincidence
    in the request should not hide a long passage seen before. The cache belongs to this drafter instance and
    lives as long as it does.

    Departures from SuffixDecoding: the trie is not path-compressed (simpler incremental updates and removals,
    at up to ``max_match + max_depth`` nodes per token); the draft comes from the longest match, not from the
    best-scoring of all match lengths; the cross-request store keeps prompts too and is bounded in tokens;
    continuation frequencies divide by the continued occurrences (``cont``), not by all occurrences.

    Drafts carry no probabilities: greedy walk or sample-and-match, exact under sampling for any tree.
    ``Draft.meta``: ``match_len`` (summed per request) and ``from_cache`` (steps drafted from the cache).
    """

    kind = "suffix"
    model_field, checkpoint_field = "never", "never"
    lookup = True
    Params = SuffixParams

    def __init__(self, mode: str = "tree", max_match: int = 16, max_depth: int = 8, max_nodes: int = 16,
                 spec_factor: float = 1.0, min_prob: float = 0.1, cross_request: bool = False,
                 max_cached_tokens: int = 20_000, name: str | None = None):
        super().__init__(name)
        check_params(SuffixParams, dict(mode=mode, max_match=max_match, max_depth=max_depth, max_nodes=max_nodes,
                                        spec_factor=spec_factor, min_prob=min_prob, cross_request=cross_request,
                                        max_cached_tokens=max_cached_tokens), self.name)
        self.mode, self.max_match, self.max_depth, self.max_nodes = mode, max_match, max_depth, max_nodes
        self.spec_factor, self.min_prob = spec_factor, min_prob
        self.cross_request, self.max_cached_tokens = cross_request, max_cached_tokens
        self.trie_depth = max_match + max_depth  # a match of max_match tokens, then max_depth draft tokens
        self.cache = SuffixCache(self.trie_depth, max_cached_tokens) if cross_request else None
        self._reset_request()

    # ------------------------------------------------------------------ per-request state
    def _reset_request(self) -> None:
        self.trie: SuffixTrie | None = None  # built at the first sync of a request
        self._frontier: list[int] = [ROOT]
        self._seen: list[int] = []  # the tokens fed to self.trie, in order
        self._cursor = (ROOT, 0)  # (node, length) in the cache: the longest suffix of _seen it holds, <= max_match
        self._prompt: list[int] = []  # from begin, for the cache when this drafter never drafted
        self._tail: list[int] = []  # committed by this drafter's last step, not fed yet
        self._own = 0  # tokens committed by this drafter's last step (not catch-up when fed next)

    def begin(self, ctx: StepContext) -> None:
        self._reset_request()
        self._prompt = ctx.tokens.tolist()

    def _forked(self, cross_request: bool) -> None:
        """Own request state; the cross-request cache shared with the original (``cross_request``) or left out."""
        if not cross_request:
            self.cache = None
        self._reset_request()

    def end(self) -> None:
        if self.cache is not None:
            tokens = self._seen + self._tail if self._seen else self._prompt
            self.cache.add(tokens)
        self._reset_request()

    def observe(self, feedback: StepFeedback) -> None:
        self._tail = list(feedback.committed)
        self._own = len(feedback.committed)

    def _sync(self, tokens: torch.Tensor | Sequence[int]) -> int:
        """Feed the committed tokens (``tokens``: [T] int64) not in the request's trie yet; return how many.

        Within a request the engine only appends to ``tokens``; a context shorter than the one fed, or whose token at
        the last fed position differs (a new request without ``begin``), starts over. Only that token is compared,
        so the check costs O(1): a different context that agrees there is taken for an extension."""
        n = len(self._seen)
        if self.trie is None or len(tokens) < n or (n and int(tokens[n - 1]) != self._seen[-1]):
            prompt = self._prompt
            self._reset_request()
            self._prompt = prompt
            self.trie, n = SuffixTrie(self.trie_depth), 0
        new = tokens[n:]
        new = new.tolist() if isinstance(new, torch.Tensor) else [int(t) for t in new]
        for t in new:
            self._frontier = self.trie.append(self._frontier, t)
            if self.cache is not None:
                self._advance_cursor(t)
        self._seen.extend(new)
        self._tail = []
        return len(new)

    def _advance_cursor(self, token: int) -> None:
        """Longest suffix of the context in the cache, <= max_match tokens, after appending ``token``."""
        trie, (u, d) = self.cache.trie, self._cursor
        while True:
            if d < self.max_match:
                v = trie.child(u, token)
                if v >= 0:
                    self._cursor = (v, d + 1)
                    return
            if d == 0:
                self._cursor = (ROOT, 0)
                return
            u, d = trie.link[u], d - 1

    # ------------------------------------------------------------------ matching
    def _request_match(self) -> tuple[int, int]:
        """(node, length) of the longest suffix of the request's context that occurred before in it."""
        cont = self.trie.cont
        for d in range(min(self.max_match, len(self._frontier) - 1), 0, -1):
            if cont[self._frontier[d]] > 0:  # cont only falls as the suffix grows: the first hit is the longest
                return self._frontier[d], d
        return ROOT, 0

    def _cache_match(self) -> tuple[int, int]:
        """(node, length) of the longest suffix of the request's context followed by a token in the cache."""
        if self.cache is None:
            return ROOT, 0
        u, d = self._cursor
        cont, link = self.cache.trie.cont, self.cache.trie.link
        while d > 0 and cont[u] == 0:
            u, d = link[u], d - 1
        return u, d

    def _match(self) -> tuple[SuffixTrie | None, int, int]:
        """(trie, node, length) of the match to draft from: the longer one, the request's on a tie."""
        node, length = self._request_match()
        c_node, c_length = self._cache_match()
        if c_length > length:
            return self.cache.trie, c_node, c_length
        return self.trie, node, length

    def longest_match(self, tokens: torch.Tensor | Sequence[int]) -> int:
        """Length of the longest suffix of ``tokens`` ([T] int64, the committed context) that occurred before, in
        the request or (``cross_request``) the cache, at most ``max_match``: a cheap per-step feature. It feeds
        the tokens not seen yet (what ``propose`` would do) and drafts nothing."""
        self._sync(tokens)
        return max(self._request_match()[1], self._cache_match()[1])

    def counterfactual(self, ctx: StepContext, feedback: StepFeedback) -> Counterfactual:
        """Another arm drafted this step: the draft this one would have proposed for the same context, followed
        through the committed tokens (no model: a trie walk). The committed tokens stay this request's last ones for
        the cache, as after a step of its own, but count as catch-up (another arm committed them)."""
        result = counterfactual_of(self.propose(ctx), feedback)
        self._tail, self._own = list(feedback.committed), 0
        return result

    # ------------------------------------------------------------------ drafting
    def propose(self, ctx: StepContext) -> Draft:
        fed = self._sync(ctx.tokens)
        catch_up = max(fed - max(self._own, 1), 0)  # the prompt and tokens other drafters committed
        self._own = 0
        trie, node, length = self._match()
        size = min(int(self.spec_factor * length + 1e-9), self.max_nodes if self.mode == "tree" else self.max_depth)
        depth = min(self.max_depth, ctx.max_depth)
        if size <= 0 or depth <= 0:
            draft = Draft.empty()
        elif self.mode == "chain":
            draft = Draft.chain(self._chain(trie, node, min(size, depth)))
        else:
            tokens, parents = self._tree(trie, node, size, depth)
            draft = Draft(tokens, parents)
        draft.meta = {"match_len": length, "from_cache": trie is not self.trie}
        draft.catch_up = catch_up
        return draft

    def _chain(self, trie: SuffixTrie, node: int, size: int) -> list[int]:
        """The most frequent continuation of ``node``, up to ``size`` tokens, while P >= min_prob."""
        tokens, p = [], 1.0
        while len(tokens) < size:
            ranked = trie.continuations(node)
            if not ranked or p * ranked[0][2] < self.min_prob:
                break
            token, node, freq = ranked[0]
            p *= freq
            tokens.append(token)
        return tokens

    def _tree(self, trie: SuffixTrie, node: int, size: int, depth: int) -> tuple[list[int], list[int]]:
        """Best-first by P: the ``size`` most probable continuations of ``node`` (P >= min_prob, depth <= ``depth``)."""
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, int, int, int]] = []
        order = 0  # insertion order: the last tie-break, so heap entries never compare nodes

        def push(u: int, p_u: float, index: int, level: int) -> None:
            nonlocal order
            for token, v, freq in trie.continuations(u):
                # (-P, -recency, order, node, token, parent index, depth)
                heapq.heappush(heap, (-p_u * freq, -trie.last[v], order, v, token, index, level + 1))
                order += 1

        push(node, 1.0, -1, 0)
        while heap and len(tokens) < size:
            neg_p, _, _, v, token, parent, level = heapq.heappop(heap)
            if -neg_p < self.min_prob:
                break  # every node left is at most as probable
            tokens.append(token)
            parents.append(parent)
            if level < depth:
                push(v, -neg_p, len(tokens) - 1, level)
        return tokens, parents

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": self.mode, "max_match": self.max_match, "max_depth": self.max_depth,
                "max_nodes": self.max_nodes, "spec_factor": self.spec_factor, "min_prob": self.min_prob,
                "cross_request": self.cross_request, "max_cached_tokens": self.max_cached_tokens}
