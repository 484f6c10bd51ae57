"""A package's bytes from the service (or the presigned URL it redirects to) onto disk, hashed on the way.

`Client.pull` used httpx's streaming body: its HTTP parser copies each piece several times (socket, h11's buffer,
httpx's re-chunking into 1 MB), so on 2 cores a verified pull ran at a third to a half of what plain HTTP delivered.
Here `http.client` reads the body straight into a few reused 1 MiB buffers (`readinto`): the calling thread
receives each block and writes it to the file, a helper thread hashes it meanwhile (both release the GIL), and the
block is reused once hashed, while it is still in the CPU's cache. There is no second pass over the file: the
digest that `Client.pull` checks is the one computed here (BLAKE3 where the manifest signs one, else sha256:
compiler/digests.py). Hashing and receiving plus writing then each take a core, where one thread doing all of it
would cap a pull near 1 GB/s.

Measured on 2 cores (bench/download.py, bench/README.md "Verified pull"): one thread doing all three, separate hash
and write threads, and receiving into an mmap of the destination were no faster, and took as much CPU or more.
Ranges over several connections at once (`fetch_ranges`, AOTC_PULL_STREAMS=N) write each range at its offset and
hash nothing: the caller hashes the whole file after, BLAKE3 on every core. Not the default: on 2 cores the API
shares the cores, and on a 16-core GPU host over loopback they were 1.2x one stream at 3.6x the client's CPU, with a
fresh process's TTFI no shorter (bench/README.md, "Verified pull by BLAKE3"). They are for links one TCP stream
cannot fill.

Over plain HTTP with a Content-Length, on Linux, the body does not pass through this process at all (`_splice`):
splice(2) moves the socket's bytes into a pipe and on into the file's page cache, and the helper thread hashes the
file's new pages through an mmap, a window behind. That is one copy in the kernel where `readinto` and `write`
make two through a user buffer: 0.83x the client's CPU per verified GB and 1.13x the rate, in alternating pulls
on 2 cores (bench/pull_splice.py; bench/README.md, "Verified pull by splice"). TLS (the bytes must be decrypted
here) and chunked bodies take the buffered path above. Either way a body that ends before its Content-Length is a
`Cutoff`, which `Client.pull` resumes with `Range`: http.client itself ends such a body silently, which once made a
clean early close look like tampering (a size mismatch) and threw away what had arrived.

Only plain `http://` and `https://` without a proxy take this path (`direct_ok`); a proxied URL, or a Client whose
`http` was replaced (a test's scripted transport), uses httpx as before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import http.client
import ipaddress
import json
import mmap
import os
import queue
import select
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
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


REDIRECT_HOSTS_ENV = "AOTC_REDIRECT_HOSTS"


def redirect_hosts(spec: str | Sequence[str] | None) -> frozenset[str]:
    """The hosts a pull may be redirected to besides the default ones (`refuse_redirect`): AOTC_REDIRECT_HOSTS's
    syntax (comma-separated host names, `*.example.com` for every name under one), lowercased."""
    entries = spec.split(",") if isinstance(spec, str) else list(spec or [])
    return frozenset(e.strip().lower().rstrip(".") for e in entries if e.strip())


def refuse_redirect(location: str, origin: str, allowed: frozenset[str] = frozenset()) -> str | None:
    """Why a pull must not follow the service's redirect from `origin` to `location` (None: it may). The service is
    not trusted for where it sends the consumer: a hostile one could point the pull at anything the consumer's
    network reaches (a cloud metadata address, an internal plain-HTTP service) and have it fetched from there,
    though the bytes would then fail their signed digest. Followed: the service's own host (any port or scheme),
    a host `allowed` names (AOTC_REDIRECT_HOSTS: an object store on plain HTTP, or addressed by IP), and https
    to a host name (a presigned S3 URL), and from a service on loopback to loopback; refused: anything else, an IP
    address or plain HTTP to another host."""
    u, o = urlsplit(location), urlsplit(origin)
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"the service redirected the pull to {location[:200]!r}, which is not an http(s) URL"
    host, home = u.hostname.lower().rstrip("."), (o.hostname or "").lower().rstrip(".")
    if host == home or (_loopback(host) and _loopback(home)) or host in allowed \
            or any(a.startswith("*.") and host.endswith(a[1:]) for a in allowed):
        return None
    literal = _ip(host) is not None
    if u.scheme == "https" and not literal:
        return None
    what = "an IP address" if literal else "plain http"
    return (f"the service redirected the pull to {host} ({what}, not the service's host); a pull follows a redirect "
            f"only to the service's host, to https by host name, or to a host named in {REDIRECT_HOSTS_ENV} (or "
            "Client(redirect_hosts=...)): name your object store's host there if it is one")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _loopback(host: str) -> bool:
    """localhost or a loopback address: a service there redirects within the consumer's own machine (docker
    compose's object store at localhost:8333, the client at 127.0.0.1:8000)."""
    ip = _ip(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


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
          timeout: float | None, redirect_headers: Mapping[str, str] | None = None, limit: int | None = None,
          allowed: frozenset[str] = frozenset()) -> None:
    """GET `url` and append its body to `f` (which holds `have` bytes already, hashed into `digest`), hashing
    every byte written. One 307 (the S3 blob store's presigned URL) is followed with `redirect_headers` only: a
    presigned URL carries its own signature and must never see the API key. `limit`: the most bytes the body may
    hold (what the signed size leaves): a longer one is refused (`within`) before it can fill the disk. The redirect
    is followed only where `refuse_redirect` allows (`allowed`: AOTC_REDIRECT_HOSTS). Raises Cutoff, Restart or
    Refused."""
    try:
        conn, resp = _respond(url, headers, timeout, redirect_headers, allowed)
        try:
            _expect(resp, have)
            within(resp.length, limit)
            if not _splice_ok(conn, resp, f):
                _drain(resp, f, digest, limit)
            else:
                _splice(conn, resp, f, digest)
        finally:
            conn.close()
    except _Local as e:
        raise e.__cause__ from None  # type: ignore[misc]
    except (OSError, http.client.HTTPException) as e:
        raise Cutoff(str(e) or type(e).__name__) from e


