"""ASGI middleware that sees every HTTP answer (a 413 before the body is read and a 401 included): it counts it in
``/metrics`` (``http_requests_total``, ``http_request_duration_seconds``) and, unless turned off
(``--no-access-log``), logs one access line when the response is over (a stream: when its last event is sent or the
client went away)::

    [metasd serve] 127.0.0.1:53124 "POST /v1/chat/completions HTTP/1.1" 200 0.412s
"""
from __future__ import annotations

import logging
import time

access_log = logging.getLogger("metasd.serve.access")


class HttpObserver:
    """Counts and logs every HTTP request the app answers (``routes``: the app's paths, the ``handler`` label; any
    other path is counted as ``none``, so a scan of random paths adds no label values)."""

    def __init__(self, app, metrics, routes: set[str], log: bool = True):
        self.app, self.metrics, self.routes, self.log = app, metrics, routes, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500  # 500: the app failed before answering

        async def observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            seconds = time.perf_counter() - start
            path = scope.get("path", "")
            self.metrics.observe_http(scope.get("method", ""), path if path in self.routes else "none", status,
                                      seconds)
            if self.log:
                client = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s HTTP/%s" %d %.3fs', client[0], client[1], scope.get("method", ""),
                                path, scope.get("http_version", "1.1"), status, seconds)
