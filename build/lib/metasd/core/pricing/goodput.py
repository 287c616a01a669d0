"""A reward that prices the shared verifier forward of a batched step (docs/algorithms.md#speculation-under-load).

In a batched step B requests are verified by one padded forward over ``B * N`` tokens, ``N = max_j (1 + d_j)`` (row j:
its pending token and its ``d_j`` draft nodes). Request i's **share** of the step is

    s_i = cost(B * N) / B + c_i                                                   (shared_step_cost)

``c_i`` its own drafting cost. Why this split: the forward is one piece of work done for all B rows at once - no row
can be run without the others' padding - so each pays an equal part, and the shares add up to the step's whole cost,
``sum_i s_i = cost(B * N) + sum_i c_i``; drafting is done per request (one after another), so each pays its own. The
reward is

    r_i = committed_i / s_i                                                       (goodput_reward)

committed tokens per unit of cost. With ``cost`` in units of a 1-token verifier forward (``cost(1) = 1``), 1.0 is
plain decoding's rate at batch 1; plain decoding at batch B scores ``B / cost(B)`` per request's share, e.g. ~6 for
B = 8 on the measured CPU costs, so the reward also rises with the batch a request is in: compare arms within a load
level (``policies/per_load.py``) or with the load in the context.

**What a policy then maximises.** Summed over the batch, ``sum_i committed_i / sum_i s_i`` is the step's goodput
(committed tokens per unit of cost: the allocator's objective, ``metasd.core.pricing.allocator``), and since the shares
add up to the step's cost, an arm that raises ``committed_i / s_i`` for its request raises the batch's ratio (the
batch's ratio is a weighted mean of the requests' ratios, weights ``s_i``). Note what the equal split does not
charge: a request whose draft widens ``N`` raises every row's cost, and pays only ``1 / B`` of it; the allocator,
which sees the whole batch, is what keeps widths in check.

**At B = 1** the share is ``cost(1 + d) + c``: the verification plus drafting cost of the step, the denominator of the
existing ``throughput`` reward (``metasd.core.decoding.rewards.Throughput``: committed tokens / modeled cost in verifier
decode steps), so ``goodput_reward`` is that reward's form with the forward priced by ``cost``; its counterfactual
``(n_acc' + 1) / s'`` is ``Throughput.counterfactual``'s.

**Counterfactual for a smaller budget.** A verified draft of ``d`` nodes tells what budget ``d' < d`` of the same
drafter would have accepted (``metasd.core.pricing.acceptance_curve.accepted_within``). That draft would have been in
another forward: row i at ``1 + d'`` tokens, the others unchanged, ``N' = max(1 + d', max_{j != i} (1 + d_j))``
(``counterfactual_share``). A request narrower than the others saves nothing on the forward by drafting less - only
its drafting cost - which is what padding means.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence


def _check_rows(rows_tokens: Sequence[int], i: int) -> list[int]:
    rows = [int(t) for t in rows_tokens]
    if not rows or any(t < 1 for t in rows):
        raise ValueError(f"goodput: rows_tokens must be >= 1 token each (the pending token is always in), got {rows}")
    if not 0 <= i < len(rows):
        raise ValueError(f"goodput: row {i} is not in a batch of {len(rows)}")
    return rows


def _forward(cost: Callable[[int], float], n_tokens: int) -> float:
    value = float(cost(n_tokens))
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"goodput: cost({n_tokens}) must be finite and > 0, got {value!r}")
    return value


def shared_step_cost(cost: Callable[[int], float], rows_tokens: Sequence[int], i: int, draft_cost_i: float = 0.0
                     ) -> float:
    """Request i's share of a batched step: ``cost(B * N) / B + draft_cost_i``.

    cost: the verifier forward's cost over ``n`` tokens in all (units of a 1-token forward for rewards in plain-decode
        units); rows_tokens: [B] tokens of each row before padding (``1 + d_j``: the pending token and the draft);
        ``N = max(rows_tokens)``; draft_cost_i: request i's drafting cost in the same units.
    """
    rows = _check_rows(rows_tokens, i)
    if not (draft_cost_i >= 0 and math.isfinite(draft_cost_i)):
        raise ValueError(f"goodput: draft_cost_i must be finite and >= 0, got {draft_cost_i!r}")
    B, N = len(rows), max(rows)
    return _forward(cost, B * N) / B + float(draft_cost_i)


def goodput_reward(committed_i: float, share_i: float) -> float:
    """Committed tokens per unit of the request's share of the step: ``committed_i / share_i`` (0 for a non-positive
    share). With ``cost(1) = 1``, plain decoding at batch 1 scores 1.0."""
    if not math.isfinite(committed_i) or committed_i < 0:
        raise ValueError(f"goodput: committed_i must be finite and >= 0, got {committed_i!r}")
    return committed_i / share_i if share_i > 0 else 0.0


def counterfactual_share(cost: Callable[[int], float], rows_tokens: Sequence[int], i: int, d_prime: int,
                         draft_cost_prime: float = 0.0) -> float:
    """Request i's share had it drafted ``d_prime`` nodes (same drafter, smaller budget): row i at ``1 + d_prime``
    tokens, the other rows as they were, ``N' = max`` over the new rows; plus the drafting cost of ``d_prime`` nodes."""
    rows = _check_rows(rows_tokens, i)
    if int(d_prime) != d_prime or d_prime < 0:
        raise ValueError(f"goodput: d_prime must be an integer >= 0, got {d_prime!r}")
    rows[i] = 1 + int(d_prime)
    return shared_step_cost(cost, rows, i, draft_cost_prime)


def counterfactual_goodput(cost: Callable[[int], float], rows_tokens: Sequence[int], i: int, d_prime: int,
                           accepted_prime: float, draft_cost_prime: float = 0.0) -> float:
    """The reward budget ``d_prime`` would have earned: ``(accepted_prime + 1) / counterfactual_share(...)`` - its
    accepted tokens (``accepted_within(path, d_prime)``) plus the bonus, over the share of the forward it would have
    been in."""
    share = counterfactual_share(cost, rows_tokens, i, d_prime, draft_cost_prime)
    return goodput_reward(float(accepted_prime) + 1.0, share)


__all__ = ["counterfactual_goodput", "counterfactual_share", "goodput_reward", "shared_step_cost"]
