"""``/metrics``: Prometheus metrics under vLLM's names, fed by the scheduler's listener (docs/serving.md#metrics).

vLLM's v1 names (vllm/v1/metrics/loggers.py), with its labels ``model_name`` and ``engine``: the spec-decode
counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
``..._num_accepted_tokens_per_pos`` (label ``position``; a counter, so exposed with ``_total``), the histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and ``vllm:e2e_request_latency_seconds``,
the gauges ``vllm:num_requests_waiting`` (the queue) and ``vllm:num_requests_running`` (the batch), the
``vllm:prompt_tokens`` / ``vllm:generation_tokens`` counters and ``vllm:request_success`` (label ``finished_reason``);
plus ``metasd:drafter_choices`` (label ``drafter``):
how many request-steps each drafter drafted; ``vllm:kv_cache_usage_perc`` (the KV memory held, a fraction of the
budget); ``metasd:verify_fixed_shapes``, ``metasd:verify_graphs_captured``, ``metasd:verify_graph_capture_seconds``
and ``..._bytes`` (the batched verify forward's shapes and CUDA graphs, where the verifier runs fixed shapes);
``metasd:draft_fixed_shapes``, ``metasd:draft_graphs_captured``, ``metasd:draft_graph_capture_seconds`` and
``metasd:draft_rows_bytes`` (label ``drafter``: each model drafter's drafting levels over its rows, where it runs
fixed shapes).
Beside them, as vLLM's server exposes them: the process's own metrics (``process_*``, ``python_gc_*``,
``python_info``) and ``http_requests_total`` (labels ``handler``, ``method``, ``status`` as ``2xx``...) with
``http_request_duration_seconds``, prometheus-fastapi-instrumentator's names. Each server has its own
``CollectorRegistry``.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from metasd.core.execution.draft_rows import draft_rows_of

# vLLM's buckets for these histograms
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
#: the scheduler's finish reasons as vLLM's ``finished_reason`` label names them
_VLLM_FINISHED = {"stop": "stop", "eos": "stop", "length": "length", "cancelled": "abort"}


class ServeMetrics:
    """The server's Prometheus metrics in a registry of their own. ``attach(scheduler)`` registers ``on_record`` as
    the scheduler's listener and reads the queue and batch gauges from it at each scrape."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels, values = ["model_name", "engine"], [model_name, "0"]
        r = self.registry

        def counter(name, doc, extra=()):
            c = Counter(name, doc, labels + list(extra), registry=r)
            return c if extra else c.labels(*values)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self._values, self.labels = values, dict(zip(labels, values))
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: this process's
            try:
                r.register(collector)
            except ValueError:  # pragma: no cover - already there
                pass
        self.http_requests = Counter("http_requests", "Total number of requests by method, status and handler.",
                                     ["method", "status", "handler"], registry=r)
        self.http_duration = Histogram("http_request_duration_seconds", "Latency of HTTP requests by handler.",
                                       ["method", "handler"], registry=r)
        self.kv_usage_gauge = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: the fraction of the KV budget held "
                                                                "(1 = full).", labels, registry=r).labels(*values)
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts (request-steps that "
                                                             "verified a draft).")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens (tree nodes).")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft token position.", ["position"])
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries: prompt tokens looked up "
                                                                   "(whole prompts of the requests that consulted it).")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits: prompt tokens found in the cache, "
                                                             "not prefilled again.")
        self.drafter_prefix_hits = counter("metasd:drafter_prefix_cache_hits", "Drafter cache positions requests "
                                           "started with from the prefix cache, not read again (summed over drafters).")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests "
                                                               "(cancelled: abort).", ["finished_reason"])
        self.drafter_choices = Counter("metasd:drafter_choices", "Request-steps drafted by each drafter.",
                                       labels + ["drafter"], registry=r)
        self.lookup_only = counter("metasd:lookup_only_steps", "Request-steps the allocator had drafted by the arm's "
                                                               "lookups alone (serving.defer_catch_up).")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _E2E_BUCKETS)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=r).labels(*values)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                             registry=r).labels(*values)
        # the batched verify forward at fixed shapes (core/execution/batch_runner.py; 0 where it runs exact shapes)
        self.graph_gauges = {key: Gauge(name, doc, labels, registry=r).labels(*values) for key, name, doc in (
            ("shapes", "metasd:verify_fixed_shapes", "(rows, tokens, width) shapes the batched verify forward met."),
            ("captured", "metasd:verify_graphs_captured", "CUDA graphs of the verify forward captured (recaptures "
                                                          "after the KV buffers were reallocated included)."),
            ("capture_s", "metasd:verify_graph_capture_seconds", "Seconds spent capturing them."),
            ("capture_bytes", "metasd:verify_graph_capture_bytes", "Bytes the CUDA allocator reserved while "
                                                                   "capturing them."))}
        # each model drafter's drafting levels at fixed shapes over its forks' rows (core/execution/draft_rows.py)
        self.draft_gauges = {key: Gauge(name, doc, labels + ["drafter"], registry=r) for key, name, doc in (
            ("shapes", "metasd:draft_fixed_shapes", "Shapes the drafter's levels and whole-tree loops met."),
            ("captured", "metasd:draft_graphs_captured", "CUDA graphs of its levels and loops captured (recaptures "
                                                         "after its rows were reallocated included)."),
            ("capture_s", "metasd:draft_graph_capture_seconds", "Seconds spent capturing them."),
            ("bytes", "metasd:draft_rows_bytes", "Bytes its rows' KV buffers hold."))}
        self._last_step: dict[Any, float] = {}  # request id -> when its previous step ended (inter-token latency)
        self._finished: set = set()  # requests finished since the last step record
        self._lock = threading.Lock()
        self._prefix_seen = (0, 0, 0)  # the prefix cache's (queries, hits, drafter hits) already counted

    content_type = CONTENT_TYPE_LATEST

    def attach(self, scheduler) -> None:
        self._scheduler = scheduler
        self.waiting.set_function(lambda: scheduler.queue_length)
        self.running.set_function(lambda: scheduler.running)
        self.kv_usage_gauge.set_function(lambda: self.kv_usage() or 0.0)
        for key, gauge in self.graph_gauges.items():
            gauge.set_function(lambda key=key: self.graph_stat(key))
        for rows in draft_rows_of(scheduler.engine.all_drafters):  # labelled with their drafter's name
            for key, gauge in self.draft_gauges.items():
                gauge.labels(*self._values, rows.name).set_function(lambda k=key, r=rows: draft_stat(r, k))
        scheduler.add_listener(self.on_record)

    def graph_stat(self, key: str) -> float:
        """One figure of the batched verify forward's fixed shapes (``graph_gauges``); 0 where it has none."""
        runner = getattr(getattr(self._scheduler, "verifier", None), "runner", None)
        if runner is None:
            return 0.0
        return float(len(runner.shapes) if key == "shapes" else getattr(runner.stats, key))

    def kv_usage(self) -> float | None:
        """The KV memory held as a fraction of the budget (None: no budget, or not attached)."""
        try:
            cache = self._scheduler.verifier.cache
            return cache.held_bytes / cache.budget_bytes if cache.budget_bytes else None
        except (AttributeError, RuntimeError):  # not attached; the reservations changed while summed
            return None

    def observe_http(self, method: str, handler: str, status: int, seconds: float) -> None:
        """One answered HTTP request (``handler``: the route, or ``none`` for a path the app does not serve)."""
        self.http_requests.labels(method, f"{status // 100}xx", handler).inc()
        self.http_duration.labels(method, handler).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ the scheduler's records
    def on_record(self, record) -> None:
        """The scheduler's listener: a step's record or a finished request's."""
        if hasattr(record, "requests"):
            self.on_step(record)
        else:
            self.on_finished(record)

    def on_step(self, step) -> None:
        """A ``SchedulerStep``: each request's draft and acceptance, its drafter, its new tokens and the time since
        its previous step (the inter-token latency, per committed token as vLLM observes it per iteration)."""
        now = time.monotonic()
        for r in step.requests:
            if r.drafted:
                self.drafts.inc()
                self.draft_tokens.inc(r.drafted)
                self.accepted_tokens.inc(r.accepted)
                for pos, ok in enumerate(r.accepted_per_position):
                    if ok:
                        self.accepted_per_pos.labels(*self._values, str(pos)).inc()
            if r.drafter:
                self.drafter_choices.labels(*self._values, r.drafter).inc()
            if r.committed:
                self.generation_tokens.inc(r.committed)
                with self._lock:
                    before, self._last_step[r.id] = self._last_step.get(r.id), now
                if before is not None:
                    self.itl.observe((now - before) / r.committed)
        lookup_only = sum(o > 0 for o in getattr(step.adaptive, "options", ()))  # step.adaptive: None unless adapting
        if lookup_only:
            self.lookup_only.inc(lookup_only)
        with self._lock:  # requests that finished in this step (or before it) have no later step
            for rid in self._finished:
                self._last_step.pop(rid, None)
            self._finished.clear()

    def on_finished(self, done) -> None:
        """A ``RequestFinished``: its prompt tokens, finish reason, time to first token and end-to-end latency. It may
        come before the record of the step it finished in, so its inter-token clock is dropped after the next step."""
        with self._lock:
            self._finished.add(done.id)
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc((done.record or {}).get("prefill_committed", 0))  # its first, drawn with the prefill
        store = getattr(getattr(self, "_scheduler", None), "prefix_cache", None)
        if store is not None:  # the prefix cache's own counts (one definition: PrefixCacheStats), passed on as they grow
            seen, self._prefix_seen = self._prefix_seen, (store.stats.queries, store.stats.hits, store.stats.drafter_hits)
            for metric, now, before in zip((self.prefix_queries, self.prefix_hits, self.drafter_prefix_hits),
                                           self._prefix_seen, seen):
                metric.inc(now - before)
        reason = _VLLM_FINISHED.get(done.finish_reason)
        if reason:  # a failed request is no success
            self.request_success.labels(*self._values, reason).inc()
        if done.ttft_s is not None:
            self.ttft.observe(done.ttft_s)
        self.e2e.observe(done.e2e_s)


def draft_stat(rows, key: str) -> float:
    """One figure of a drafter's ``DraftRows`` (``draft_gauges``): its levels' runner and its whole-tree loops."""
    if key == "bytes":
        return float(rows.held_bytes)
    runners = [rows.runner, *rows.loops.values()]
    return float(sum(len(r.shapes) if key == "shapes" else getattr(r.stats, key) for r in runners))
