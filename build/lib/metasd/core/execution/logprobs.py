"""Log-probabilities of the tokens a request commits (and, when asked, of its prompt), from the verifier's own logits.

They are the model's raw log-probabilities - ``log_softmax`` of the verifier's logits before temperature, top-k or
top-p, as vLLM returns by default - so they do not depend on how the token was chosen: a committed token's row is the
verifier's distribution after the same prefix whether the token came from plain decoding or was accepted from a draft.
With a draft of n nodes (``metasd.core.execution.tree``), the verifier's logits are [n+1, vocab]: row 0 after the
pending token, row i+1 after node i. A step that accepts the path (a_1, ..., a_k) and a bonus token commits k+1 tokens,
scored by rows 0, a_1+1, ..., a_k+1 (``committed_rows``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

#: the most alternatives a request may ask for per token (vLLM's default ``max_logprobs``)
MAX_TOP_LOGPROBS = 20
#: prompt positions scored per forward when a request asks for its prompt's log-probabilities: the logits of a
#: chunk are [chunk, vocab] (~150 MB in float32 for a 151k vocabulary at 256), not [prompt, vocab]
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class TokenLogprob:
    """One token's raw log-probability under the verifier and the ``top`` most likely tokens at its position,
    as (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    #: the token's rank among the position's tokens (1: the most likely; ties share the better rank), as vLLM's
    rank: int | None = None


def check_logprobs(value, name: str = "logprobs") -> int | None:
    """``value`` checked: None (no log-probabilities) or the number of alternatives per token, 0..MAX_TOP_LOGPROBS."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {value!r}")
    return value


def committed_rows(path: Sequence[int]) -> list[int]:
    """The verifier's logit rows that scored a step's committed tokens: row 0, then each accepted node's row."""
    return [0] + [int(node) + 1 for node in path]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` under row i of ``logits`` and, with ``top`` > 0, row i's ``top`` most
    likely tokens. One read to the host for the whole block.

    logits: [len(tokens), vocab] raw logits (any dtype; the softmax is taken in float32)."""
    if len(tokens) == 0:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [m, vocab]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])  # [m, 1]
    ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()  # [m]
    chosen = chosen[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(int(t), float(lp), rank=int(r)) for t, lp, r in zip(tokens, chosen, ranks)]
    values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)  # [m, top] each
    values, indices = values.tolist(), indices.tolist()
    return [TokenLogprob(int(t), float(lp), list(zip(ix, vs)), int(r))
            for t, lp, ix, vs, r in zip(tokens, chosen, indices, values, ranks)]


def step_logprobs(logits: torch.Tensor, path: Sequence[int], committed: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of one step's committed tokens (those it kept: a stop may end the step early).

    logits: [n+1, vocab] the verifier's raw logits over [pending] + the draft; path: the accepted nodes, root to leaf."""
    rows = committed_rows(path)[: len(committed)]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return token_logprobs(logits.index_select(0, index), committed, top)
