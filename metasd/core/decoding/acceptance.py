"""Lossless acceptance rules (docs/algorithms.md#lossless-acceptance).

Conventions, for a draft of n nodes (see ``metasd.core.execution.tree``):
  p: [n+1, vocab] processed verifier probabilities. Row 0 is the verifier's distribution after the last
     committed token (the root); row i+1 is its distribution after draft node i. So the target
     distribution for node i is ``p[parents[i] + 1]``.
  q: [n, vocab] processed drafter probabilities; row i is the distribution node i was drawn from.
Every rule returns an ``Acceptance``: the accepted nodes (root to leaf) and the bonus token, which is
the correction at the first rejection or the free token after the last accepted node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..execution.host_read import read_together
from ..execution.tree import DeviceTokens, Draft
from ..execution.verifier import VerifierOutput
from .sampling import KeyedNoise, fit_vocab, sample


@dataclass
class Acceptance:
    """Outcome of verifying one draft."""

    path: list[int]  # accepted node indices, root to leaf
    bonus: int  # token appended after the path

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def accept_greedy(draft: Draft, target_argmax: torch.Tensor, read: list[int] | None = None) -> Acceptance:
    """Greedy: follow the child whose token equals the verifier's argmax.

    target_argmax: [n+1] argmax of the verifier logits per row, on the verifier's device: read with the draft's
    tokens where those are still on it (one host read for both); read: its values, read already (``read_choices``).
    """
    return _walk(draft, (read if read is not None else draft.read_with(target_argmax)).__getitem__)


def read_choices(outs: Sequence[VerifierOutput], drafts: Sequence[Draft]) -> None:
    """The greedy choices of a batched verification (``VerifierOutput.choices``, [n_b+1] each on the verifier's
    device) and the tokens of the drafts still on that device, read by the host in ONE transfer: a scheduler's step
    reads the device once for all its requests. Sets each ``choices_read``; each draft's tokens are then on the host
    (``Draft.tokens`` reads nothing more). A request whose logits are processed (a grammar, penalties) takes its own
    choices instead."""
    parts: list[torch.Tensor] = []  # [n_b+1] choices, then the draft's unread tokens, per row that has choices
    owners: list[tuple[VerifierOutput, DeviceTokens | None]] = []
    for out, draft in zip(outs, drafts):
        if out.choices is None:
            continue
        unread = draft.unread_on(out.choices.device)
        parts += [out.choices] + ([unread.values] if unread is not None else [])
        owners.append((out, unread))
    if not parts:
        return
    values = iter(read_together(parts))
    for out, unread in owners:
        out.choices_read = next(values)
        if unread is not None:
            unread.fill(next(values))


def accept_match(draft: Draft, p: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
    """Sample-and-match, exact for any draft (chain or tree) whatever produced it.

    At the current node draw y ~ p(row); move to the child whose token is y, if any; else y is the bonus.

    On the host each visited row's draw is taken as the walk reaches it. On a device every row is drawn in one call
    and read once, with the draft's tokens where they are still there: the walk takes the draws of the rows it visits
    - each an independent sample of its row's p, so the rule is the same - and leaves the others (``_on_device``)."""
    if _on_device(p):
        return _walk(draft, draft.read_with(sample(p, generator)).__getitem__)  # [n+1] draws, one read
    return _walk(draft, lambda row: int(sample(p[row], generator)))


def accept_keyed(draft: Draft, p: torch.Tensor, noise: KeyedNoise, start: int) -> Acceptance:
    """Sample-and-match against keyed noise (a seeded request, docs/architecture.md#random-streams): at the current
    node the verifier's token is ``argmax(log p(row) + G_t)``, ``t = start + the row's depth`` (``start``: the index of
    the token row 0 predicts); move to the child with that token, if any; else it is the bonus. Each token is then
    what plain decoding with the same noise would choose at its position, whatever was drafted.

    p: [n+1, vocab] processed verifier probabilities. On a device every row's token is chosen in one call and read
    once (with the draft's tokens where they are still there): the same tokens, a pure function of the noise."""
    depths = draft.layout.depths  # [n+1] the depth of each row's node (row 0: the root)
    if _on_device(p):
        return _walk(draft, draft.read_with(noise.choose_rows(p, [start + d for d in depths])).__getitem__)
    return _walk(draft, lambda row: int(noise.choose(p[row], start + depths[row])))


def _on_device(p: torch.Tensor) -> bool:
    """Whether the verifier's probabilities are on a device the host reads by transfer (a GPU): acceptance then draws
    or chooses every row at once and reads the device once a step; on the host each row is read as visited (no
    transfer, and no draw for a row the walk never reaches)."""
    return p.device.type != "cpu"


def _walk(draft: Draft, choose) -> Acceptance:
    kids = draft.layout.children
    tokens = draft.tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        y = choose(row)
        nxt = next((c for c in kids[row] if tokens[c] == y), None)
        if nxt is None:
            return Acceptance(path, int(y))
        path.append(nxt)
        row = nxt + 1


