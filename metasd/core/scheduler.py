"""Serving many requests at once: a scheduler thread owns the engine's models and runs the requests submitted to it.

``Scheduler(engine)`` starts a background thread. ``submit`` checks a request at once (a ``ValueError`` naming the bad
field) and queues it; the returned ``RequestHandle`` streams its ``TokenEvent`` s (``events()`` from a thread,
``aevents()`` from an asyncio loop) and gives its ``GenerationResult`` (``result()``). Listeners (``add_listener``)
get a ``SchedulerStep`` after each step and a ``RequestFinished`` per request, for metrics.

The core knows nothing of HTTP: the OpenAI-compatible server is a layer above it (``metasd.serve``).
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import torch

from .detokenize import IncrementalDetokenizer, find_stop
from .request import GenerationResult, Prompt, Request

log = logging.getLogger(__name__)

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
    """A step of the scheduler: one verifier forward over the drafts of ``batch_size`` running requests.

    forward_tokens: rows of that forward (padding included: batch_size x the longest [pending] + draft);
    prefill_tokens: prompt tokens prefilled in this step (requests joining); queue_length: requests waiting after
    the step; seconds: the step's wall time (drafting, prefill, verification, commits)."""

    batch_size: int
    forward_tokens: int
    prefill_tokens: int
    queue_length: int
    seconds: float
    requests: list[RequestStepRecord] = field(default_factory=list)


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

    def __init__(self, request_id: str, prompt_ids: list[int], scheduler: "Scheduler"):
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


class _TextStream:
    """The text deltas of a request's events: incremental detokenisation, holding back a tail that could still grow
    into a stop string, never sending a stop string or what follows it."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.sent = 0  # characters of detok.text already sent
        self.checked = 0  # characters of detok.text searched for stop strings
        self.cut: int | None = None

    def add(self, ids: Sequence[int]) -> str:
        if self.detok is None or self.cut is not None:
            return ""
        self.detok.add(ids)
        text = self.detok.text
        hit = find_stop(text, self.stop, self.checked)
        self.checked = len(text)
        if hit is not None:
            self.cut = hit
            end = hit
        else:
            end = max(len(text) - self.hold, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the request's final text (``GenerationResult.text``) not sent yet."""
        if self.detok is None:
            return ""
        sent = self.detok.text[: self.sent]
        if final_text.startswith(sent):
            return final_text[len(sent):]
        return ""  # cannot happen with a consistent tokenizer: never send text twice


class _Job:
    """A request inside the scheduler: the engine's ``Request`` and its handle."""

    def __init__(self, handle: RequestHandle, request: Request, options: RequestOptions):
        self.handle = handle
        self.request = request
        self.options = options
        self.text = _TextStream(request.engine.tokenizer, request.stop)
        self.started_at: float | None = None
        self.sent = 0  # new tokens sent in events
        self.first_token_at: float | None = None
        self.steps_iter: Iterator[list[int]] | None = None

    @property
    def id(self) -> str:
        return self.handle.id


