"""Deadlines for slow clients: a connection that sends its request slowly holds a socket and a task, and enough of
them take the API from everyone else (slowloris). Two parts:

- `HTTPProtocol` (uvicorn's h11 protocol) and `HttpToolsProtocol` (uvicorn's httptools one, the faster: the
  default when httptools is installed, AOTC_HTTP), each with a deadline on request headers
  (AOTC_HEADER_TIMEOUT_S). uvicorn has none: its keep-alive timeout starts only after a first answer, and stops
  at a request's first byte. The deadline runs from the connection's start, and on a kept-alive connection from
  the end of the previous answer; it stops once the headers are complete. When it passes, the connection is
  closed, after a 408 if part of a request came.
  It also bounds how long a client may go on sending the rest of a body that the answer did not need (a 413, a
  429): uvicorn discards it, and without a deadline would read it for as long as it came. `aotc-server` runs the API
  with it (`--api-workers 1` and the multi-process path both); an API started with plain `uvicorn` has no header
  deadline, the body deadlines below still apply.
- `BodyDeadlines`, ASGI middleware on the time a route waits for a request body: no bytes for
  AOTC_BODY_IDLE_TIMEOUT_S, or fewer than AOTC_BODY_MIN_RATE_KBPS on average over each AOTC_BODY_IDLE_TIMEOUT_S of
  waiting, is answered 408 naming the setting, and the connection closed. Only the time spent waiting for the
  client counts, so a route that is slow to take what came never makes a client look slow.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import h11
from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HttpTools
except ImportError:  # httptools is optional: AOTC_HTTP=auto then serves with h11
    _HttpTools = None  # type: ignore[assignment,misc]

from service.api.settings import get_settings

KIB = 1024


class RequestTimeout(HTTPException):
    """408: the client did not send its request in time. FastAPI's HTTPException, so that FastAPI's own body reading
    (a JSON body) passes it on instead of answering 400; service/api/errors.py renders it as JSON."""

    def __init__(self, message: str) -> None:
        super().__init__(408, detail=message, headers={"Connection": "close"})


def _raw_408(message: str) -> bytes:
    """A whole 408 answer, written on the socket itself: no request exists yet for uvicorn to answer."""
    body = json.dumps({"error": {"code": "request_timeout", "message": message}}, separators=(",", ":")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _HeaderDeadline:
    """AOTC_HEADER_TIMEOUT_S for a uvicorn HTTP protocol (mixed in before it): armed when a connection opens and when
    an answer ends with no request in flight, disarmed once a request's headers are complete (each protocol says
    when). A 408 goes only to a request that has begun and whose headers are not complete: an idle connection is
    just closed, as is one still sending a body after its answer (a second answer would confuse the client)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_s = get_settings().header_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes came while the deadline ran

    def _headers_pending(self) -> bool:
        """Whether a request has begun and its headers are not complete (after a byte came)."""
        raise NotImplementedError

    def _unset_keepalive_if_required(self) -> None:
        super()._unset_keepalive_if_required()  # type: ignore[misc]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._deadline is not None:
            self._partial = True
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  # may start a pipelined request, headers complete
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._partial = False
        self._deadline = self.loop.call_later(self._header_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._partial and self._headers_pending():
            self.transport.write(_raw_408(
                f"the request headers were not complete within {self._header_s:g} s (AOTC_HEADER_TIMEOUT_S)"))
        self._unset_keepalive_if_required()
        self.transport.close()


class HTTPProtocol(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol, with AOTC_HEADER_TIMEOUT_S on the request headers (see the module's docstring)."""

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: the route's own time starts
            self._disarm()

    def _headers_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE


if _HttpTools is not None:

    class HttpToolsProtocol(_HeaderDeadline, _HttpTools):
        """uvicorn's httptools protocol, with the same AOTC_HEADER_TIMEOUT_S as HTTPProtocol."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_body = False  # between a request's headers and its end

        def on_headers_complete(self) -> None:
            self._in_body = True
            self._disarm()  # the route's own time starts
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def _headers_pending(self) -> bool:
            return not self._in_body


def protocol(choice: str) -> str:
    """uvicorn's `http` argument for AOTC_HTTP: `httptools`, `h11`, or `auto` (httptools when installed)."""
    if choice == "h11" or (choice == "auto" and _HttpTools is None):
        return "service.api.http:HTTPProtocol"
    if _HttpTools is None:
        raise RuntimeError("AOTC_HTTP=httptools, but httptools is not installed (pip install 'aotc[server]')")
    return "service.api.http:HttpToolsProtocol"


class BodyDeadlines:
    """ASGI middleware: AOTC_BODY_IDLE_TIMEOUT_S and AOTC_BODY_MIN_RATE_KBPS on request bodies."""

    def __init__(self, app: ASGIApp, idle_s: float, min_rate_kbps: float) -> None:
        self.app = app
        self.idle_s = idle_s
        self.min_bytes = min_rate_kbps * KIB * idle_s  # per window of idle_s spent waiting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        done = False
        window_s, window_bytes = 0.0, 0

        async def timed_receive() -> Message:
            nonlocal done, window_s, window_bytes
            if done:  # the body is in: what follows is the wait for a disconnect (streaming answers)
                return await receive()
            short = window_bytes < self.min_bytes
            limit = self.idle_s - window_s if short else self.idle_s
            t0 = time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), limit)
            except TimeoutError:
                if limit >= self.idle_s:
                    raise RequestTimeout(f"the request body sent nothing for {self.idle_s:g} s "
                                         "(AOTC_BODY_IDLE_TIMEOUT_S)") from None
                raise self._too_slow(window_bytes) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
                return message
            window_s += time.monotonic() - t0
            window_bytes += len(message.get("body", b""))
            if window_s >= self.idle_s:
                if window_bytes < self.min_bytes:
                    raise self._too_slow(window_bytes)
                window_s, window_bytes = 0.0, 0
            return message

        await self.app(scope, timed_receive, send)

    def _too_slow(self, got: int) -> RequestTimeout:
        return RequestTimeout(
            f"the request body came at {got / KIB / self.idle_s:.2f} KiB/s over {self.idle_s:g} s; the minimum is "
            f"{self.min_bytes / KIB / self.idle_s:g} KiB/s (AOTC_BODY_MIN_RATE_KBPS)")
