"""Serving many requests at once: a scheduler thread owns the engine's models and runs the requests submitted to it.

``Scheduler(engine)`` starts a background thread. ``submit`` checks a request at once (a ``ValueError`` naming the bad
field) and queues it; the returned ``RequestHandle`` streams its ``TokenEvent`` s (``events()`` from a thread,
``aevents()`` from an asyncio loop) and gives its ``GenerationResult`` (``result()``). Listeners (``add_listener``)
get a ``SchedulerStep`` after each step and a ``RequestFinished`` per request, for metrics.

The core knows nothing of HTTP: the OpenAI-compatible server is a layer above it (``metasd.serve``).
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from typing import Any, Sequence

import torch

from ..decoding.acceptance import read_choices
from ..decoding.request import Prompt
from ..execution.batch_verifier import SlotVerifier
from ..execution.kv_memory import KVAllocationError
from .adaptive import AdaptiveSpeculation, StepPlan
from .drafting import each_drafts
from .jobs import (Forks, Job, batch_verifier_for, free_row, new_request, prefix_cache_for, send_first_tokens,
                   start_prefill, tidy_memory)
from .request_handle import (FINISH_REASONS, Listener, QueueFullError, RequestFinished, RequestHandle,  # noqa: F401
    RequestOptions, RequestStepRecord, SchedulerClosedError, SchedulerStep, TokenEvent)

log = logging.getLogger(__name__)

class Scheduler:
    """Continuous batching over an ``Engine``: a background thread owns the engine's verifier and drafters - from
    construction to shutdown no other request may run on them (``Engine.generate`` on the same engine raises
    ``EngineBusyError``) - and runs every submitted request. Each step: requests waiting are admitted up to
    ``max_batch`` (a joining request is prefilled alone, ``prefill_chunk`` tokens per step, into the row of the batched
    cache its reservation allocated), every running request drafts with its own forks of the pool's drafters (their
    model forwards shared, ``drafting.py``), one verifier forward scores all the drafts (``BatchVerifier``), each
    request accepts and commits its own path, and finished or cancelled requests leave
    (docs/architecture.md#serving-the-scheduler-and-the-batched-cache).

    max_batch: requests running (or prefilling) at once; max_queue: requests waiting beyond them and the batch's free
    slots (``submit`` raises ``QueueFullError`` past it); prefill_chunk: prompt tokens prefilled per step, so a long
    prompt delays the running requests by one chunk's forward per step; share_suffix_cache: let the suffix drafter's
    cross-request cache (``cross_request: true``) learn from and draft from every request served (off: each request
    drafts from its own text only, whatever the pool file says); adaptive: an ``AdaptiveSpeculation``
    (core/batching/adaptive.py: load in the policy's context, drafts sized by the step allocator, steps priced by their
    share of the forward), or None; kv_budget: KV memory for the running requests, in positions of the verifier's cache
    (its bytes per position; the drafters' caches are charged to it too) - a request is admitted with its reservation
    (prompt + max_new_tokens + max_draft_nodes + 1, rounded up to 256) in hand, waits in the queue while the budget is
    full, and is refused at ``submit`` when it could never fit (None: a share of the free memory,
    docs/architecture.md#the-kv-memory-model); max_draft_nodes: the most draft nodes any step verifies for one request
    (longer drafts are cut; at most the batched verifier's ``node_limit`` where it has one: llama.cpp's sequences);
    prefix_caching: keep finished requests' KV inside the budget to start requests that continue them (``PrefixCache``);
    batch_drafting: run the drafter forwards of a drafting round that share a model as one (``drafting.py``; False: each
    request's alone, to measure or rule it out).

    Requests share the engine's policy when it is persistent (``persistent_policy``; the scheduler thread is its
    only user), else each gets a fresh copy of it, as ``Engine.generate`` starts each request from a reset policy.
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 256,
                 share_suffix_cache: bool = False, adaptive: AdaptiveSpeculation | None = None,
                 kv_budget: int | None = None, max_draft_nodes: int = 128, name: str = "metasd-scheduler",
                 prefix_caching: bool = False, batch_drafting: bool = True):
        for key, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                                ("prefill_chunk", prefill_chunk, 1), ("max_draft_nodes", max_draft_nodes, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key} must be an integer >= {low}, got {value!r}")
        self.engine = engine
        self._max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.share_suffix_cache, self.batch_drafting = bool(share_suffix_cache), bool(batch_drafting)
        if kv_budget is not None and (not isinstance(kv_budget, int) or isinstance(kv_budget, bool) or kv_budget < 1):
            raise ValueError(f"kv_budget must be an integer >= 1 (KV positions of the verifier) or None, got {kv_budget!r}")
        self.verifier = batch_verifier_for(engine, max_batch, kv_budget)
        self.adaptive = AdaptiveSpeculation.checked(adaptive, self.verifier.padding)
        self.prefix_cache = prefix_cache_for(engine, self.verifier) if prefix_caching else None  # (before node_limit)
        self.max_draft_nodes = min(max_draft_nodes, getattr(self.verifier, "node_limit", max_draft_nodes))
        self._lock = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._prefilling: list[Job] = []
        self._running: list[Job] = []  # index = row of the batched cache
        self._listeners: list[Listener] = []
        self._ids = itertools.count()
        self._closing = False
        self._deadline: float | None = None  # shutdown: cancel what is left at this time
        #: the error that stopped the scheduler thread (it then failed every request and takes no more); None while
        #: it runs or after a normal shutdown
        self.failure: BaseException | None = None
        #: steps in a row whose verifier forward (or its bookkeeping) failed; a step that verifies resets it
        self.failed_steps = 0
        self._arm_names = [d.name for d in engine.drafters]
        self._free_forks: list[Forks] = []
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

    #: failed steps in a row after which ``health`` says the scheduler is unhealthy
    UNHEALTHY_AFTER = 3

    def health(self) -> tuple[bool, str]:
        """(healthy, why): unhealthy once the thread has stopped on an error, or after ``UNHEALTHY_AFTER`` steps in a
        row failed (each failed its requests). The reason names what happened, not the error's text (the log has it)."""
        if self.failure is not None:
            return False, "the scheduler thread stopped on an error; restart the server"
        if self.failed_steps >= self.UNHEALTHY_AFTER:
            return False, f"the last {self.failed_steps} steps failed (every request in them got an error)"
        return True, "ok"

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn`` on the scheduler thread with a ``SchedulerStep`` after each step and a ``RequestFinished``
        when a request leaves. It must be quick; an exception it raises is logged and ignored."""
        with self._lock:
            self._listeners.append(fn)

    def submit(self, prompt: Prompt, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, stop: str | Sequence[str] | None = None, seed: int | None = None,
               chat: bool | None = None, options: RequestOptions | None = None, request_id: str | None = None,
               **processing) -> RequestHandle:
        """Check a request and queue it; its ``RequestHandle``. ``ValueError`` (naming the field) for a bad request
        - checked here, before anything is queued: an empty prompt, prompt + max_new_tokens over the verifier's
        context, sampling values out of range, an unknown drafter; ``QueueFullError`` when ``max_queue`` requests
        wait; ``SchedulerClosedError`` after shutdown began. Arguments as ``Engine.generate``'s (``processing``: its
        logprobs, prompt_logprobs, penalties and constraint, ``jobs.PROCESSING``); ``request_id`` names the request
        in events and listener records (default: "req-<n>")."""
        if self._closing:
            raise SchedulerClosedError("the scheduler is shutting down: it takes no new requests")
        options = options if options is not None else RequestOptions()
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop=stop, seed=seed, chat=chat)
        request, kv_tokens = new_request(self.engine, prompt, max_new_tokens, options, self._arm_names,
                                         self.verifier.cache, self.max_draft_nodes, **sampling, **processing)
        with self._lock:
            if self._closing:
                raise SchedulerClosedError("the scheduler is shutting down: it takes no new requests")
            if len(self._waiting) >= self.max_queue + max(self._max_batch - self.running, 0):  # free slots fill first
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            handle = RequestHandle(rid, request.prompt_ids, self)
            job = Job(handle, request, options)
            job.kv_tokens = kv_tokens
            self._waiting.append(job)
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
        self.shutdown() if exc_type is None else self.close()

    # ------------------------------------------------------------------ the scheduler thread
    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _expired(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _run(self) -> None:
        # in inference mode: the batched cache's buffers are made at admission, written in place by forwards and moves
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
                    refused = self._admit()
                try:
                    for job in cancelled:
                        self._leave(job, "cancelled")
                    for job, error in refused:
                        self._leave(job, "error", error)
                    for job in [j for j in self._prefilling + self._running if j.handle.cancelled or self._expired()]:
                        self._leave(job, "cancelled")
                    if self._prefilling or self._running:
                        self._step()
                except Exception as e:  # noqa: BLE001 - a step broke outside a request's own work: its requests fail
                    log.exception("a scheduler step failed; its requests fail, the scheduler goes on")
                    self.failed_steps += 1
                    self._fail_started(e)
                tidy_memory(self.verifier.cache, self.prefix_cache)
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

    def _admit(self) -> list[tuple[Job, Exception]]:
        """(Holding the lock.) Queued requests start, first come first served, while ``max_batch`` and the KV budget
        leave room: each reserves its KV rows now, all or nothing. One whose admission failed (its allocation, or
        anything else that raised while it was admitted) is returned with its error: it fails, nothing else changed,
        the scheduler goes on. The first that does not fit waits, and those behind it too."""
        refused = []
        cache = self.verifier.cache
        while self._waiting and len(self._prefilling) + len(self._running) < self._max_batch:
            job = self._waiting[0]
            stored = self.prefix_cache  # stored prefixes give way (least recently used first) before a request waits
            try:
                if not cache.fits(job.kv_tokens) and not (stored is not None and stored.evict_for(job.kv_tokens)):
                    break
                self._waiting.popleft()
                cache.reserve(job, job.kv_tokens)
            except Exception as e:  # noqa: BLE001 - e.g. KVAllocationError: this request alone fails
                if self._waiting and self._waiting[0] is job:
                    self._waiting.popleft()
                log.error("request %s failed in its admission: %r", job.id, e, exc_info=not isinstance(
                    e, KVAllocationError))
                refused.append((job, e))
                continue
            self._prefilling.append(job)
        return refused

    def _step(self) -> None:
        """One step: a prefill chunk for joining requests, then drafts, one batched verification, commits."""
        t0 = time.perf_counter()
        prefill_tokens = self._prefill()
        running = list(self._running)
        drafts, plan = self._draft(running) if running else ({}, None)
        running = list(self._running)  # compact again: rows that failed while drafting left
        if not running:  # only prefills this step (reported: its prompt tokens count)
            self._notify(SchedulerStep(0, 0, prefill_tokens, self.queue_length, time.perf_counter() - t0))
            return
        batch = [drafts[id(j)] for j in running]
        t1 = time.perf_counter()
        try:
            outs = self.verifier.verify([j.request.pending for j in running], batch)
            read_choices(outs, batch)  # the step's one host read: every row's greedy choices and device drafts
        except Exception as e:  # noqa: BLE001 - the forward itself failed: every request in it fails
            log.exception("the batched verification failed")
            self.failed_steps += 1
            for job in running:
                self._leave(job, "error", e)
            return
        forward_s = time.perf_counter() - t1
        done, failed, records = [], [], []  # jobs that finished; (job, error) of those that failed; step records
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
            records.append(job.step_record())
            if finished:
                done.append(job)
        self.verifier.commit([j.slot for j in running])  # raising here fails every request of the step (_loop)
        self.failed_steps = 0
        for job in running:
            if not any(job is f for f, _ in failed):
                try:
                    job.handle._push(job.token_event())  # the tokens it committed since its last event
                except Exception as e:  # noqa: BLE001 - its text could not be streamed: it alone fails
                    log.exception("request %s failed while streaming its tokens", job.id)
                    failed.append((job, e))
                    done = [d for d in done if d is not job]
        for job, e in failed:
            self._leave(job, "error", e)
        for job in done:
            self._leave(job, job.request.stats.stop_reason)
        forward_tokens = math.prod(self.verifier.padded(len(running), max(rows_tokens)))  # the [B, N] forward, padded
        record = plan and self.adaptive.record(plan.alloc, [plan.nodes[id(j)] for j in running], forward_tokens,
                                               forward_s)
        self._notify(SchedulerStep(len(running), forward_tokens, prefill_tokens, self.queue_length,
                                   time.perf_counter() - t0, records, record))

    def _each(self, jobs: list[Job], fn, doing: str) -> dict[int, Any]:
        """``fn(job)`` for each job, by ``id(job)``; a job whose call fails leaves with its error (it alone fails)."""
        out: dict[int, Any] = {}
        for job in jobs:
            try:
                out[id(job)] = fn(job)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed while %s", job.id, doing)
                self._leave(job, "error", e)
        return out

    def _draft(self, running: list[Job]) -> tuple[dict, StepPlan | None]:
        """Every running request selects its arm (adapting: given the load, and the allocator gives each ``d_i``), then
        all draft together (``drafting.each_drafts``). Drafts by job, the step's ``StepPlan`` (None: not adapting)."""
        adaptive, fail = self.adaptive, lambda j, e: self._leave(j, "error", e)
        how = (self.engine.clock_device, self.batch_drafting)
        if adaptive is None:
            self._each(running, lambda j: j.request.select_arm(), "selecting its drafter")
            return each_drafts(list(self._running), lambda j: (None, False), fail, *how), None
        load = adaptive.load(len(running))  # [2] the same for every request of the step
        arms = self._each(running, lambda j: adaptive.select(j.request, load), "selecting its drafter")
        running = list(self._running)
        joining = len(self._prefilling) + min(self.queue_length, max(self._max_batch - self.running, 0))
        plan = adaptive.step_plan([id(j) for j in running], [arms[id(j)] for j in running],
                                  [j.request for j in running], joining)
        self._each([j for j in running if plan.arms[id(j)] is not arms[id(j)]],  # a probe's wider sibling arm
                   lambda j: j.request.switch_arm(plan.arms[id(j)]), "switching to a probe's arm")
        return each_drafts(list(self._running), lambda j: (plan.nodes[id(j)], plan.lookup[id(j)]), fail, *how), plan

    def _prefill(self) -> int:
        """Prefill joining requests, ``prefill_chunk`` prompt tokens in all, in turn: a request that used the chunk
        without finishing goes behind the others, so a long prompt does not hold back those that joined after it. A
        request whose prompt is in joins the batch, its first token sent. Returns the tokens prefilled."""
        budget, total, firsts = self.prefill_chunk, 0, []
        for job in list(self._prefilling):
            if budget <= 0:
                break
            try:
                if job.prefill is None:
                    self._start(job)
                n = job.prefill.step(budget)
                budget, total = budget - n, total + n
                if job.prefill.finished:
                    self.verifier.join(job.slot, job.prefill)
                    job.slot.hidden = job.prefill.hidden
                    scores, first, job.prefill = job.prefill.scores, getattr(job.prefill, "last_logits", None), None
                    with self._lock:
                        self._prefilling.remove(job)
                        self._running.append(job)
                    assert self._running[job.slot.row] is job
                    job.begun = True
                    job.request.prefilled(scores)
                    firsts += [(job, first)] if first is not None else []  # its first token: sent below, before a step
                else:
                    with self._lock:  # its turn is over: behind the other joiners
                        self._prefilling.remove(job)
                        self._prefilling.append(job)
            except Exception as e:  # noqa: BLE001
                log.exception("request %s failed in its prefill", job.id)
                self._leave(job, "error", e)
        for job, error in send_first_tokens(firsts):  # those that ended with it (or failed) leave
            self._leave(job, "error" if error else job.request.stats.stop_reason, error)
        return total

    def _start(self, job: Job) -> None:
        """A request leaves the queue: its forks of the pool, its view of the verifier, its episode, its prefill."""
        job.started_at = time.perf_counter()
        job.forks = self._free_forks.pop() if self._free_forks else Forks(self.engine.drafters, self.share_suffix_cache)
        job.forks.bind(job.request, job.options, self._arm_names)
        job.slot = SlotVerifier(self.engine.verifier, None)
        job.request.verifier = job.slot
        job.request.open()
        start_prefill(job, self.engine, self.verifier, self.prefix_cache)

    def _leave(self, job: Job, reason: str, error: BaseException | None = None) -> None:
        """The request leaves (finished, cancelled or failed): its drafters end, its row is freed (the last row moves
        into it), its forks go back to the free list (not after an error: their state is unknown), its last event."""
        with self._lock:
            if job in self._prefilling:
                self._prefilling.remove(job)
            row = job.slot.row if job.slot is not None and job in self._running else None
        if job.prefill is not None:  # it left during its prefill
            prefill, job.prefill = job.prefill, None
            self.verifier.abandon(prefill)
        if row is not None:
            moved = free_row(job, self.verifier, self.prefix_cache if error is None else None)
            with self._lock:
                last = self._running.pop()
                if moved is not None:
                    self._running[row] = last
                    last.slot.row = row
        self.verifier.cache.release(job)
        reason, error = job.end(reason, error)
        if job.forks is not None and error is None:
            self._free_forks.append(job.forks)
        job.forks = None
        event, record = job.last_event(reason, error)
        job.handle._push(event)
        self._notify(record)

    def _fail_started(self, error: Exception) -> None:
        """After a step broke outside any one request's work: every started request fails with ``error`` and the
        batched cache drops every row (their state is unknown); requests still queued wait for the next step."""
        with self._lock:
            jobs = self._prefilling + self._running
        for job in jobs:
            try:
                self._leave(job, "error", error)
            except Exception:  # noqa: BLE001 - its row could not be freed: the rows are reset below
                log.exception("request %s could not leave cleanly", job.id)
                job.handle._push(TokenEvent([], "", True, "error", None, error))
        with self._lock:
            self._prefilling.clear()
            self._running.clear()
        self.verifier.reset()
        for job in jobs:
            self.verifier.cache.release(job)

    def _notify(self, record) -> None:
        for fn in list(self._listeners):
            try:
                fn(record)
            except Exception:  # noqa: BLE001
                log.exception("scheduler listener %r failed", fn)
