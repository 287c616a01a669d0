"""What the adaptive step decides and records (``metasd.core.batching.adaptive``): the plan it hands the scheduler's
step and the record each step keeps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..pricing.allocator import Allocation


class StepPlan(NamedTuple):
    """A step's adaptive decisions (``Scheduler._draft``): allocation, each job's nodes, arm, lookup-only or not."""

    alloc: Allocation
    nodes: dict[int, int]  # id(job) -> d_i
    arms: dict[int, Any]  # id(job) -> the drafter that drafts (the one selected or a probe's sibling; None: none)
    lookup: dict[int, bool]  # id(job) -> drafts lookup_only


@dataclass
class AdaptiveRecord:
    """What the adaptation decided in one step (``SchedulerStep.adaptive``): the width scanned best, each request's
    node budget (row order), the expected goodput of the allocation and of each candidate width, each request's
    option in the allocation (``Allocation.options``: 1 where it drafted with its arm's lookups alone), the tokens it
    is expected to commit (``Allocation.tokens``; its modeled cost: tokens / goodput) and whether a probe made it."""

    width: int
    nodes: list[int]
    goodput: float
    table: dict[int, float] = field(default_factory=dict)
    options: list[int] = field(default_factory=list)
    tokens: float = 0.0
    probe: bool = False


__all__ = ["AdaptiveRecord", "StepPlan"]
