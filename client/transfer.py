"""A package's bytes from the service (or the presigned URL it redirects to) onto disk, hashed on the way.

`Client.pull` used httpx's streaming body: its HTTP parser copies each piece several times (socket, h11's buffer,
httpx's re-chunking into 1 MB), so on 2 cores a verified pull ran at a third to a half of what plain HTTP delivered.
Here `http.client` reads the body straight into a few reused 1 MiB buffers (`readinto`): the calling thread
receives each block and writes it to the file, a helper thread hashes it meanwhile (both release the GIL), and the
block is reused once hashed, while it is still in the CPU's cache. There is no second pass over the file: the
sha256 that `Client.pull` checks is the one computed here. sha256 (about 0.5 s of CPU a GB here) and receiving plus
writing (about as much) then each take one core, where one thread doing all three would cap a pull near 1 GB/s.

Measured on 2 cores (bench/download.py, bench/README.md "Verified pull"): one thread doing all three, separate hash
and write threads, and receiving into an mmap of the destination were no faster, and took as much CPU or more.
Parallel ranges do not help here: sha256 is sequential, so bytes that arrive out of order would have to wait in
memory or be read back from the file, and the API process that serves them shares the same two cores.

Only plain `http://` and `https://` without a proxy take this path (`direct_ok`); a proxied URL, or a Client whose
`http` was replaced (a test's scripted transport), uses httpx as before.
"""

from __future__ import annotations

import http.client
import os
import queue
import ssl
import threading
import urllib.request
from collections.abc import Mapping
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import httpx

BLOCK = 1 << 20
BLOCKS = 4  # in flight: enough that neither thread waits for the other, few enough to stay in the CPU's caches


class Cutoff(httpx.TransportError):
    """The connection failed midway: what arrived is hashed and written, and a resume may start after it. An httpx
    TransportError, as the httpx path raises: callers (the CLI) catch one kind."""


class _Local(Exception):
    """The local file could not be written (a full disk): not the network's fault, so not resumed."""


class Restart(Exception):
    """What the partial file holds cannot be resumed (416, a whole body for a Range, another range): start over."""


class Refused(Exception):
    """The server answered with an error: its status and body, for the SDK's ClientError."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}")
        self.status, self.body = status, body


def direct_ok(url: str) -> bool:
    """Whether http.client may fetch `url` itself: http(s), and no proxy configured for its host (httpx would use
    one; so the httpx path is kept for those)."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return False
    proxies = urllib.request.getproxies()
    return not (proxies.get(u.scheme) or proxies.get("all")) or bool(urllib.request.proxy_bypass(u.hostname))


def _context() -> ssl.SSLContext:
    """The CA bundle httpx would use: SSL_CERT_FILE / SSL_CERT_DIR, else certifi's."""
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if not cafile and not capath:
        import certifi

        cafile = certifi.where()
    return ssl.create_default_context(cafile=cafile, capath=capath)


def _connect(url: str, timeout: float | None) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(url)
    target = (u.path or "/") + (f"?{u.query}" if u.query else "")
    if u.scheme == "https":
        return http.client.HTTPSConnection(u.hostname or "", u.port, timeout=timeout, context=_context()), target
    return http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout), target


def fetch(url: str, headers: Mapping[str, str], f: BinaryIO, digest: Any, have: int, *,
          timeout: float | None, redirect_headers: Mapping[str, str] | None = None) -> None:
    """GET `url` and append its body to `f` (which holds `have` bytes already, hashed into `digest`), hashing
    every byte written. One 307 (the S3 blob store's presigned URL) is followed with `redirect_headers` only: a
    presigned URL carries its own signature and must never see the API key. Raises Cutoff, Restart or Refused."""
    try:
        conn, target = _connect(url, timeout)
        try:
            conn.request("GET", target, headers=dict(headers))
            resp = conn.getresponse()
            if resp.status == 307 and redirect_headers is not None:
                location = resp.getheader("location") or ""
                resp.read()
                conn.close()
                if not direct_ok(location):
                    raise Refused(502, f"the redirect to {location!r} cannot be fetched directly".encode())
                return fetch(location, redirect_headers, f, digest, have, timeout=timeout, redirect_headers=None)
            _expect(resp, have)
            _drain(resp, f, digest)
        finally:
            conn.close()
    except _Local as e:
        raise e.__cause__ from None  # type: ignore[misc]
    except (OSError, http.client.HTTPException) as e:
        raise Cutoff(str(e) or type(e).__name__) from e


def _expect(resp: http.client.HTTPResponse, have: int) -> None:
    if resp.status == 416:
        resp.read()
        raise Restart
    if not 200 <= resp.status < 300:
        raise Refused(resp.status, resp.read(64 << 10))
    if have and resp.status == 200:  # the whole body after all (If-Range did not match)
        raise Restart
    if resp.status == 206 and not (resp.getheader("content-range") or "").startswith(f"bytes {have}-"):
        raise Restart


def _drain(resp: http.client.HTTPResponse, f: BinaryIO, digest: Any) -> None:
    """Read the body block by block into a few reused buffers: this thread receives and writes each block, a helper
    hashes it meanwhile, and the block is reused once hashed. On a failure midway, what filled the block so far is
    kept too (written and hashed), so a resume starts right after the last byte received."""
    bufs = [memoryview(bytearray(BLOCK)) for _ in range(BLOCKS)]
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    hashing: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    for i in range(BLOCKS):
        free.put(i)
    failed: list[BaseException] = []

    def hasher() -> None:
        while (item := hashing.get()) is not None:
            i, n = item
            try:
                digest.update(bufs[i][:n])
            except BaseException as e:  # noqa: BLE001 - handed to the receiving thread
                failed.append(e)
            free.put(i)

    helper = threading.Thread(target=hasher, name="aotc-pull-hash", daemon=True)
    helper.start()
    try:
        while not failed:
            i = free.get()
            n = 0
            try:
                while n < BLOCK:
                    got = resp.readinto(bufs[i][n:])
                    if not got:
                        break
                    n += got
            finally:
                try:
                    if n:
                        f.write(bufs[i][:n])
                    f.flush()
                except OSError as e:
                    raise _Local from e
                finally:
                    if n:
                        hashing.put((i, n))
                    else:
                        free.put(i)
            if n < BLOCK:
                break
    finally:
        hashing.put(None)
        helper.join()
    if failed:
        raise failed[0]
