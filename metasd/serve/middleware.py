"""The app's ASGI middleware: bounds on a request body (its size and the time it takes to arrive), and a header
naming the server that answered."""
from __future__ import annotations

import asyncio
import json
import time

from .errors import ApiError

#: the largest request body read (bytes); a larger one is refused with 413 before it is parsed
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
#: seconds a client has to send its whole request body, from the first read; a slower one gets 408 (nginx's
#: ``client_body_timeout`` is 60 s between two reads: a total bounds a client that trickles a byte a minute too)
DEFAULT_BODY_TIMEOUT_S = 60.0


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413 - at once when its Content-Length says
    so, else as soon as what arrived passes it - before anything parses it; a body not complete ``timeout`` seconds
    after the app first reads it is refused with 408 (a client that sends slowly holds a connection, never the
    scheduler: nothing is submitted before the body is parsed). Reads after the body (a stream's wait for the client
    to disconnect) are not bounded."""

    def __init__(self, app, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT_S):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await send_error(send, too_large(self.limit))
        seen, complete, deadline = 0, False, None

        async def counted():
            nonlocal seen, complete, deadline
            if complete:
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise ApiError(408, f"the request body did not arrive within the server's {self.timeout:g} s",
                               code="body_timeout") from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large(self.limit)
                complete = not message.get("more_body", False)
            else:  # http.disconnect: nothing more will come
                complete = True
            return message

        await self.app(scope, counted, send)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit} bytes", code="body_too_large")


async def send_error(send, error: ApiError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class ServerHeader:
    """ASGI middleware: every response names the server that answered (``x-metasd-server``), e.g. a Ray replica."""

    def __init__(self, app, value: str):
        self.app, self.header = app, (b"x-metasd-server", value.encode())

    async def __call__(self, scope, receive, send):
        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_named if scope["type"] == "http" else send)
