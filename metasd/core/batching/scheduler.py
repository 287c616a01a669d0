"""Serving many requests at once: a scheduler thread owns the engine's models and runs the requests submitted to it.

``Scheduler(engine)`` starts a background thread. ``submit`` checks a request at once (a ``ValueError`` naming the bad
field) and queues it; the returned ``RequestHandle`` streams its ``TokenEvent`` s (``events()`` from a thread,
``aevents()`` from an asyncio loop) and gives its ``GenerationResult`` (``result()``). Listeners (``add_listener``)
get a ``SchedulerStep`` after each step and a ``RequestFinished`` per request, for metrics.

The core knows nothing of HTTP: the OpenAI-compatible server is a layer above it (``metasd.serve``).
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Sequence

import torch

from ..decoding.drafter import with_components
from ..decoding.request import Prompt, Request
from ..execution.batch_verifier import BatchVerifier, Prefill, SlotVerifier
from .adaptive import AdaptiveSpeculation, StepPlan
from .request_handle import (FINISH_REASONS, Listener, QueueFullError, RequestFinished, RequestHandle,  # noqa: F401
    RequestOptions, RequestStepRecord, SchedulerClosedError, SchedulerStep, TokenEvent, _TextStream)

log = logging.getLogger(__name__)

class _Job:
    """A request inside the scheduler: the engine's ``Request``, its handle and where it is (queued, prefilling with
    ``prefill``, running in row ``slot.row``)."""

    def __init__(self, handle: RequestHandle, request: Request, options: RequestOptions):
        self.handle = handle
        self.request = request
        self.options = options
        self.text = _TextStream(request.engine.tokenizer, request.stop)
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.sent = 0  # new tokens sent in events
        self.prefill: Prefill | None = None
        self.slot: SlotVerifier | None = None  # its view of the batched verifier, from the start of its prefill
        self.forks: _Forks | None = None
        self.begun = False  # the request's drafters started (Request.prefilled)

    @property
    def id(self) -> str:
        return self.handle.id


class _Forks:
    """A set of forks of the engine's pool (``Drafter.fork``) that one running request drafts with."""

    def __init__(self, arms, cross_request: bool):
        memo: dict = {}
        self.arms = [a.fork(cross_request, memo) for a in arms]
        self.all = with_components(self.arms)

    def bind(self, request: Request, options: RequestOptions, names: list[str]) -> None:
        if not options.speculate:
            request.drafters, request.all_drafters = [], []
        elif options.drafter is not None:
            arm = self.arms[names.index(options.drafter)]
            request.drafters, request.all_drafters = [arm], with_components([arm])
        else:
            request.drafters, request.all_drafters = self.arms, self.all


