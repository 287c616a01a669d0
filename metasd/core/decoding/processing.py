"""What a request does to the verifier's logits before acceptance, row by row along each draft node's own path: the
grammar mask of structured output (metasd/core/constraints), ``allowed_token_ids`` (every other token masked),
``bad_words`` (the token completing a banned sequence masked, bad_words.py), the end-of-sequence tokens masked before
``min_tokens`` new tokens, the logit bias (a fixed amount added to chosen tokens' logits at every position), then the
penalties (penalties.py) - vLLM's order. Temperature, top-k, top-p and min-p follow (sampling.py). Each depends only
on the tokens before the row's position - the committed ones and the node's ancestors - so acceptance stays exact:
the output is plain decoding's with the same processing (docs/algorithms.md#lossless-acceptance)."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..constraints import ConstraintError, ConstraintState, DraftGuide, apply_mask
from ..execution.tree import Draft
from .bad_words import BadWords
from .penalties import PathPenalizer
from .vocab_row import VocabRow


def check_logit_bias(bias: Mapping[int, float] | None, verifier) -> dict[int, float] | None:
    """A request's ``logit_bias`` ({token id: amount added to its logit}, OpenAI's range [-100, 100]) checked against
    the ``verifier``'s vocabulary (where its model's config gives one): ``ValueError`` naming the field; None or
    empty: no bias."""
    if not bias:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    check_token_ids(list(bias), verifier, "logit_bias")
    for token, amount in bias.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got {amount!r}")
    return {token: float(amount) for token, amount in bias.items()}


def check_token_ids(ids: Sequence[int] | None, verifier, field: str) -> frozenset[int]:
    """A request's token ids (``stop_token_ids``, ``allowed_token_ids``, ``logit_bias``'s keys) checked against the
    ``verifier``'s vocabulary, where its model's config gives one: ``ValueError`` naming ``field``."""
    if ids is None:
        return frozenset()
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise ValueError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    vocab_size = getattr(getattr(getattr(verifier, "model", None), "config", None), "vocab_size", None)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
            raise ValueError(f"{field}: token id {t!r} is outside the vocabulary (0..{(vocab_size or 0) - 1})")
    return frozenset(ids)


class PathProcessing:
    """One request's grammar state, logit bias and penalty counts; ``apply`` processes a draft's rows, ``commit``
    records the tokens a step committed. Built only when the request has one of them (``for_request``)."""

    def __init__(self, grammar: ConstraintState | None, penalizer: PathPenalizer | None,
                 bias: Mapping[int, float] | None = None, min_tokens: int = 0, eos: Sequence[int] = (),
                 allowed: Sequence[int] | None = None, bad_words: BadWords | None = None):
        self.grammar, self.penalizer, self.bad_words = grammar, penalizer, bad_words
        # vLLM's allowed_token_ids: every other token masked; the bias: added to its tokens' logits
        self.allowed = VocabRow(dict.fromkeys(allowed, True), False, torch.bool) if allowed else None
        self.bias = VocabRow(bias) if bias else None
        #: vLLM's min_tokens: the end-of-sequence tokens are masked where fewer new tokens come before the row's
        self.min_tokens, self.eos, self.generated = min_tokens, sorted(eos), 0

    @classmethod
    def for_request(cls, request) -> "PathProcessing | None":
        """A ``Request``'s processing (its ``constraint``, ``penalties`` over its ``prompt_ids``, ``logit_bias``,
        ``min_tokens``, ``allowed_token_ids``, ``bad_words``); None when it has none of them."""
        grammar = request.constraint.new_state() if request.constraint is not None else None
        penalizer = None if request.penalties.off else PathPenalizer(request.penalties, request.prompt_ids)
        eos = request.eos if request.min_tokens else ()
        bad_words = BadWords(request.bad_words) if request.bad_words else None
        if (grammar is None and penalizer is None and not request.logit_bias and not eos and not request.allowed_ids
                and bad_words is None):
            return None
        return cls(grammar, penalizer, request.logit_bias, request.min_tokens, eos, request.allowed_ids, bad_words)

    def apply(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """logits: [n+1, vocab] the verifier's raw rows (row 0 after the pending token, row i+1 after node i);
        returns the processed rows (a new tensor). A node the grammar does not allow under its parent has an all
        -inf row (never read: no rule accepts a node of probability 0). ``ConstraintError`` naming the field where
        row 0 is left no token."""
        if self.grammar is not None:
            masks = self.grammar.tree_masks(draft.parents, draft.tokens, logits.shape[-1])  # [n+1, vocab] bool
            if not bool(masks[0].any()):  # a dead end: nothing to sample (softmax of all -inf is NaN)
                raise ConstraintError("grammar", "allows no token of this tokenizer after the text so far (text it "
                                                 "asks for may exist only as a special token, which a grammar must "
                                                 "name as a token: <tool_call>, not \"<tool_call>\")")
            logits = apply_mask(logits.float(), masks)
        return self.along(logits, draft.paths(), check=True)

    @property
    def for_drafters(self) -> bool:
        """Whether model drafters process their rows with it (``DraftProcessing``): where it has a grammar, allowed
        ids, bad words, ``min_tokens`` or a bias - not for penalties alone, which drafters leave out."""
        return bool(self.grammar is not None or self.allowed is not None or self.bad_words is not None or self.eos
                    or self.bias is not None)

    def along(self, logits: torch.Tensor, paths: Sequence[Sequence[int]], check: bool = False,
              penalties: bool = True) -> torch.Tensor:
        """Everything but the grammar, on rows after the committed tokens then ``paths[r]`` (logits: [rows, vocab],
        the verifier's or a drafter's): the allowed ids, the bad words, the end-of-sequence tokens before
        ``min_tokens``, the bias, then the penalties where ``penalties``. ``check``: ``ConstraintError`` naming the
        field that leaves row 0 no token (the verifier's rows)."""
        def left_nothing(field: str, why: str) -> None:
            if check and not bool(torch.isfinite(logits[0]).any()):
                raise ConstraintError(field, why)
        if self.allowed is not None:  # the same at every position
            logits = logits.float().masked_fill(~self.allowed.like(logits), float("-inf"))  # [rows, vocab]
            left_nothing("allowed_token_ids", "leaves no token the grammar allows after the text so far")
        if self.bad_words is not None:
            logits = self.bad_words.apply(logits, paths)  # [rows, vocab]
            left_nothing("bad_words", "ban every token the request may still generate here")
        if self.eos and self.generated < self.min_tokens:  # row r is new token number generated + len(path) + 1
            early = [r for r, path in enumerate(paths) if self.generated + len(path) < self.min_tokens]
            eos = [t for t in self.eos if t < logits.shape[-1]]
            if early and eos:
                logits = logits.float().clone()
                logits[torch.tensor(early, device=logits.device)[:, None], torch.tensor(eos, device=logits.device)] \
                    = float("-inf")  # [rows, vocab]
        if self.bias is not None:  # the same at every position: each row gets it whatever its path
            logits = logits.float() + self.bias.like(logits)  # [rows, vocab]
        if self.penalizer is not None and penalties:
            logits = self.penalizer.apply(logits, paths)
        return logits

    def ended(self, eos: set[int]) -> bool:
        """Whether the grammar is complete (nothing may follow but an end-of-sequence token) while the model has no
        end-of-sequence token to end with: the request must end here."""
        return self.grammar is not None and not eos and self.grammar.is_complete()

    def commit(self, tokens: Sequence[int]) -> None:
        self.generated += len(tokens)
        if self.bad_words is not None:
            self.bad_words.commit(tokens)
        if self.grammar is not None:
            self.grammar.accept_tokens(tokens)
        if self.penalizer is not None:
            self.penalizer.commit(tokens)


class DraftProcessing:
    """A request's processing along a draft a model drafter grows: each row of the drafter's logits processed as the
    verifier's row at the same node will be (``PathProcessing``; the grammar by ``DraftGuide``) - all but the
    penalties - so its drafts go where the processed verifier goes. ``add(node, parent, token)`` records a node (-1:
    the root, the committed text); ``mask(nodes, logits)`` processes the rows after those nodes; ``expandable(node)``
    says whether drafting below a node can help.

    Processing the drafter changes only what it proposes, never what is accepted: the verifier's rows are processed
    anyway, and a sampled draft carries the processed ``q`` it was drawn from, which the acceptance rules use as
    they use any ``q``. What it buys is acceptance: a drafter that does not know a ban or a bias spends its draft on
    tokens the processed verifier gives probability 0, or little. The penalties are left out: applied to the default
    pool's drafter they flattened its probabilities (a repetition penalty divides the logits of every token already
    seen), so its confidence-grown trees stopped sooner and lost more acceptance than the penalised picks won
    (BENCHMARKS.md, "What the drafters' own processing buys").
    """

    def __init__(self, processing: PathProcessing):
        self.processing = processing
        self.grammar = DraftGuide(processing.grammar) if processing.grammar is not None else None
        self._paths: dict[int, list[int]] = {-1: []}  # node -> the draft tokens up to it

    def add(self, node: int, parent: int, token: int) -> None:
        self._paths[node] = self._paths[parent] + [token]
        if self.grammar is not None:
            self.grammar.add(node, parent, token)

    def expandable(self, node: int) -> bool:
        """Whether drafting below ``node`` can help: not below a token outside the grammar or an end-of-sequence
        token (``DraftGuide.expandable``)."""
        return self.grammar is None or self.grammar.expandable(node)

    def mask(self, nodes: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """logits: [len(nodes), vocab] a drafter's raw logits after each node -> its processed rows, on their
        device. A row the processing leaves no token (allowed ids all past a narrow head, or all banned after the
        node) keeps its unprocessed values: no sampling reads a row of nothing (NaN), and the verifier rejects what
        it must."""
        if self.grammar is not None:
            logits = self.grammar.mask(nodes, logits)  # [len(nodes), vocab]
        out = self.processing.along(logits, [self._paths[n] for n in nodes], penalties=False)
        if self.processing.allowed is None:  # only the allowed ids can leave a row of this vocabulary empty
            return out
        emptied = ~torch.isfinite(out).any(-1, keepdim=True) & torch.isfinite(logits).any(-1, keepdim=True)
        return torch.where(emptied, logits.float(), out)