def _respond(url: str, headers: Mapping[str, str], timeout: float | None, redirect_headers: Mapping[str, str] | None,
             allowed: frozenset[str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """GET `url`: the connection and its response, after one 307 followed with `redirect_headers` (see `fetch`).
    The caller closes the connection."""
    conn, target = _connect(url, timeout)
    try:
        conn.request("GET", target, headers=dict(headers))
        resp = conn.getresponse()
        if resp.status != 307 or redirect_headers is None:
            return conn, resp
        location = resp.getheader("location") or ""
        resp.read()
    except BaseException:
        conn.close()
        raise
    conn.close()
    why = refuse_redirect(location, url, allowed)
    if why:
        raise Refused(502, json.dumps({"error": {"message": why}}).encode())
    if not direct_ok(location):
        raise Refused(502, f"the redirect to {location!r} cannot be fetched directly".encode())
    return _respond(location, redirect_headers, timeout, None, allowed)


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


def within(length: int | str | None, limit: int | None) -> None:
    """Refused when a body's announced `length` exceeds `limit` (what the signed size leaves), or, called with
    no length, when `limit` has gone below 0 (more bytes came than it allowed)."""
    if limit is None:
        return
    if length is None:
        if limit < 0:
            raise Refused(502, b"the server sent more bytes than the artifact's signed size")
        return
    if int(length) > limit:
        raise Refused(502, f"the server announced {int(length)} bytes where the artifact's signed size leaves "
                           f"{limit}".encode())


def _drain(resp: http.client.HTTPResponse, f: BinaryIO, digest: Any, limit: int | None = None) -> None:
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
                # A chunked body has no length to refuse up front: read at most one byte past the limit.
                room = BLOCK if limit is None else max(0, min(BLOCK, limit + 1))
                while n < room:
                    got = resp.readinto(bufs[i][n:room])
                    if not got:
                        break
                    n += got
                if limit is not None:
                    limit -= n
                    within(None, limit)
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
            if n < room:
                break
    finally:
        hashing.put(None)
        helper.join()
    if failed:
        raise failed[0]
    if resp.length:  # http.client ends a body at EOF without a word, however much its Content-Length promised
        raise ConnectionError(f"the connection closed with {resp.length} bytes of the body still to come")


# -- splice: the socket's bytes into the file inside the kernel, hashed from the page cache -------------------------

SPLICE = hasattr(os, "splice")  # Linux; a switch for bench/download.py's A/B
PIPE_BYTES = 1 << 20
HASH_WINDOW = 8 << 20  # how much of the file one mmap of the hashing thread covers
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _splice_ok(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, f: BinaryIO | None) -> bool:
    """Whether the body can go socket -> pipe -> file by splice(2): plain HTTP (TLS bytes must be decrypted in
    user space), a known length (no chunked framing to parse), and a real file (`f`; None: a descriptor)."""
    if (not SPLICE or isinstance(conn, http.client.HTTPSConnection) or resp.length is None
            or not os.path.isdir("/proc/self/fd")):
        return False
    try:
        if f is not None:
            f.fileno()
        resp.fp.fileno()  # the socket (the connection may have let go of it already: `Connection: close`)
    except (OSError, ValueError, AttributeError):  # an in-memory file (a test's BytesIO)
        return False
    return True


def _splice(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, f: BinaryIO, digest: Any) -> None:
    """The body into `f` without copying it through this process: splice(2) moves the socket's bytes into a pipe
    and from the pipe into the file's page cache, and a helper thread hashes the file's new pages through an mmap
    (reading the page cache in place) a window behind. Receiving and writing cost one copy in the kernel instead of
    two copies in and out of a user buffer (bench/README.md, "Verified pull by splice"). What arrived before a
    failure is in the file and hashed, as `_drain` keeps it: a resume starts right after it."""
    assert resp.length is not None
    fd = resp.fp.fileno()
    # What the response's reader buffered past the headers goes the ordinary way first; the rest is on the socket.
    head = resp.read(min(len(resp.fp.peek()), resp.length)) if resp.length else b""
    try:
        f.write(head)
        f.flush()
    except OSError as e:
        raise _Local from e
    digest.update(head)
    remaining = resp.length
    if not remaining:  # the whole body came with the headers (http.client has let go of the socket)
        return
    # `f` is open for appending, and splice(2) refuses a file opened with O_APPEND: write through a second
    # descriptor of the same open file's inode, at explicit offsets.
    out = os.open(f"/proc/self/fd/{f.fileno()}", os.O_WRONLY | os.O_CLOEXEC)
    pos = hashed = os.fstat(out).st_size
    pr, pw = os.pipe()
    ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
    failed: list[BaseException] = []

    def hasher() -> None:
        view = os.open(f"/proc/self/fd/{out}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            while (item := ranges.get()) is not None:
                a, b = item
                while a < b and not failed:
                    base = a - a % mmap.ALLOCATIONGRANULARITY
                    end = min(b, base + HASH_WINDOW)
                    with mmap.mmap(view, end - base, mmap.MAP_SHARED, mmap.PROT_READ, offset=base) as m:
                        digest.update(memoryview(m)[a - base:end - base])
                    a = end
        except BaseException as e:  # noqa: BLE001 - handed to the receiving thread
            failed.append(e)
        finally:
            os.close(view)

    helper = threading.Thread(target=hasher, name="aotc-pull-hash", daemon=True)
    helper.start()
    at = [pos]

    def window(left: int) -> bool:  # a window written: hash it; go on unless hashing failed
        nonlocal hashed
        if at[0] - hashed >= HASH_WINDOW or not left:
            ranges.put((hashed, at[0]))
            hashed = at[0]
        return not failed

    try:
        _pump(fd, pr, pw, out, at, remaining, _timeout(conn), window)
    finally:
        try:
            _flush_pipe(pr, out, at[0], ranges, hashed)
        finally:
            ranges.put(None)
            helper.join()
            os.close(pr)
            os.close(pw)
            os.close(out)
            f.seek(0, os.SEEK_END)
    if failed:
        raise failed[0]


def _timeout(conn: http.client.HTTPConnection) -> float | None:
    return conn.timeout if isinstance(conn.timeout, (int, float)) else None


def _pump(fd: int, pr: int, pw: int, out: int, at: list[int], remaining: int, timeout: float | None,
          after: Callable[[int], bool]) -> None:
    """Move `remaining` bytes from socket `fd` into file `out` at offset `at[0]` (advanced as they land) through
    the pipe (`pr`, `pw`), by splice(2); after each piece, `after(bytes still to come)` says whether to go on.
    Raises ConnectionError (the body ended early), TimeoutError (no byte within `timeout`), _Local (the file)."""
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    with contextlib.suppress(OSError):  # a bigger pipe means fewer calls; the default works too
        fcntl.fcntl(pw, _F_SETPIPE_SZ, PIPE_BYTES)
    while remaining:
        try:
            got = os.splice(fd, pw, min(remaining, PIPE_BYTES), flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            if not poll.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError("timed out") from None
            continue
        if not got:
            raise ConnectionError(f"the connection closed with {remaining} bytes of the body still to come")
        remaining -= got
        while got:
            try:
                moved = os.splice(pr, out, got, offset_dst=at[0], flags=os.SPLICE_F_MOVE)
            except OSError as e:
                raise _Local from e
            got -= moved
            at[0] += moved
        if not after(remaining):
            return


def _flush_pipe(pr: int, out: int, pos: int, ranges: queue.SimpleQueue[tuple[int, int] | None],
                hashed: int) -> None:
    """After a failure midway: what the pipe still holds was received, so it goes to the file, and everything
    written since the last hashed window is hashed (a resume continues from the file's end)."""
    os.set_blocking(pr, False)
    while True:
        try:
            moved = os.splice(pr, out, PIPE_BYTES, offset_dst=pos, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except BlockingIOError:
            break
        except OSError as e:
            if e.errno != errno.EAGAIN:
                raise _Local from e
            break
        if not moved:
            break
        pos += moved
    if pos > hashed:
        ranges.put((hashed, pos))


# -- ranges: a large body over several connections at once -----------------------------------------------------------

RANGE_MIN = 8 << 20  # the fewest bytes one stream of `fetch_ranges` takes


class NotRanged(Exception):
    """A range was answered with something else than exactly that range (the whole body: the artifact changed; a
    server that ignores ranges): the caller fetches the ordinary way."""


def journal(part: Path) -> Path:
    """Where `fetch_ranges` notes the prefix of `part` that was whole before it began."""
    return part.with_name(part.name + ".ranges")


def recover(part: Path, f: BinaryIO) -> None:
    """If a process died while it fetched ranges into `part` (open as `f`), cut the file back to the prefix that
    was whole before: past it the file may have holes, which a resume would take for bytes and the digest would
    then refuse as tampering."""
    note = journal(part)
    try:
        whole = int(json.loads(note.read_text())["whole"])
    except FileNotFoundError:
        return
    except (ValueError, KeyError, TypeError, OSError):
        whole = 0
    f.flush()
    if os.fstat(f.fileno()).st_size > whole:
        f.truncate(max(whole, 0))
    note.unlink(missing_ok=True)


def fetch_ranges(url: str, headers: Mapping[str, str], part: Path, f: BinaryIO, have: int, size: int, streams: int,
                 *, etag: str, timeout: float | None, redirect: bool = False,
                 allowed: frozenset[str] = frozenset()) -> None:
    """Bytes [`have`, `size`) of the body at `url` into `part` (open for appending as `f`, `have` bytes long) over
    `streams` connections at once: each a ranged GET (`If-Range: "etag"`) whose body is written at its own offset
    (splice(2) on plain HTTP, else through one buffer and pwrite). Nothing is hashed here: the caller hashes the
    whole file once it is complete, BLAKE3 on every core (compiler/digests.py). `redirect`: follow one 307 (the S3
    store's presigned URL) with the Range alone, as `fetch` does.

    A journal (`journal(part)`) names the prefix that was whole before, for `recover`. On a failure the file is cut
    back to the longest prefix that arrived whole and the first failure raised (Cutoff for the network's, so a
    resume continues from there; NotRanged, Refused, or the local OSError)."""
    n = max(1, min(streams, (size - have) // RANGE_MIN))
    bounds = [have + (size - have) * i // n for i in range(n + 1)]
    note = journal(part)
    tmp = note.with_name(f"{note.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"whole": have}))
    os.replace(tmp, note)
    f.flush()
    out = os.open(f"/proc/self/fd/{f.fileno()}", os.O_WRONLY | os.O_CLOEXEC)  # f is O_APPEND: pwrite ignores offsets
    at = [[a] for a in bounds[:-1]]
    failed: list[BaseException] = []
    stop = threading.Event()

    def one(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]
        want = f"bytes {a}-{b - 1}/{size}"
        try:
            conn, resp = _respond(url, {**headers, "Range": f"bytes={a}-{b - 1}", "If-Range": f'"{etag}"'}, timeout,
                                  {"Range": f"bytes={a}-{b - 1}"} if redirect else None, allowed)
            try:
                if resp.status >= 300 and resp.status != 416:
                    raise Refused(resp.status, resp.read(64 << 10))
                if resp.status != 206 or resp.getheader("content-range") != want or resp.length != b - a:
                    raise NotRanged(f"asked for {want}, got {resp.status} {resp.getheader('content-range')}")
                _write_at(conn, resp, out, at[i], stop)
            finally:
                conn.close()
            if at[i][0] != b and not stop.is_set():
                raise ConnectionError(f"range {want} ended at {at[i][0]}")
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            failed.append(e)
            stop.set()

    threads = [threading.Thread(target=one, args=(i,), name=f"aotc-pull-range-{i}", daemon=True) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            whole = have
            for i in range(n):
                whole = at[i][0]
                if whole != bounds[i + 1]:
                    break
            os.ftruncate(out, whole)
    finally:
        os.close(out)
        f.seek(0, os.SEEK_END)
    note.unlink(missing_ok=True)
    if failed:
        e = failed[0]
        if isinstance(e, _Local):
            raise e.__cause__ from None  # type: ignore[misc]
        if isinstance(e, (OSError, http.client.HTTPException)):
            raise Cutoff(str(e) or type(e).__name__) from e
        raise e


def _write_at(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, out: int, at: list[int],
              stop: threading.Event) -> None:
    """The body of `resp` into file `out` from offset `at[0]` (advanced as it lands): by splice(2) where
    `_splice_ok`, else through one buffer with pwrite. Returns early, quietly, once `stop` is set."""
    assert resp.length is not None
    if _splice_ok(conn, resp, None):
        head = resp.read(min(len(resp.fp.peek()), resp.length))
        _pwrite(out, head, at)
        if resp.length:
            pr, pw = os.pipe()
            try:
                _pump(resp.fp.fileno(), pr, pw, out, at, resp.length, _timeout(conn), lambda _: not stop.is_set())
            finally:
                os.close(pr)
                os.close(pw)
        return
    buf = memoryview(bytearray(BLOCK))
    while not stop.is_set() and (got := resp.readinto(buf)):
        _pwrite(out, buf[:got], at)


def _pwrite(out: int, data: bytes | memoryview, at: list[int]) -> None:
    view = memoryview(data)
    while view:
        try:
            done = os.pwrite(out, view, at[0])
        except OSError as e:
            raise _Local from e
        at[0] += done
        view = view[done:]
