"""uvicorn, with a graceful drain on SIGTERM / SIGINT (docs/serving.md#shutdown).

uvicorn's own handler stops listening at once. Here the first signal stops admission instead: the server keeps
listening, answers new generation requests with 503 (``/health`` too, so a load balancer stops sending), lets the
scheduler finish the running and queued requests within the drain timeout (it cancels what is left then), and only
then stops uvicorn, which waits for the last responses to be sent. The process then exits 0. A second signal stops
at once.
"""
from __future__ import annotations

import sys
import threading

import uvicorn


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose exit signals drain ``scheduler`` (through the app's ``ServeState``) first."""

    def __init__(self, config: uvicorn.Config, state, scheduler, drain_timeout: float, announce: bool = True):
        super().__init__(config)
        self.state, self.scheduler, self.drain_timeout, self.announce = state, scheduler, drain_timeout, announce
        self._drainer: threading.Thread | None = None
        self.drained = threading.Event()

    def handle_exit(self, sig, frame) -> None:  # uvicorn's signal handler (main thread)
        if self._drainer is None:
            self.begin_drain()
        else:  # a second signal: stop now, cancelling what still runs
            self.should_exit = self.force_exit = True

    def begin_drain(self) -> None:
        """Stop admission and drain in a thread; uvicorn stops when the scheduler is done."""
        if self._drainer is None:
            self._drainer = threading.Thread(target=self._drain, name="metasd-drain", daemon=True)
            self._drainer.start()

    def _drain(self) -> None:
        self.state.begin_drain()
        print(f"[metasd serve] draining: new requests get 503; waiting up to {self.drain_timeout:g} s for the "
              f"running ones", file=sys.stderr, flush=True)
        try:
            self.scheduler.shutdown(self.drain_timeout)
        finally:
            self.drained.set()
            self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.announce and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"[metasd serve] listening on http://{host}:{port}", file=sys.stderr, flush=True)

    @property
    def port(self) -> int | None:
        """The port it listens on (after startup; the one the OS chose for port 0)."""
        return self.servers[0].sockets[0].getsockname()[1] if self.servers else None
