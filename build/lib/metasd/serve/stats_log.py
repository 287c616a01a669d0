"""The server's log: a one-line summary of the last interval's work, as vLLM logs it (``--log-stats-interval``), and
the handler that sends the ``metasd.serve`` loggers (this one, the access log, ignored-field warnings) to stderr.

A line reads, over the interval since the previous one::

    [metasd serve] prompt 52.0 tokens/s, generation 31.4 tokens/s, running 2, waiting 0, KV 3.1% of budget,
    drafts accepted 61.0% (122 of 200 tokens), mean acceptance length 2.35

(one line in the log; the acceptance part only when something was drafted). Nothing is logged for an interval
without work: no request running, waiting, finished or started.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("metasd.serve.stats")

#: the counters the line reads (without the _total suffix), from ``ServeMetrics``'s registry
_COUNTERS = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:spec_decode_num_drafts",
             "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def log_to_stderr(level: int = logging.INFO) -> None:
    """The ``metasd.serve`` loggers at ``level`` on stderr, each line prefixed ``[metasd serve]`` (once)."""
    logger = logging.getLogger("metasd.serve")
    if not any(getattr(h, "_metasd", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[metasd serve] %(message)s"))
        handler._metasd = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)


class StatsLogger:
    """Every ``interval`` seconds (0: never), a line of what the server did since the last one, read from
    ``metrics`` (a ``ServeMetrics``) and the scheduler's queue and batch; ``line()`` is one such line (None: an idle
    interval). ``start()`` runs it on a daemon thread, ``stop()`` ends it."""

    def __init__(self, metrics, scheduler, interval: float = 10.0, clock=time.monotonic):
        self.metrics, self.scheduler, self.interval, self.clock = metrics, scheduler, interval, clock
        self._last, self._at = self._totals(), clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _totals(self) -> dict[str, float]:
        registry, labels = self.metrics.registry, self.metrics.labels
        return {name: registry.get_sample_value(name + "_total", labels) or 0.0 for name in _COUNTERS} | {
            "finished": sum(s.value for m in registry.collect() if m.name == "vllm:request_success"
                            for s in m.samples if s.name.endswith("_total"))}

    def line(self) -> str | None:
        """The summary of the interval since the previous call (or since the logger was made); None when idle."""
        now, totals = self.clock(), self._totals()
        delta = {k: totals[k] - self._last.get(k, 0.0) for k in totals}
        seconds = max(now - self._at, 1e-9)
        self._last, self._at = totals, now
        running, waiting = self.scheduler.running, self.scheduler.queue_length
        if not (running or waiting or any(delta.values())):
            return None
        parts = [f"prompt {delta['vllm:prompt_tokens'] / seconds:.1f} tokens/s",
                 f"generation {delta['vllm:generation_tokens'] / seconds:.1f} tokens/s",
                 f"running {running}", f"waiting {waiting}"]
        usage = self.metrics.kv_usage()
        if usage is not None:
            parts.append(f"KV {100 * usage:.1f}% of budget")
        drafted, accepted = delta["vllm:spec_decode_num_draft_tokens"], delta["vllm:spec_decode_num_accepted_tokens"]
        drafts = delta["vllm:spec_decode_num_drafts"]
        if drafted:
            parts.append(f"drafts accepted {100 * accepted / drafted:.1f}% ({accepted:.0f} of {drafted:.0f} tokens), "
                         f"mean acceptance length {1 + accepted / drafts:.2f}")
        return ", ".join(parts)

    def start(self) -> "StatsLogger":
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="metasd-stats-log", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                text = self.line()
            except Exception:  # noqa: BLE001 - a summary that fails must not stop the server
                log.exception("the stats line failed")
                continue
            if text:
                log.info("%s", text)
