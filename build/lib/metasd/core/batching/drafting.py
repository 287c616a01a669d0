"""Batched drafting: the drafting loops of every running request advanced together, so that the drafter forwards
they need in a round run as one forward per drafter model (docs/architecture.md#batched-drafting).

Each request's ``Request.drafting`` gives its selected arm's loop (``Drafter.drafting``: a generator that yields
``Feed`` s and gets their logits back). A round collects one feed from every loop still drafting; the feeds that share
a model run in one forward (``draft_batch.feed_groups`` / ``run_group``), and each loop gets its logits and goes on to
its next feed or its draft. A chain of k tokens is thus one catch-up round and k - 1 rounds of one token per request;
a tree, one round per level - whatever the number of requests. A cascade's lookup arm drafts inside the loop without a
feed; a model arm of another size simply forms another group.

Each request keeps its own account: a step meter of its own is open while its loop runs (what a budget arm reads),
and a shared forward's modeled cost and seconds are split evenly among the rows in it - what ``Request.drafted``
records and the allocator learns drafting prices from.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from ..decoding.request import Request
from ..execution.clock import now
from ..execution.draft_batch import Feed, feed_groups, run_group
from ..execution.tree import Draft
from ..pricing.cost import StepMeter

log = logging.getLogger("metasd.core.batching.scheduler")


class _Row:
    """One request's drafting loop and its account."""

    def __init__(self, request: Request, loop, meter: StepMeter):
        self.request, self.loop, self.meter = request, loop, meter
        self.seconds = 0.0
        self.draft: Draft | None = Draft.empty() if loop is None else None
        self.error: Exception | None = None


# in inference mode: the loops enter it too and hold it across their feeds, so they exit it in whatever order they
# end - each restoring the mode it found, which is then always on (outside it, interleaved exits would leave it on)
@torch.inference_mode()
def draft_together(requests: Sequence[Request], asks: Sequence[tuple[int | None, bool]], clock: Any = None,
                   batched: bool = True) -> list[Draft | Exception]:
    """Every request drafts with its selected arm (``asks``: its node budget and lookup-only flag, as
    ``Request.propose`` takes them), all loops advanced together. Returns per request its draft, cut to its budgets
    and recorded for its ``finish_step`` (``Request.drafted``), or the exception its drafting raised (it alone
    failed; a shared forward that raised fails the requests in it). ``batched`` False runs every feed alone (as
    before batched drafting: to measure it, or to rule it out)."""
    rows = []
    for request, (nodes, lookup) in zip(requests, asks):
        meter = StepMeter(request.engine.meter.model, request.engine.meter.unit)
        try:
            rows.append(_Row(request, request.drafting(nodes, lookup), meter))
        except Exception as e:  # noqa: BLE001
            row = _Row(request, None, meter)
            row.error = e
            rows.append(row)
    pending: dict[int, Feed] = {}

    def advance(i: int, value) -> None:  # run row i's loop (its meter open) to its next feed or its end
        row = rows[i]
        t0 = now(clock)
        try:
            with row.meter.resumed():
                pending[i] = row.loop.send(value)
        except StopIteration as done:
            row.draft = done.value
        except Exception as e:  # noqa: BLE001 - this request's drafting failed: it alone
            row.error = e
        finally:
            row.seconds += now(clock) - t0

    for i, row in enumerate(rows):
        if row.loop is not None and row.error is None:
            advance(i, None)
    while pending:
        round_ = sorted(pending.items())
        pending.clear()
        for group in feed_groups([feed for _, feed in round_]) if batched else [[g] for g in range(len(round_))]:
            members = [round_[g][0] for g in group]
            shared = StepMeter(rows[members[0]].meter.model, rows[members[0]].meter.unit)
            t0 = now(clock)
            try:
                with shared.resumed():
                    outs = run_group([round_[g][1] for g in group])
            except Exception as e:  # noqa: BLE001 - the shared forward failed: the requests in it fail
                log.exception("a batched drafter forward failed")
                for i in members:
                    rows[i].error = e
                    rows[i].loop.close()
                continue
            seconds = now(clock) - t0
            for i, logits in zip(members, outs):
                rows[i].meter.total += shared.total / len(members)
                rows[i].seconds += seconds / len(members)
                advance(i, logits)
    out: list[Draft | Exception] = []
    for row in rows:
        if row.error is not None:
            out.append(row.error)
            continue
        try:
            out.append(row.request.drafted(row.draft, row.meter.steps, 0.0, row.seconds))
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out


def each_drafts(jobs: Sequence[Any], asks: Callable[[Any], tuple[int | None, bool]], fail: Callable[[Any, Exception],
                None], clock: Any = None, batched: bool = True) -> dict[int, Draft]:
    """``draft_together`` for scheduler jobs (``job.request``): their drafts by ``id(job)``; a job whose drafting
    failed is handed to ``fail`` with its error."""
    results = draft_together([j.request for j in jobs], [asks(j) for j in jobs], clock, batched)
    drafts: dict[int, Draft] = {}
    for job, result in zip(jobs, results):
        if isinstance(result, Exception):
            log.error("request %s failed while drafting: %r", job.id, result, exc_info=result)
            fail(job, result)
        else:
            drafts[id(job)] = result
    return drafts