class Scheduler:
    """Continuous batching over an ``Engine``: a background thread owns the engine's verifier and drafters (no other
    request may run on them meanwhile: ``Engine.generate`` on the same engine raises ``EngineBusyError``) and runs
    every submitted request.

    max_batch: requests running at once; max_queue: requests waiting beyond them (``submit`` raises
    ``QueueFullError`` past it); prefill_chunk: prompt tokens prefilled per step for a joining request, so a long
    prompt delays the running requests by one chunk per step; share_suffix_cache: let the suffix drafter's
    cross-request cache (``cross_request: true``) learn from and draft from every request served (off: each request
    drafts from its own text only, whatever the pool file says).

    Requests of a scheduler share the engine's policy when it is persistent (``persistent_policy``), else each gets a
    fresh copy of it, as ``Engine.generate`` starts each request from a reset policy.
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256,
                 share_suffix_cache: bool = False, name: str = "metasd-scheduler"):
        for key, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0), ("prefill_chunk", prefill_chunk, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        self.engine = engine
        self._max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.share_suffix_cache = bool(share_suffix_cache)
        self._lock = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._listeners: list[Listener] = []
        self._ids = itertools.count()
        self._closing = False
        self._deadline: float | None = None  # shutdown: cancel what is left at this time
        self._arm_names = [d.name for d in engine.drafters]
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    @property
    def max_batch(self) -> int:
        return self._max_batch

    @property
    def queue_length(self) -> int:
        """Requests submitted and not started yet."""
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests started and not finished."""
        with self._lock:
            return len(self._running)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn`` on the scheduler thread with a ``SchedulerStep`` after each step and a ``RequestFinished``
        when a request leaves. It must be quick; an exception it raises is logged and ignored."""
        with self._lock:
            self._listeners.append(fn)

    def submit(self, prompt: Prompt, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: str | Sequence[str] | None = None, seed: int | None = None,
               chat: bool | None = None, options: RequestOptions | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Check a request and queue it; its ``RequestHandle``. ``ValueError`` (naming the field) for a bad request
        - checked here, before anything is queued: an empty prompt, prompt + max_new_tokens over the verifier's
        context, sampling values out of range, an unknown drafter; ``QueueFullError`` when ``max_queue`` requests
        wait; ``SchedulerClosedError`` after shutdown began. Arguments as ``Engine.generate``'s; ``request_id``
        names the request in events and listener records (default: "req-<n>")."""
        if self._closing:
            raise SchedulerClosedError("the scheduler is shutting down: it takes no new requests")
        options = options if options is not None else RequestOptions()
        self._check_options(options)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        try:
            request = Request(self.engine, prompt, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              stop=stop, seed=seed, chat=chat, policy=self._policy_for(options))
        except TypeError as e:  # a prompt of the wrong type
            raise ValueError(f"prompt: {e}") from None
        self._bind_options(request, options)
        with self._lock:
            if self._closing:
                raise SchedulerClosedError("the scheduler is shutting down: it takes no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            handle = RequestHandle(rid, request.prompt_ids, self)
            self._waiting.append(_Job(handle, request, options))
            self._lock.notify_all()
        return handle

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop taking requests, let the running and the queued ones finish - within ``grace_s`` seconds if given -,
        then cancel what is left (finish_reason "cancelled") and stop the thread. Blocks until it has stopped."""
        with self._lock:
            self._closing = True
            if grace_s is not None:
                deadline = time.perf_counter() + max(grace_s, 0.0)
                self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def close(self) -> None:
        """Shut down now: cancel every queued and running request."""
        self.shutdown(grace_s=0.0)

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, exc_type, *exc: Any) -> None:
        if exc_type is None:
            self.shutdown()
        else:
            self.close()

    # ------------------------------------------------------------------ request set-up
    def _check_options(self, options: RequestOptions) -> None:
        if not isinstance(options, RequestOptions):
            raise ValueError(f"options must be a RequestOptions, got {type(options).__name__}")
        if options.drafter is not None and options.drafter not in self._arm_names:
            raise ValueError(f"drafter: no drafter named {options.drafter!r} in the pool; drafters: {self._arm_names}")
        b = options.draft_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise ValueError(f"draft_budget must be an integer >= 0 or None, got {b!r}")

    def _policy_for(self, options: RequestOptions):
        """The request's policy: none when it drafts with one named arm (or none); the engine's own when persistent
        (the scheduler thread is its only user); else a copy (reset when the request starts)."""
        policy = self.engine.policy
        if policy is None or not options.speculate or options.drafter is not None:
            return None
        return policy if self.engine.persistent_policy else copy.deepcopy(policy)

    def _bind_options(self, request: Request, options: RequestOptions) -> None:
        if not options.speculate:
            request.drafters, request.all_drafters = [], []
        elif options.drafter is not None:
            arm = self.engine.drafter(options.drafter)
            request.drafters = [arm]
            request.all_drafters = [d for d in self.engine.all_drafters if d is arm or _component_of(d, arm)]
        request.draft_budget = options.draft_budget

    # ------------------------------------------------------------------ the scheduler thread
    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._running and not self._closing:
                    self._lock.wait()
                if self._closing and not self._waiting and not self._running:
                    return
                job = self._waiting.popleft() if self._waiting else None
                if job is not None:
                    self._running.append(job)
            if job is not None:
                self._run_job(job)

    def _expired(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _run_job(self, job: _Job) -> None:
        """M1: one request at a time, to completion, through the engine's own step loop."""
        request = job.request
        if job.handle.cancelled or self._expired():
            return self._finish(job, "cancelled", None)
        job.started_at = time.perf_counter()
        reason, error = None, None
        steps = request.steps()
        try:
            for _ in steps:
                t = time.perf_counter()
                self._emit_tokens(job)
                self._notify(SchedulerStep(1, request.last_step.drafted + 1, 0, self.queue_length,
                                           time.perf_counter() - t, [self._step_record(job)]))
                if job.handle.cancelled or self._expired():
                    reason = "cancelled"
                    break
        except Exception as e:  # noqa: BLE001 - a failed request fails alone
            log.exception("request %s failed", job.id)
            reason, error = "error", e
        finally:
            steps.close()
        self._finish(job, reason or request.stats.stop_reason, error)

    def _step_record(self, job: _Job) -> RequestStepRecord:
        s = job.request.last_step
        return RequestStepRecord(job.id, s.drafter, s.drafted, s.accepted, s.accepted_per_position, s.committed)

    def _emit_tokens(self, job: _Job) -> None:
        """The event of the tokens the request committed since its last event (none after an EOS)."""
        new = job.request.new_ids[job.sent:]
        job.sent += len(new)
        if job.first_token_at is None and new:
            job.first_token_at = time.perf_counter()
        job.handle._push(TokenEvent(list(new), job.text.add(new)))

    def _finish(self, job: _Job, reason: str, error: BaseException | None) -> None:
        request = job.request
        result = None
        if error is None:
            if reason == "cancelled":
                request.stats.stop_reason = "cancelled"
                request.stats.new_tokens = len(request.new_ids)
            result = request.result()
        final_text = job.text.finish(result.text) if result is not None else ""
        job.handle._push(TokenEvent([], final_text, True, reason, result, error))
        with self._lock:
            if job in self._running:
                self._running.remove(job)
        now = time.perf_counter()
        sub = job.handle.submitted_at
        self._notify(RequestFinished(
            job.id, reason, len(request.prompt_ids), len(request.new_ids),
            None if job.first_token_at is None else job.first_token_at - sub, now - sub,
            (job.started_at or now) - sub, request.stats.to_record() if job.started_at is not None else {}, error))

    def _notify(self, record) -> None:
        for fn in list(self._listeners):
            try:
                fn(record)
            except Exception:  # noqa: BLE001
                log.exception("scheduler listener %r failed", fn)


def _component_of(d, arm) -> bool:
    """Whether drafter ``d`` is one ``arm`` drafts with (recursively)."""
    return any(c is d or _component_of(d, c) for c in arm.components())
