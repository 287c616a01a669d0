"""One request's grammar state: the committed tokens' parse, and the allowed-token masks after the committed prefix
and after every path of a draft tree (``ConstraintState.tree_masks``).

Lossless structured speculative decoding masks the verifier's distribution at every tree node with the grammar
state of that node's own path: row i+1 of the verifier's output is masked with the mask after root -> node i. A
depth-first walk of the tree consumes a node's token on entry and rolls it back on exit (llguidance's ``rollback``),
so a tree of n nodes costs one consume and one mask per reachable node, never a re-parse from the start.

End-of-sequence tokens are checked against the mask but never given to llguidance's matcher: rolling back an
end-of-sequence token it consumed undoes one token too many (llguidance 1.9: ``consume_token(eos)`` then
``rollback(1)`` leaves the state before the last text token), and ``try_consume_tokens`` refuses it. This state
keeps "ended" itself; after an end-of-sequence token only end-of-sequence tokens are allowed.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from .masking import unpack_bitmask


class ConstraintViolation(ValueError):
    """Tokens committed against the grammar: ``tokens[index]`` (= ``token``) is not allowed after what precedes it.
    Under a lossless engine that masks the verifier this is a bug, never a property of the model."""

    def __init__(self, index: int, token: int, reason: str):
        super().__init__(f"token {token} (index {index} of the tokens committed together) {reason}")
        self.index = index
        self.token = token
        self.reason = reason


def _token_ids(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist()
    try:
        ids = [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must be integers, got {list(values)[:8]!r}") from None
    return ids


class ConstraintState:
    """The grammar state of one request (``CompiledConstraint.new_state()``).

    ``accept_tokens`` commits tokens (all or none); ``mask``, ``eos_allowed``, ``is_complete`` and
    ``is_terminated`` read the committed state; ``tree_masks`` gives the masks along every path of a draft tree and
    leaves the committed state as it found it. Not thread-safe: one request's step at a time.
    """

    def __init__(self, compiled: Any, _matcher: Any = None):
        """``compiled``: the ``CompiledConstraint`` (compiler.py) this state follows; ``_matcher``: the llguidance
        matcher to wrap (default a fresh one from ``compiled``)."""
        self.compiled = compiled
        self._matcher = compiled.new_matcher() if _matcher is None else _matcher
        self._eos = frozenset(compiled.eos_token_ids)
        self._committed = 0
        self._terminated = False

    @property
    def vocab_size(self) -> int:
        """The token ids the grammar knows (the tokenizer's); wider masks disallow the rest."""
        return self.compiled.vocab_size

    @property
    def num_committed(self) -> int:
        """How many tokens have been committed."""
        return self._committed

    def fork(self) -> "ConstraintState":
        """An independent copy of this state (a copy of the matcher: microseconds)."""
        other = ConstraintState(self.compiled, self._matcher.deep_copy())
        other._committed, other._terminated = self._committed, self._terminated
        return other

    # ------------------------------------------------------------------------------------------------------------
    # The committed prefix

    def accept_tokens(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """Commit ``tokens`` (the accepted path and the bonus token of a step, in order): all of them, or none and
        ``ConstraintViolation`` naming the first one the grammar does not allow. An end-of-sequence token is
        allowed exactly where the text is complete, and commits ``is_terminated()``; after it only more
        end-of-sequence tokens are allowed."""
        ids = _token_ids(tokens, "tokens")
        for k, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ConstraintViolation(k, t, f"is outside the tokenizer's {self.vocab_size} ids")
        if not ids:
            return
        consumed, terminated = 0, self._terminated  # end-of-sequence tokens are not given to the matcher (module doc)
        for k, t in enumerate(ids):
            if t in self._eos and (terminated or self._matcher.is_accepting()):
                terminated = True
            elif not terminated and self._matcher.try_consume_tokens([t]) == 1:
                consumed += 1
            else:
                if consumed:
                    self._matcher.rollback(consumed)
                where = "after an end-of-sequence token" if terminated else "after the tokens before it"
                raise ConstraintViolation(k, t, f"is not allowed by the grammar {where}")
        self._committed += len(ids)
        self._terminated = terminated

    def eos_allowed(self) -> bool:
        """Whether an end-of-sequence token may be committed now (the text so far is complete)."""
        return self._terminated or bool(self._matcher.is_accepting())

    def is_complete(self) -> bool:
        """Whether the text is complete and cannot go on: nothing but an end-of-sequence token may follow (e.g. a
        JSON object's closing brace). The engine may end the request here without asking the model."""
        return self._terminated or bool(self._matcher.is_stopped())

    def is_terminated(self) -> bool:
        """Whether an end-of-sequence token has been committed."""
        return self._terminated

    def mask_bits(self) -> torch.Tensor:
        """The packed allowed-token mask after the committed prefix: int32 [words] (``unpack_bitmask``)."""
        bits = torch.zeros((1, self.compiled.words), dtype=torch.int32)  # [1, words]
        self._fill(bits, 0, self._terminated)
        return bits[0]

    def mask(self, vocab: int) -> torch.Tensor:
        """The allowed-token mask after the committed prefix: bool [vocab] (ids past the tokenizer's are False)."""
        return unpack_bitmask(self.mask_bits(), vocab)

    # ------------------------------------------------------------------------------------------------------------
    # A draft tree

    def tree_masks(self, parents: Sequence[int] | torch.Tensor, tokens: Sequence[int] | torch.Tensor,
                   vocab: int) -> torch.Tensor:
        """The allowed-token masks along every path of a draft tree: bool [n+1, vocab].

        The draft has n nodes; node i has parent ``parents[i]`` (-1 = the root, the committed prefix; else
        ``parents[i] < i``) and token ``tokens[i]``. Row 0 is the mask after the committed prefix (``mask(vocab)``);
        row i+1 the mask after the path root -> node i, i.e. what ``mask`` would say after committing that path.

        Unreachable nodes: node i is reachable when its token is allowed in its parent's row and its parent is
        reachable (the root always is). The row of an unreachable node is ALL FALSE, and so are the rows of all
        its descendants (unreachable too). Such a node has probability 0 under its parent's masked row, so no exact
        acceptance rule (greedy, sample-and-match, rejection sampling) can accept it and its row is never read; all
        False rather than all True means a row read by mistake cannot let a token break the grammar (masked logits
        all -inf, softmax NaN). Every reachable row allows at least one token: after an end-of-sequence token on the
        path (or committed), the row allows exactly the end-of-sequence tokens, so a bonus drawn there is one.
        ``reachable_nodes(masks, parents, tokens)`` lists the reachable nodes; the masks depend only on the draft,
        so they can be computed before the verifier's forward (and unreachable nodes pruned from it).

        Cost: per reachable node, a copy of its parent's matcher (microseconds), one consume and one mask computation;
        the committed state is never changed (no rollback: see ``tree_bitmask``).
        """
        return unpack_bitmask(self.tree_bitmask(parents, tokens), vocab)

    def tree_bitmask(self, parents: Sequence[int] | torch.Tensor,
                     tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``tree_masks`` packed: int32 [n+1, words] (``unpack_bitmask`` gives the booleans), rows of unreachable
        nodes all zero."""
        parents_l, tokens_l = _check_tree(parents, tokens)
        n = len(tokens_l)
        bits = torch.zeros((n + 1, self.compiled.words), dtype=torch.int32)  # [n+1, words], 0 bits = disallowed
        view = bits.numpy()  # the same memory: bit tests without tensor indexing
        self._fill(bits, 0, self._terminated)
        # each reachable node's own matcher: a copy of its parent's that consumed its token. Never consume and roll
        # back one matcher: llguidance 1.9.1 computing a mask between consuming and rolling back can leave the
        # matcher wrong for later tokens (the committed text's next mask then differs from a replay's)
        matchers: list[Any] = [self._matcher] + [None] * n  # matchers[r]: the state after row r's path
        ended = [self._terminated] + [False] * n  # ended[r]: row r's path holds an end-of-sequence token
        vocab = self.vocab_size
        for i, (p, t) in enumerate(zip(parents_l, tokens_l)):
            row = p + 1
            if t >= vocab or not (int(view[row, t >> 5]) >> (t & 31)) & 1:
                continue  # unreachable (an unreachable parent's row is all zero): its row and its subtree's stay so
            if t in self._eos:  # the text ends here (after an ended row only EOS is allowed): nothing to consume
                matchers[i + 1], ended[i + 1] = matchers[row], True
            else:
                child = matchers[row].deep_copy()
                if child.try_consume_tokens([t]) != 1:
                    continue  # the mask allowed it, so this does not happen; if it did, the node is unreachable
                matchers[i + 1] = child
            self._fill(bits, i + 1, ended[i + 1], matchers[i + 1])
        return bits

    def _fill(self, bits: torch.Tensor, row: int, ended: bool, matcher: Any = None) -> None:
        """Write into ``bits[row]`` (int32 [words], contiguous) the mask after ``matcher``'s tokens (default: the
        committed ones), or after an end-of-sequence token when ``ended`` (the end-of-sequence tokens only)."""
        target = bits[row]
        if ended:
            target.copy_(self.compiled.eos_bits)
            return
        matcher = self._matcher if matcher is None else matcher
        matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        words = target.numpy()
        for t in self.compiled.special_ids:  # allowed by its text, refused as a token: out (CompiledConstraint)
            if (int(words[t >> 5]) >> (t & 31)) & 1 and matcher.validate_tokens([t]) != 1:
                words[t >> 5] &= ~(1 << (t & 31)) if (t & 31) != 31 else 0x7FFFFFFF

    def __repr__(self) -> str:
        return (f"ConstraintState({self.compiled.spec!r}, committed={self._committed}, "
                f"complete={self.is_complete()}, terminated={self._terminated})")


def _check_tree(parents: Sequence[int] | torch.Tensor,
                tokens: Sequence[int] | torch.Tensor) -> tuple[list[int], list[int]]:
    parents_l, tokens_l = _token_ids(parents, "parents"), _token_ids(tokens, "tokens")
    if len(parents_l) != len(tokens_l):
        raise ValueError(f"a draft needs one parent per token: {len(parents_l)} parents, {len(tokens_l)} tokens")
    for i, (p, t) in enumerate(zip(parents_l, tokens_l)):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a node's parent must be -1 (the root) or an earlier node")
        if t < 0:
            raise ValueError(f"tokens[{i}] = {t}: token ids are >= 0")
    return parents_l, tokens_l
