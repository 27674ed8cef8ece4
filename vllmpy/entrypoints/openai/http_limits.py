"""What the HTTP layer bounds: how long a request may take to arrive, how many connections are open, and
how many requests are in flight.

uvicorn's h11 protocol arms its keep-alive timer only after a response and cancels it on the first byte
received, so a socket that connects and sends nothing, or trickles a request line, is held forever; and
its `limit_concurrency` counts open connections too, so a few hundred idle sockets would turn every real
request into a 503. Here idle and half-sent requests are timed out, connections past a cap are closed as
soon as they are accepted (the file descriptors stay bounded), and the in-flight cap counts requests only.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllmpy.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("vllmpy.server")

# Never refused by the in-flight cap: a saturated server must not look dead to its health checks.
MONITORING_PATHS = frozenset({"/health", "/metrics", "/version"})


@dataclass(frozen=True)
class ConnectionLimits:
    request_read_timeout: float  # seconds from a request's first byte to its last (line, headers, body)
    max_connections: int  # open connections; one accepted past this is closed at once


def error_json(message: str, status: HTTPStatus) -> bytes:
    """An OpenAI-shaped error body, for answers written below the FastAPI app."""
    info = ErrorInfo(message=message, type=status.phrase.replace(" ", "") + "Error", code=status)
    return ErrorResponse(error=info).model_dump_json().encode()


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the request-read deadline and the connection cap (pass as `http=`)."""
    refusing = False  # shared by every connection: log once when the cap starts refusing, not per socket

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            nonlocal refusing
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                if not refusing:
                    logger.warning("%d connections open: refusing new ones (--limit-connections %d)",
                                   len(self.connections) - 1, limits.max_connections)
                refusing = True
                transport.close()
                return
            refusing = False
            # A connection that never sends a byte is idle like a kept-alive one: same timeout.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track_request_read()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track_request_read()  # a pipelined request may already be half read

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_deadline()
            super().connection_lost(exc)

        def _track_request_read(self) -> None:
            """Run the deadline while a request is partly received: its line or headers are buffered, or
            its body is still coming."""
            state = self.conn.their_state
            reading = state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))
            if not reading:
                self._cancel_read_deadline()
            elif self._read_deadline is None:
                self._read_deadline = self.loop.call_later(limits.request_read_timeout, self._read_timed_out)

        def _cancel_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self.transport.is_closing():
                return
            responding = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
            if not responding:
                body = error_json(f"the request did not arrive whole within {limits.request_read_timeout:g} s "
                                  "(--timeout-request-read)", HTTPStatus.REQUEST_TIMEOUT)
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return GuardedH11Protocol


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` requests in flight (a stream counts until its last event); one past
    it is answered 503 at once, which the openai client retries. Monitoring routes are never refused."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in MONITORING_PATHS:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            body = error_json(f"the server is at its limit of {self.limit} requests in flight "
                              "(--limit-concurrency); retry later", HTTPStatus.SERVICE_UNAVAILABLE)
            await send({"type": "http.response.start", "status": HTTPStatus.SERVICE_UNAVAILABLE,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
