"""Scoring a model drafter on steps it did not draft (full-information feedback: see
docs/algorithms.md#full-information-feedback): from its logits after the pending token and each committed token - the
forward it would run anyway to catch up when it drafts next (``track: true`` runs it every step) - what it would have had accepted.

rows: [m, vocab] the drafter's logits predicting committed tokens c_1..c_m (row l after the pending token and
c_1..c_{l-1}); committed: [m] those tokens (the verifier's argmax along the verified path under greedy, its samples
under sampling); p: [m, vocab] the verifier's processed probabilities at the same positions (sampling only).
"""
from __future__ import annotations

import math

import torch

from metasd.core.decoding.sampling import SamplingParams, process_logits


def chain_acceptance(rows: torch.Tensor, committed: torch.Tensor, k: int, sampling: SamplingParams,
                     p: torch.Tensor | None = None) -> tuple[float, bool]:
    """Accepted draft tokens of the chain of ``k`` the drafter would have drafted, and whether the verified text ran
    out before it (a lower bound then). Greedy: its argmax chain follows the committed tokens as long as they agree.
    Sampling (its chain drawn from q, verified by rejection): the expected count sum_i prod_{l<=i} alpha_l with
    alpha_l = sum_x min(p_l(x), q_l(x)), the acceptance probability at each committed position (HedgeSpec's estimate).
    One host read."""
    m = min(k, rows.shape[0])
    if m == 0:
        return 0.0, False
    if sampling.greedy:
        agree = (rows[:m].argmax(-1) == committed[:m]).int()  # [m]
        n = float(agree.cumprod(0).sum())
    else:
        q = process_logits(rows[:m], sampling)  # [m, vocab]
        alpha = torch.minimum(p[:m].float(), q).sum(-1)  # [m]
        n = float(alpha.cumprod(0).sum())
    return n, k > rows.shape[0] and n >= rows.shape[0] - 1e-9


def tree_acceptance(rows: torch.Tensor, committed: torch.Tensor, depth: int, width: int, min_path_prob: float,
                    sampling: SamplingParams) -> tuple[float, bool]:
    """Accepted nodes of the dynamic tree the drafter would have grown, estimated along the committed path: a
    committed token is in the tree when it is among its parent's ``width`` best children and its path probability
    stays above ``min_path_prob`` (the global node budget is not modeled, so this can overestimate). Exact sample of
    sample-and-match under sampling by common random numbers, as for lookup drafters. One host read."""
    m = min(depth, rows.shape[0])
    if m == 0:
        return 0.0, False
    logp = rows[:m].float().log_softmax(-1) if sampling.greedy else process_logits(rows[:m], sampling).log()
    c = committed[:m, None]
    in_top = (logp.topk(min(width, logp.shape[-1]), dim=-1).indices == c).any(-1)  # [m]
    path = logp.gather(1, c).squeeze(1).cumsum(0)  # [m] log path probability of the committed path
    floor = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
    # a node whose parent's path is below the floor is a leaf: its children are never drafted
    parent_ok = torch.cat([torch.ones(1, dtype=torch.bool, device=path.device), path[:-1] >= floor])
    n = float((in_top & parent_ok).int().cumprod(0).sum())
    return n, depth > rows.shape[0] and n >= rows.shape[0]
