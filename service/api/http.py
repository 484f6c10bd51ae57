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

`HttpToolsProtocol` also sends package bytes with sendfile(2) (`SENDFILE`, an ASGI extension of ours): the kernel
copies them from the page cache to the socket, where a streamed answer costs the API a read into Python, a thread
hop per piece and a copy into the socket (bench/README.md "Verified pull": that was most of the API's CPU per GB).
`Sendfile` (the route's response) uses it where the server offers it and the blob lies in a local file, and streams
otherwise (h11, TLS, an S3 or Redis blob store, a test client). A client that takes no bytes for
AOTC_SEND_STALL_S is cut off (the connection closed), as it would hold a thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import h11
from fastapi import HTTPException
from starlette.responses import Response
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
    return _raw(b"408 Request Timeout", "request_timeout", message)


def _raw(status: bytes, code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
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
        """uvicorn's httptools protocol, with the same AOTC_HEADER_TIMEOUT_S as HTTPProtocol, and AOTC_MAX_HEADER_KB
        on a request's line and headers: httptools has no limit, and it parsed a 128 MiB header on the event loop
        for 21 s (each header value grows by concatenation), so the bytes of a request's head are counted before
        they are parsed, and the parser never sees more than the limit of them."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_body = False  # between a request's headers and its end
            self._max_head = get_settings().max_header_kb * KIB
            self._head = 0  # bytes of the current request's line and headers fed to the parser so far

        def data_received(self, data: bytes) -> None:
            while data:
                if self._in_body:  # a body's bytes (and what follows them in this read): bounded elsewhere
                    super().data_received(data)
                    return
                room = self._max_head - self._head
                if room <= 0:
                    self.transport.write(_raw(b"431 Request Header Fields Too Large", "headers_too_large",
                                              f"the request line and headers passed {self._max_head} bytes "
                                              f"(AOTC_MAX_HEADER_KB={self._max_head // KIB})"))
                    self._unset_keepalive_if_required()
                    self.transport.close()
                    return
                piece, data = data[:room], data[room:]
                self._head += len(piece)
                super().data_received(piece)
                if self.transport.is_closing():
                    return

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            # Plain TCP only: under TLS the bytes must pass through the transport's encryption.
            plain = sock is not None and transport.get_extra_info("sslcontext") is None
            self._fd = sock.fileno() if plain and get_settings().sendfile else -1

        def on_headers_complete(self) -> None:
            self._in_body = True
            self._head = 0
            self._disarm()  # the route's own time starts
            if self._fd >= 0:
                self.scope["extensions"] = {**(self.scope.get("extensions") or {}), SENDFILE: {}}
            super().on_headers_complete()
            cycle = self.cycle
            if self._fd >= 0 and cycle is not None and cycle.scope is self.scope:  # this request's cycle
                cycle.send = _with_sendfile(cycle, self.transport, self._fd, get_settings().send_stall_s)

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def _headers_pending(self) -> bool:
            return not self._in_body


SENDFILE = "aotc.sendfile"  # the extension; its message: {"type": SENDFILE, "file": ..., "offset": ..., "count": ...}
_SENDERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="aotc-sendfile")  # each mostly waits on its socket


def _with_sendfile(cycle: Any, transport: asyncio.Transport, fd: int, stall_s: float) -> Any:
    """`cycle.send` that also takes a SENDFILE message: the file's bytes, after the head the route sent."""
    plain = cycle.send

    async def send(message: Message) -> None:
        if message["type"] != SENDFILE:
            await plain(message)
            return
        count = int(message["count"])
        # The head went through the transport: what the socket did not take at once is still in its buffer, and
        # must leave before the file's bytes.
        waited = 0.0
        while transport.get_write_buffer_size() and not transport.is_closing() and waited < stall_s:
            await asyncio.sleep(0.005)
            waited += 0.005
        try:
            if transport.is_closing() or transport.get_write_buffer_size():
                raise ConnectionError("closed, or the head not taken within AOTC_SEND_STALL_S")
            # The thread writes to a duplicate of the socket's descriptor, and closes it itself: if the loop closes
            # the connection meanwhile (the client reset it), the number may be reused by another client's
            # connection, but the duplicate still names this one, so its bytes can only fail, never reach someone
            # else.
            own = os.dup(fd)
            sending = _SENDERS.submit(_sendfile, own, message["file"], int(message["offset"]), count, stall_s)
            try:
                await asyncio.wrap_future(sending)
            except asyncio.CancelledError:
                if sending.cancel():  # never started: the thread will not close it
                    os.close(own)
                raise
        except OSError:
            # The client went, stalled, or the file came up short: the answer is cut off, as a streamed one
            # would be (a client resumes with a Range; its sha256 check catches a short file).
            transport.abort()
            for _ in range(3):  # let connection_lost mark the cycle disconnected before the app returns
                await asyncio.sleep(0)
            return
        cycle.expected_content_length -= count  # uvicorn's own count of the body still owed
        await plain({"type": "http.response.body", "body": b"", "more_body": False})

    return send


def _sendfile(sock: int, f: BinaryIO, offset: int, count: int, stall_s: float) -> None:
    """sendfile(2) on the non-blocking socket (a duplicate descriptor, closed here) until `count` bytes went;
    OSError if the client takes none for `stall_s` or the file ends first. Runs in a thread: the event loop never
    waits on it."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        src = f.fileno()
        while count > 0:
            try:
                sent = os.sendfile(sock, src, offset, min(count, 1 << 30))
            except BlockingIOError:
                if not poller.poll(stall_s * 1000):
                    raise TimeoutError(f"the client took no bytes for {stall_s:g} s (AOTC_SEND_STALL_S)") from None
                continue
            if sent == 0:
                raise ConnectionError("the file is shorter than its manifest")  # cut off, as below
            offset += sent
            count -= sent
    finally:
        os.close(sock)  # the duplicate `send` made for this thread


class Sendfile(Response):
    """`count` bytes of an open file from `offset`, sent with sendfile(2): only where the request's scope offers
    SENDFILE (`offers_sendfile`). The file is closed once sent."""

    def __init__(self, f: BinaryIO, offset: int, count: int, status_code: int, headers: dict[str, str],
                 media_type: str) -> None:
        self.f, self.offset, self.count = f, offset, count
        super().__init__(status_code=status_code, headers=headers, media_type=media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": SENDFILE, "file": self.f, "offset": self.offset, "count": self.count})
        finally:
            self.f.close()


def offers_sendfile(scope: Scope) -> bool:
    return SENDFILE in (scope.get("extensions") or {})


def protocol(choice: str) -> str:
    """uvicorn's `http` argument for AOTC_HTTP: `httptools`, `h11`, or `auto` (httptools when installed)."""
    if choice == "h11" or (choice == "auto" and _HttpTools is None):
        return "service.api.http:HTTPProtocol"
    if _HttpTools is None:
        raise RuntimeError("AOTC_HTTP=httptools, but httptools is not installed (pip install 'aotc[server]')")
    return "service.api.http:HttpToolsProtocol"


class BodyTooLarge(HTTPException):
    """413 for a request body over AOTC_MAX_BODY_KB, raised from the body's `receive`: as RequestTimeout, FastAPI's
    own body reading passes it on, so a JSON body is refused before the key is checked, and its connection closed."""

    def __init__(self, message: str) -> None:
        super().__init__(413, detail=message, headers={"Connection": "close"})


# Routes whose bodies have a limit of their own (the upload: AOTC_MAX_UPLOAD_MB, spooled to disk as it arrives).
OWN_BODY_LIMIT = frozenset({("POST", "/v1/models")})


class BodyDeadlines:
    """ASGI middleware: AOTC_BODY_IDLE_TIMEOUT_S and AOTC_BODY_MIN_RATE_KBPS on request bodies, and AOTC_MAX_BODY_KB
    on every body but an upload's."""

    def __init__(self, app: ASGIApp, idle_s: float, min_rate_kbps: float, max_body_kb: int | None = None) -> None:
        self.app = app
        self.idle_s = idle_s
        self.min_bytes = min_rate_kbps * KIB * idle_s  # per window of idle_s spent waiting
        self.max_body = max_body_kb * KIB if max_body_kb else None

    def _cap(self, scope: Scope) -> int | None:
        if self.max_body is None or (scope["method"], scope["path"]) in OWN_BODY_LIMIT:
            return None
        return self.max_body

    def _too_large(self, what: str) -> BodyTooLarge:
        return BodyTooLarge(f"the request body {what}; the limit is {self.max_body} bytes on this route "
                            f"(AOTC_MAX_BODY_KB={(self.max_body or 0) // KIB})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        done = False
        window_s, window_bytes, total = 0.0, 0, 0
        cap = self._cap(scope)

        async def timed_receive() -> Message:
            nonlocal done, window_s, window_bytes, total
            if done:  # the body is in: what follows is the wait for a disconnect (streaming answers)
                return await receive()
            if cap is not None and total == 0:  # the first read of the body (a route that reads none pays nothing)
                said = next((v for k, v in scope["headers"] if k == b"content-length"), None)
                if said is not None and (not said.isdigit() or len(said) > 18 or int(said) > cap):
                    raise self._too_large(f"is {said[:30].decode('latin-1')} bytes")
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
            if message["type"] == "http.request" and cap is not None:
                total += len(message.get("body", b""))
                if total > cap:  # chunked, or more than its Content-Length said (the server cuts that, too)
                    raise self._too_large(f"passed {cap} bytes")
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