def follow(draft: Draft, committed: list[int]) -> tuple[list[int], bool]:
    """The nodes of ``draft`` that the committed tokens would have accepted: from the root, the child whose token is
    the next committed token, as long as there is one. Returns (node path, censored): ``censored`` when the path
    used every committed token, so a longer draft may have had more accepted beyond what was verified.

    This is exactly what greedy verification of ``draft`` would have accepted (the committed tokens are the verifier's
    argmax along their path). Under sampling it is what sample-and-match would have accepted with the same draws (the
    committed tokens are samples of p along their path): a sample of the counterfactual, by common random numbers."""
    kids = draft.layout.children
    tokens = draft.tokens.tolist()
    path: list[int] = []
    row = 0
    for c in committed:
        nxt = next((k for k in kids[row] if tokens[k] == c), None)
        if nxt is None:
            return path, False
        path.append(nxt)
        row = nxt + 1
    return path, True


def accept_rejection(draft: Draft, p: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
    """Speculative (rejection) sampling with drafter probabilities; recursive over siblings for trees.

    Chain (Leviathan et al. 2023): accept x ~ q with prob min(1, p(x)/q(x)); on rejection draw the
    correction from norm(max(p - q, 0)).
    Tree (SpecInfer / RSD): try the children of the current node in order with the residual r (starting
    at p): accept child x_j with min(1, r(x_j)/q_j(x_j)); on rejection r <- norm(max(r - q_j, 0)) and,
    when siblings were drawn without replacement, q_{j+1} <- q_j with x_j removed, renormalised. If
    every child fails the bonus is drawn from r.
    """
    if draft.probs is None:
        raise ValueError("accept_rejection needs drafter probabilities (Draft.probs); use accept_match")
    q_all = fit_vocab(draft.probs.to(p.device).float(), p.shape[-1])  # [n, vocab] beside the verifier's p
    if _on_device(p) and len(draft) and draft.is_chain:
        return _reject_chain(draft, p, q_all, generator)
    kids = draft.layout.children
    tokens = draft.tokens.tolist()
    path: list[int] = []
    row = 0
    while True:
        r = p[row].float()  # residual target distribution at this node
        q = None
        accepted = None
        for child in kids[row]:
            x = tokens[child]
            if q is None or not draft.without_replacement:
                q = q_all[child]
            qx, rx = float(q[x]), float(r[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if qx > 0 and u * qx < rx:  # u < r(x)/q(x), written without division
                accepted = child
                break
            residual = (r - q).clamp_(min=0)
            total = float(residual.sum())
            # total == 0 would mean r <= q everywhere, so r == q and x was accepted with probability 1
            if total > 0:
                r = residual / total
            if draft.without_replacement:
                q = q.clone()
                q[x] = 0
                q_total = float(q.sum())
                if q_total <= 0:  # the drafter had no other token: later siblings cannot exist
                    q = None
                else:
                    q = q / q_total
        if accepted is None:
            return Acceptance(path, int(sample(r, generator)))
        path.append(accepted)
        row = accepted + 1


def _reject_chain(draft: Draft, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """``accept_rejection`` for a chain on a device, every test at once and one host read (gpt-fast's rule): with
    ``u_i ~ U(0, 1)`` for every node, node i passes where ``u_i q_i(x_i) < p_i(x_i)``; the first k pass; the bonus is
    drawn from ``norm(max(p_k - q_k, 0))`` (``p_n`` after a fully accepted chain). Draws the same distribution as the
    sequential rule, the uniforms of the nodes after the first rejection unused.

    p: [n+1, vocab] (row i: the target of node i); q: [n, vocab] float32; both on the device."""
    n, vocab = len(draft), p.shape[-1]
    x = draft.device_tokens(p.device)  # [n]
    rows = torch.arange(n, device=p.device)
    target = p[rows, x].float()  # [n] p_i(x_i)
    drafted = q[rows, x]  # [n] q_i(x_i)
    u = torch.rand(n, generator=generator, device=p.device)
    passed = (drafted > 0) & (u * drafted < target)  # u < p/q, written without division
    k = passed.long().cumprod(0).sum()  # [] the nodes accepted: those before the first failed test
    q_ext = torch.cat([q, q.new_zeros(1, vocab)])  # [n+1, vocab]: after the whole chain the bonus is drawn from p_n
    p_k = p.index_select(0, k.view(1)).float()  # [1, vocab]
    residual = (p_k - q_ext.index_select(0, k.view(1))).clamp_(min=0)  # [1, vocab]
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p_k)
    bonus = sample(residual, generator)  # [1]
    accepted, token = draft.read_with(torch.cat([k.view(1), bonus.view(1)]))  # the step's one host read
    return Acceptance(list(range(accepted)), int(token))