class Scheduler:
    """Continuous batching over an ``Engine``: a background thread owns the engine's verifier and drafters - from
    construction to shutdown no other request may run on them (``Engine.generate`` on the same engine raises
    ``EngineBusyError``) - and runs every submitted request. Each step: requests waiting are admitted up to
    ``max_batch`` (a joining request is prefilled alone, ``prefill_chunk`` tokens per step, then copied into a row of
    the batched cache), every running request drafts with its own forks of the pool's drafters, one verifier forward
    scores all the drafts (``BatchVerifier``), each request accepts and commits its own path, and finished or cancelled
    requests leave (docs/architecture.md#serving-the-scheduler-and-the-batched-cache).

    max_batch: requests running (or prefilling) at once; max_queue: requests waiting beyond them (``submit`` raises
    ``QueueFullError`` past it); prefill_chunk: prompt tokens prefilled per step, so a long prompt delays the running
    requests by one chunk's forward per step; share_suffix_cache: let the suffix drafter's cross-request cache
    (``cross_request: true``) learn from and draft from every request served (off: each request drafts from its own
    text only, whatever the pool file says); adaptive: an ``AdaptiveSpeculation`` (core/batching/adaptive.py: load in
    the policy's context, drafts sized by the step allocator, steps priced by their share of the forward), or None.

    Requests share the engine's policy when it is persistent (``persistent_policy``; the scheduler thread is its
    only user), else each gets a fresh copy of it, as ``Engine.generate`` starts each request from a reset policy.
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256,
                 share_suffix_cache: bool = False, adaptive: AdaptiveSpeculation | None = None,
                 name: str = "metasd-scheduler"):
        for key, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0), ("prefill_chunk", prefill_chunk, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        self.engine = engine
        self._max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.share_suffix_cache = bool(share_suffix_cache)
        self.adaptive = AdaptiveSpeculation.checked(adaptive)
        self.verifier = BatchVerifier(engine.verifier, max_batch, engine.hidden_layers)
        self._lock = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._prefilling: list[_Job] = []
        self._running: list[_Job] = []  # index = row of the batched cache
        self._listeners: list[Listener] = []
        self._ids = itertools.count()
        self._closing = False
        self._deadline: float | None = None  # shutdown: cancel what is left at this time
        #: the error that stopped the scheduler thread (it then failed every request and takes no more); None while
        #: it runs or after a normal shutdown
        self.failure: BaseException | None = None
        self._arm_names = [d.name for d in engine.drafters]
        self._free_forks: list[_Forks] = []
        self._hold = engine.exclusive_use()  # EngineBusyError here when a request runs on the engine
        self._hold.__enter__()
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
        """Requests started (prefilling or decoding) and not finished."""
        with self._lock:
            return len(self._running) + len(self._prefilling)

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
        request.policy = self._policy_for(options)  # None where the request drafts with one named arm (Request
        request.draft_budget = options.draft_budget  # itself falls back to the engine's policy when given None)
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
        """Stop taking requests; let the running and the queued requests finish - within ``grace_s`` seconds when
        given -, then cancel what is left (finish_reason "cancelled"; a queued request never starts) and stop the
        thread. Blocks until it has stopped (when called from another thread than the scheduler's)."""
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
        """Leaving a ``with`` block waits for every request (``shutdown()``); on an exception, cancels them."""
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
        """The request's policy: none when it drafts with one named arm (or none); the engine's own when persistent;
        else a copy (reset when the request starts, as ``Engine.generate`` resets its policy)."""
        policy = self.engine.policy
        if policy is None or not options.speculate or options.drafter is not None:
            return None
        return policy if self.engine.persistent_policy else copy.deepcopy(policy)

    # ------------------------------------------------------------------ the scheduler thread
    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _expired(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _run(self) -> None:
        # the whole thread in inference mode: the batched cache grows inside the verifier's forward (inference tensors)
        # and is written in place by commits and row moves outside it
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._waiting or self._prefilling or self._running or self._closing):
                        self._lock.wait()
                    if self._closing and not (self._waiting or self._prefilling or self._running):
                        return
                    cancelled = [j for j in self._waiting if j.handle.cancelled or self._expired()]
                    for j in cancelled:
                        self._waiting.remove(j)
                    while self._waiting and len(self._prefilling) + len(self._running) < self._max_batch:
                        self._prefilling.append(self._waiting.popleft())
                for job in cancelled:
                    self._leave(job, "cancelled")
                for job in [j for j in self._prefilling + self._running if j.handle.cancelled or self._expired()]:
                    self._leave(job, "cancelled")
                if self._prefilling or self._running:
                    self._step()
        except BaseException as e:  # noqa: BLE001 - the scheduler itself broke: every request gets the error
            log.exception("the scheduler thread failed")
            self.failure = e
            with self._lock:
                self._closing = True
                jobs = list(self._waiting) + self._prefilling + self._running
                self._waiting.clear()
            for job in jobs:
                try:
                    self._leave(job, "error", e)
                except BaseException:  # noqa: BLE001 - its row could not be freed: it still gets its error event
                    log.exception("request %s could not leave cleanly", job.id)
                    job.handle._push(TokenEvent([], "", True, "error", None, e))
        finally:
            self._hold.__exit__(None, None, None)

    def _step(self) -> None:
        """One step: a prefill chunk for joining requests, then drafts, one batched verification, commits."""
        t0 = time.perf_counter()
        prefill_tokens = self._prefill()
        running = list(self._running)
        if not running:  # only prefills this step (reported: its prompt tokens count)
            self._notify(SchedulerStep(0, 0, prefill_tokens, self.queue_length, time.perf_counter() - t0))
            return
        drafts, plan = self._draft(running)
        running = list(self._running)  # compact again: failed rows left
        if not running:
            self._notify(SchedulerStep(0, 0, prefill_tokens, self.queue_length, time.perf_counter() - t0))
            return
        batch = [drafts[id(j)] for j in running]
        t1 = time.perf_counter()
        try:
            outs = self.verifier.verify([j.request.pending for j in running], batch)
        except Exception as e:  # noqa: BLE001 - the forward itself failed: every request in it fails
            log.exception("the batched verification failed")
            for job in running:
                self._leave(job, "error", e)
            return
        forward_s = time.perf_counter() - t1
        done: list[_Job] = []
        failed: list[tuple[_Job, Exception]] = []
        records = []
        rows_tokens = [1 + len(d) for d in batch]  # [B] each row's tokens before padding
        for i, (job, out) in enumerate(zip(running, outs)):
            try:
                _, finished = (job.request.finish_step(out, verify_s=forward_s) if plan is None else
                               self.adaptive.finish(job.request, out, forward_s, rows_tokens, i, plan.arms[id(job)],
                                                    plan.nodes[id(job)], plan.lookup[id(job)]))
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed after verification", job.id)
                failed.append((job, e))
                job.slot.kept = None
                continue
            records.append(self._step_record(job))
            if finished:
                done.append(job)
        self.verifier.commit([j.slot for j in running])
        for job in running:
            if not any(job is f for f, _ in failed):
                self._emit_tokens(job)
        for job, e in failed:
            self._leave(job, "error", e)
        for job in done:
            self._leave(job, job.request.stats.stop_reason)
        forward_tokens = len(running) * max(rows_tokens)  # the padded [B, N] forward
        record = plan and self.adaptive.record(plan.alloc, [plan.nodes[id(j)] for j in running], forward_tokens)
        self._notify(SchedulerStep(len(running), forward_tokens, prefill_tokens, self.queue_length,
                                   time.perf_counter() - t0, records, record))

    def _each(self, jobs: list[_Job], fn, doing: str) -> dict[int, Any]:
        """``fn(job)`` for each job, by ``id(job)``; a job whose call fails leaves with its error (it alone fails)."""
        out: dict[int, Any] = {}
        for job in jobs:
            try:
                out[id(job)] = fn(job)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed while %s", job.id, doing)
                self._leave(job, "error", e)
        return out

    def _draft(self, running: list[_Job]) -> tuple[dict, StepPlan | None]:
        """Every running request drafts (``draft_step``); adapting, all select (given the load), the allocator gives
        each ``d_i``, each drafts ``propose(d_i)``. Drafts by job, and the step's ``StepPlan`` (None: not adapting)."""
        adaptive = self.adaptive
        if adaptive is None:
            return self._each(running, lambda j: j.request.draft_step(), "drafting"), None
        load = adaptive.load(len(running))  # [2] the same for every request of the step
        arms = self._each(running, lambda j: adaptive.select(j.request, load), "selecting its drafter")
        running = list(self._running)
        plan = adaptive.step_plan([id(j) for j in running], [arms[id(j)] for j in running],
                                  [j.request for j in running])
        return self._each(running, lambda j: j.request.propose(plan.nodes[id(j)], plan.lookup[id(j)]), "drafting"), plan

    def _prefill(self) -> int:
        """Prefill joining requests, ``prefill_chunk`` prompt tokens in all; a request whose prompt is in joins the
        batch. Returns the tokens prefilled."""
        budget = self.prefill_chunk
        total = 0
        while self._prefilling and budget > 0:
            job = self._prefilling[0]
            try:
                if job.prefill is None:
                    self._start(job)
                n = job.prefill.step(budget)
                budget -= n
                total += n
                if job.prefill.finished:
                    self.verifier.join(job.slot, job.prefill)
                    job.slot.hidden = job.prefill.hidden
                    job.prefill = None
                    with self._lock:
                        self._prefilling.pop(0)
                        self._running.append(job)
                    assert self._running[job.slot.row] is job
                    job.begun = True
                    job.request.prefilled()
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in its prefill", job.id)
                self._leave(job, "error", e)
        return total

    def _start(self, job: _Job) -> None:
        """A request leaves the queue: its forks of the pool, its view of the verifier, its episode, its prefill."""
        job.started_at = time.perf_counter()
        job.forks = self._free_forks.pop() if self._free_forks else _Forks(self.engine.drafters, self.share_suffix_cache)
        job.forks.bind(job.request, job.options, self._arm_names)
        job.slot = SlotVerifier(self.engine.verifier, None)
        job.request.verifier = job.slot
        job.request.open()
        job.prefill = Prefill(self.engine.verifier, job.request.prompt_ids[:-1], self.engine.hidden_layers)

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

    def _leave(self, job: _Job, reason: str, error: BaseException | None = None) -> None:
        """The request leaves (finished, cancelled or failed): its drafters end, its row is freed (the last row moves
        into it), its forks go back to the free list (not after an error: their state is unknown), its last event."""
        request = job.request
        with self._lock:
            if job in self._prefilling:
                self._prefilling.remove(job)
            row = job.slot.row if job.slot is not None and job in self._running else None
        if row is not None:
            moved = self.verifier.remove(row)
            with self._lock:
                last = self._running.pop()
                if moved is not None:
                    self._running[row] = last
                    last.slot.row = row
        result = None
        try:
            if job.begun and error is None:
                request._finish()
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed at its end", job.id)
            reason, error = "error", e
        if job.begun:
            for d in request.all_drafters:
                try:
                    d.end()
                except Exception:  # noqa: BLE001
                    log.exception("drafter %s failed at the end of request %s", d.name, job.id)
        if job.forks is not None and error is None:
            self._free_forks.append(job.forks)
        job.forks = None
        if error is None:
            if reason == "cancelled":
                request.stats.stop_reason = "cancelled"
                request.stats.new_tokens = len(request.new_ids)
            result = request.result()
        final_text = job.text.finish(result.text) if result is not None else ""
        job.handle._push(TokenEvent([], final_text, True, reason, result, error))
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
