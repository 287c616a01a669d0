"""The per-request record a response carries in its ``metasd`` field, filtered through an allow-list.

A record (``RequestStats.to_record``) can hold what a drafter reports about its drafts (``Draft.meta`` summed in
``drafter_counts``): the suffix drafter's ``from_cache`` and ``match_len`` say whether, and how far, this request's
text matched text that *other* requests left in a shared suffix cache; a persistent policy's ``policy_state`` is
learnt from other requests' steps. A served record keeps only the fields named here - a new field stays private
until it is added, after asking whether it can reveal another request (docs/serving.md#security).
"""
from __future__ import annotations

from typing import Any, Mapping

#: counters and timings of this request's own steps
SERVED_FIELDS = (
    "prompt_tokens", "new_tokens", "prefill_committed", "steps", "drafted", "accepted", "tokens_per_step",
    "position_drafted", "position_accepted", "drafter_per_step", "catch_up_tokens", "modeled_cost", "prefill_s",
    "draft_s", "verify_s",
    "wall_s", "stop_reason", "committed", "mean_tokens_per_step", "acceptance_rate", "per_position_acceptance",
    "acceptance_histogram", "selection_counts", "tokens_per_second", "modeled_speedup", "overhead_s",
)
#: of each drafter's ``drafter_counts`` entry: how many steps it drafted (its own ``Draft.meta`` sums are dropped)
SERVED_DRAFTER_COUNTS = ("steps",)


def served_record(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """``record`` with only the allow-listed fields (and each drafter's step count)."""
    if not record:
        return {}
    out = {k: record[k] for k in SERVED_FIELDS if k in record}
    counts = record.get("drafter_counts")
    if isinstance(counts, Mapping):
        out["drafter_counts"] = {str(name): {k: c[k] for k in SERVED_DRAFTER_COUNTS if k in c}
                                 for name, c in counts.items() if isinstance(c, Mapping)}
    return out
