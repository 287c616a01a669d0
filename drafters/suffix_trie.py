"""The suffix drafter's structures (``metasd.drafters.suffix``): ``SuffixTrie``, a depth-bounded suffix trie with
occurrence counts and suffix links updated one token at a time, and ``SuffixCache``, a trie over whole earlier requests
under a token bound, oldest evicted first."""
from __future__ import annotations

from array import array
from collections import deque
from typing import Iterable, Sequence

ROOT = 0  # the root's node id in every SuffixTrie: the empty string


class SuffixTrie:
    """A depth-bounded suffix trie with occurrence counts over a set of token sequences.

    Node ``u`` spells a string ``s(u)`` of at most ``depth`` tokens (the root spells the empty string). For every
    sequence ``x`` in the set and every end position ``j``, each suffix of ``x[:j + 1]`` of at most ``depth``
    tokens is a node, so every substring of at most ``depth`` tokens is one. Per node:

    - ``count[u]``: the (sequence, end position) pairs where ``s(u)`` ends (its occurrences);
    - ``cont[u]``: the sum of its children's counts: the occurrences followed by another token inside the depth
      bound, so ``count[v] / cont[u]`` is how often child ``v = s(u)+[t]`` follows ``s(u)`` (its continuation
      frequency). Below the deepest level ``cont[u] > 0`` exactly when ``s(u)`` occurs before a sequence's end;
    - ``link[u]``: the node of ``s(u)`` without its first token (a suffix link: the trie holds every suffix of
      each of its strings, so that node exists);
    - ``last[u]``: a stamp of the latest append that ended at ``u`` (ranks equally frequent continuations,
      the recent one first).

    A growing sequence is represented by its *frontier*: ``[root, node of its last token, node of its last two
    tokens, ...]``, up to ``depth - 1`` tokens. ``append`` moves each frontier node to its child for the new
    token (creating it when missing): ``depth`` dictionary operations per token, whatever the sequence's length.
    Once a child is missing, a string new to the trie, every longer one is new too: the rest of the frontier gets its
    children together, without a lookup each (``_new_leaves``: new text costs a column write per node).
    ``remove`` replays a sequence and takes its counts back, freeing the nodes whose count falls to zero; the
    result equals a trie built over the remaining sequences (with the same node count; ``last`` stamps may still
    name the removed occurrences). Memory: at most ``depth`` new nodes per appended token (about ``depth`` per
    token on text that does not repeat, far fewer on text that does).

    Nodes are integer ids into flat arrays (a freed id is reused). Most nodes have one child (a string seen once
    continues one way), so a node's first child sits in two arrays (``tok1``, ``kid1``) and only its further
    children in a ``{token: id}`` dict (``more``): about 60 bytes per node instead of about 280 with a dict each.
    Arrays and dicts of ints are not tracked by Python's garbage collector, so a large trie adds no collection
    pauses.
    """

    def __init__(self, depth: int):
        if depth < 1:
            raise ValueError(f"SuffixTrie: depth must be >= 1, got {depth}")
        self.depth = depth
        self.tok1 = array("q", [-1])  # token of the first child, -1: no child
        self.kid1 = array("q", [-1])  # the first child
        self.more: list[dict[int, int] | None] = [None]  # the other children: {token: id}
        self.count = array("q", [0])
        self.cont = array("q", [0])
        self.link = array("q", [ROOT])
        self.last = array("q", [0])
        self.n_nodes = 1  # live nodes, root included
        self._free: list[int] = []
        self._stamp = 0

    def child(self, node: int, token: int) -> int:
        """The child of ``node`` for ``token``, -1 when there is none."""
        if self.tok1[node] == token:
            return self.kid1[node]
        more = self.more[node]
        return -1 if more is None else more.get(token, -1)

    def children(self, node: int) -> list[tuple[int, int]]:
        """``(token, child)`` for every child of ``node``."""
        if self.tok1[node] < 0:
            return []
        first = [(self.tok1[node], self.kid1[node])]
        more = self.more[node]
        return first if more is None else first + list(more.items())

    def _new_node(self, parent: int, token: int, link: int) -> int:
        if self._free:
            v = self._free.pop()
            self.link[v] = link
        else:
            v = len(self.more)
            self.tok1.append(-1)
            self.kid1.append(-1)
            self.more.append(None)
            self.count.append(0)
            self.cont.append(0)
            self.last.append(0)
            self.link.append(link)
        if self.tok1[parent] < 0:
            self.tok1[parent], self.kid1[parent] = token, v
        else:
            more = self.more[parent]
            if more is None:
                more = self.more[parent] = {}
            more[token] = v
        self.n_nodes += 1
        return v

    def _unlink(self, parent: int, token: int) -> None:
        """Drop ``parent``'s child for ``token`` (another child, if any, takes the first slot)."""
        more = self.more[parent]
        if self.tok1[parent] == token:
            if more:
                self.tok1[parent], self.kid1[parent] = more.popitem()
            else:
                self.tok1[parent] = self.kid1[parent] = -1
        else:
            del more[token]
        if more is not None and not more:
            self.more[parent] = None

    def append(self, frontier: list[int], token: int) -> list[int]:
        """Append ``token`` to the sequence whose frontier is ``frontier``; return its new frontier."""
        self._stamp += 1
        stamp, new = self._stamp, [ROOT]
        tok1, kid1, more, count, cont, last = self.tok1, self.kid1, self.more, self.count, self.cont, self.last
        for d, u in enumerate(frontier):  # u spells the last d tokens: its child spells the last d + 1
            if tok1[u] == token:  # ``child``, inlined: this loop runs up to ``depth`` times for each token fed
                v = kid1[u]
            else:
                kids = more[u]
                v = -1 if kids is None else kids.get(token, -1)
                if v < 0:  # s(u) + token never occurred, so no longer string ending with it did: all new
                    self._new_leaves(frontier[d:], token, new)
                    break
            count[v] += 1
            cont[u] += 1
            last[v] = stamp
            new.append(v)
        if len(new) > self.depth:  # the node of the last `depth` tokens is counted, never extended
            new.pop()
        return new

    def _new_leaves(self, parents: list[int], token: int, new: list[int]) -> None:
        """A child for ``token`` under each of ``parents`` (the rest of a frontier, shortest string first), each
        occurring once now; each one's suffix link is ``new``'s last node, and it is appended to ``new`` in turn.
        Without freed ids to reuse, the new nodes are consecutive ids, written column by column."""
        stamp, k = self._stamp, len(parents)
        if self._free:
            for u in parents:
                v = self._new_node(u, token, new[-1])
                self.count[v], self.last[v] = 1, stamp
                self.cont[u] += 1
                new.append(v)
            return
        v0 = len(self.more)
        for column, value in ((self.tok1, -1), (self.kid1, -1), (self.count, 1), (self.cont, 0), (self.last, stamp)):
            column.extend([value] * k)
        self.more.extend([None] * k)
        self.link.append(new[-1])
        self.link.extend(range(v0, v0 + k - 1))  # v0 + i + 1: v0 + i's string with one more token in front
        tok1, kid1, more, cont = self.tok1, self.kid1, self.more, self.cont
        for v, u in enumerate(parents, v0):
            cont[u] += 1
            if tok1[u] < 0:
                tok1[u], kid1[u] = token, v
            else:
                kids = more[u]
                if kids is None:
                    kids = more[u] = {}
                kids[token] = v
        self.n_nodes += k
        new.extend(range(v0, v0 + k))

    def extend(self, tokens: Iterable[int], frontier: list[int] | None = None) -> list[int]:
        """Append every token of ``tokens`` (to a new sequence, or to the one of ``frontier``); return the frontier."""
        frontier = [ROOT] if frontier is None else frontier
        for t in tokens:
            frontier = self.append(frontier, int(t))
        return frontier

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence added before (``extend``): the same counts, in the same order; free dead nodes.

        A node may reach zero while a longer string through it still counts (its own end comes later in the
        replay), so nodes are freed only once the whole sequence is replayed."""
        frontier, dead = [ROOT], []
        for t in tokens:
            new = [ROOT]
            for u in frontier:
                v = self.child(u, int(t))
                if v < 0:
                    raise KeyError(f"SuffixTrie.remove: the sequence was never added (no child {int(t)})")
                self.count[v] -= 1
                self.cont[u] -= 1
                if self.count[v] == 0:
                    dead.append((u, int(t), v))
                new.append(v)
            if len(new) > self.depth:
                new.pop()
            frontier = new
        for u, t, v in dead:
            if u == ROOT or self.count[u] > 0:  # a dead parent loses all its children anyway
                self._unlink(u, t)
        for _, _, v in dead:
            self.tok1[v] = self.kid1[v] = -1
            self.more[v] = None
            self.cont[v] = self.last[v] = 0
            self.link[v] = ROOT
            self._free.append(v)
        self.n_nodes -= len(dead)

    def continuations(self, node: int) -> list[tuple[int, int, float]]:
        """``(token, child, frequency)`` for each continuation of ``node``, most frequent (then most recent) first."""
        total = self.cont[node]
        if total == 0:
            return []
        ranked = sorted(self.children(node), key=lambda kv: (self.count[kv[1]], self.last[kv[1]]), reverse=True)
        return [(t, v, self.count[v] / total) for t, v in ranked]

    def as_dict(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """Every node but the root as ``{string: (count, cont)}`` (for tests and debugging)."""
        out: dict[tuple[int, ...], tuple[int, int]] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
        while stack:
            u, s = stack.pop()
            for t, v in self.children(u):
                out[s + (t,)] = (self.count[v], self.cont[v])
                stack.append((v, s + (t,)))
        return out


class SuffixCache:
    """Earlier requests (prompt and output) in one ``SuffixTrie``, holding at most ``max_tokens`` tokens: a new
    request first evicts the oldest ones until it fits (a request longer than the bound keeps its last
    ``max_tokens`` tokens), so the trie never holds more than ``max_tokens`` tokens, nor more than
    ``depth * max_tokens + 1`` nodes."""

    def __init__(self, depth: int, max_tokens: int):
        self.trie = SuffixTrie(depth)
        self.max_tokens = max_tokens
        self.requests: deque[list[int]] = deque()
        self.n_tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens][-self.max_tokens:]
        if not tokens:
            return
        while self.requests and self.n_tokens + len(tokens) > self.max_tokens:
            old = self.requests.popleft()
            self.trie.remove(old)
            self.n_tokens -= len(old)
        self.trie.extend(tokens)
        self.requests.append(tokens)
        self.n_tokens += len(tokens)
