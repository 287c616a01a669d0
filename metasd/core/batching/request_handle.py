"""What a scheduler's caller holds and receives (metasd/core/batching/scheduler.py): the ``RequestHandle`` of a
submitted request, its ``TokenEvent`` s, the per-request ``RequestOptions``, the records listeners get
(``SchedulerStep``, ``RequestFinished``) and the errors ``submit`` raises. Plain data and thread-safe hand-over, no model work."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from ..decoding.request import GenerationResult
from ..execution.logprobs import TokenLogprob

FINISH_REASONS = ("stop", "length", "eos", "cancelled", "error")


class QueueFullError(RuntimeError):
    """``Scheduler.submit`` refused a request: ``max_queue`` requests are already waiting (a server answers 429/503)."""


class SchedulerClosedError(RuntimeError):
    """``Scheduler.submit`` after ``shutdown`` (or ``close``) began."""


@dataclass(frozen=True)
class RequestOptions:
    """Per-request drafting options.

    drafter: the name of one arm of the engine's pool to draft with, every step (None: the pool and its policy).
    draft_budget: at most this many draft nodes verified per step (the draft's first nodes: an ancestor-closed
        subtree); None: the drafter's whole draft. 0 drafts nothing.
    speculate: False decodes plainly (one token per step, no drafter runs).
    """

    drafter: str | None = None
    draft_budget: int | None = None
    speculate: bool = True


@dataclass
class TokenEvent:
    """What one step gave a request. ``token_ids``: the tokens committed this step (possibly empty in the last
    event); ``text``: the text they add (an incremental delta; text that could still become a stop string is held
    back until it cannot, and the stop string and what follows it are never sent). The last event has
    ``finished`` True, its ``finish_reason`` ("stop", "length", "eos", "cancelled" or "error") and the ``result``
    (None after an error, which is in ``error``)."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    #: with ``submit(logprobs=...)``: one per token of ``token_ids`` (``metasd.core.execution.logprobs``)
    logprobs: list[TokenLogprob] | None = None
    #: with ``submit(prompt_logprobs=...)``, in the first event with tokens: the prompt's (None for its first token)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class RequestStepRecord:
    """One request's part of a scheduler step: its drafter, the draft nodes verified, the accepted draft tokens and,
    per draft position (depth 1..depth of its draft), whether it was accepted (vLLM's per-position counts)."""

    id: str
    drafter: str
    drafted: int
    accepted: int
    accepted_per_position: list[bool]
    committed: int


@dataclass
class SchedulerStep:
    """A step of the scheduler: one verifier forward over the drafts of ``batch_size`` running requests (0: a step
    that only prefilled joining requests).

    forward_tokens: rows of that forward (padding included: batch_size x the longest [pending] + draft);
    prefill_tokens: prompt tokens prefilled in this step (requests joining); queue_length: requests waiting after
    the step; seconds: the step's wall time (drafting, prefill, verification, commits); adaptive: what adaptive
    speculation decided (``metasd.core.batching.adaptive.AdaptiveRecord``), None without it."""

    batch_size: int
    forward_tokens: int
    prefill_tokens: int
    queue_length: int
    seconds: float
    requests: list[RequestStepRecord] = field(default_factory=list)
    #: with adaptive speculation: the step's ``AdaptiveRecord`` (width chosen, nodes per row, expected goodput table)
    adaptive: Any = None


@dataclass
class RequestFinished:
    """A request left the scheduler. ttft_s: submit -> first token (None: none came); e2e_s: submit -> finish;
    record: ``RequestStats.to_record()`` (empty when it never started)."""

    id: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float
    queue_s: float
    record: dict[str, Any]
    error: BaseException | None = None


Listener = Callable[[SchedulerStep | RequestFinished], None]


class RequestHandle:
    """A submitted request: its events as they come, its result, its cancellation. Thread-safe; events are kept, so
    ``events()`` / ``aevents()`` each replay them from the first (one consumer is the normal case)."""

    def __init__(self, request_id: str, prompt_ids: list[int], scheduler: "Scheduler"):  # noqa: F821 - an import cycle
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self._scheduler = scheduler
        self._cond = threading.Condition()
        self._events: list[TokenEvent] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancel = threading.Event()
        self.submitted_at = time.perf_counter()

    # ------------------------------------------------------------ consumer side
    @property
    def finished(self) -> bool:
        with self._cond:
            return bool(self._events) and self._events[-1].finished

    def cancel(self) -> None:
        """Ask the scheduler to stop this request: it leaves (its slot freed) before the next step; a queued request
        never starts. Its last event has finish_reason "cancelled" (unless it finished first)."""
        self._cancel.set()
        self._scheduler._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The request's events, blocking for each; ends after the finished one. ``timeout``: the longest wait for one
        event (``TimeoutError`` past it)."""
        i = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: i < len(self._events), timeout):
                    raise TimeoutError(f"request {self.id}: no event within {timeout}s")
                event = self._events[i]
            i += 1
            yield event
            if event.finished:
                return

    async def aevents(self) -> AsyncIterator[TokenEvent]:
        """The request's events in an asyncio loop (the scheduler thread wakes it through ``call_soon_threadsafe``)."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                event = self._events[i] if i < len(self._events) else None
                if event is None:
                    wake = asyncio.Event()
                    self._waiters.append((loop, wake))
            if event is None:
                await wake.wait()
                continue
            i += 1
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Block until the request is over; its ``GenerationResult`` (also after a cancel: what it had generated, stop
        reason "cancelled"). A request that failed raises its error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events and self._events[-1].finished, timeout):
                raise TimeoutError(f"request {self.id}: not finished within {timeout}s")
            last = self._events[-1]
        if last.error is not None:
            raise last.error
        return last.result

    # ------------------------------------------------------------ scheduler side
    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            self._events.append(event)
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, wake in waiters:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass

