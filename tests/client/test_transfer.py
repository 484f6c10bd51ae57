"""client/transfer.py against a real socket server that misbehaves on purpose: a body cut off midway, a body that
stalls, bytes buffered with the headers. Both ways of writing (splice(2) and the buffered path) must leave the file
holding exactly the prefix that arrived, hash exactly the file's bytes, and give up on a stall within the timeout.
The service's own downloads (tests/service/api/test_downloads.py) cover the well-behaved cases and a killed pull."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from client import transfer

BODY = os.urandom(3 * (1 << 20) + 12345)  # more than one pipe's worth, not a multiple of anything


class OneShot:
    """A loopback HTTP server that answers each connection with `answer(conn, request_bytes)`, in a thread."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None], host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}/blob"
        self.answer, self.requests = answer, []  # type: ignore[var-annotated]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(4096)
                self.requests.append(request)
                try:
                    self.answer(conn, request)
                except OSError:  # the client hung up first: some tests are about exactly that
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["splice", "buffered"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "splice" and not hasattr(os, "splice"):
        pytest.skip("no splice(2) on this system")
    monkeypatch.setattr(transfer, "SPLICE", request.param == "splice")
    calls = {"n": 0}
    real = getattr(os, "splice", None)
    if real is not None:
        def counted(*a: object, **kw: object) -> int:
            calls["n"] += 1
            return real(*a, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(os, "splice", counted)
    yield request.param
    # The test ran the way it names: a splice test that fell back to the buffered path would prove nothing.
    assert (calls["n"] > 0) == (request.param == "splice")


def _head(length: int, extra: bytes = b"") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nContent-Type: application/octet-stream\r\n\r\n"
            .encode() + extra)


def test_a_whole_body_with_bytes_sent_alongside_the_headers(way: str, tmp_path: Path) -> None:
    # The first 1000 bytes leave in the same segment as the headers: http.client's reader buffers them, and the
    # splice path must take them from there before it reads the socket.
    server = OneShot(lambda c, _: (c.sendall(_head(len(BODY), BODY[:1000])), c.sendall(BODY[1000:])))
    try:
        part = tmp_path / "blob.part"
        digest = hashlib.sha256()
        with open(part, "ab") as f:
            transfer.fetch(server.url, {}, f, digest, 0, timeout=10)
        assert part.read_bytes() == BODY
        assert digest.hexdigest() == hashlib.sha256(BODY).hexdigest()
    finally:
        server.close()


def test_a_body_cut_off_midway_keeps_the_prefix_and_a_resume_completes_it(way: str, tmp_path: Path) -> None:
    cut = 2 * (1 << 20) + 777

    def answer(conn: socket.socket, request: bytes) -> None:
        if b"Range: bytes=" not in request:
            conn.sendall(_head(len(BODY)) + BODY[:cut])  # then closes: the rest never comes
            return
        start = int(request.split(b"Range: bytes=")[1].split(b"-")[0])
        conn.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(BODY) - start}\r\n"
                     f"Content-Range: bytes {start}-{len(BODY) - 1}/{len(BODY)}\r\n\r\n".encode() + BODY[start:])

    server = OneShot(answer)
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f:
            with pytest.raises(transfer.Cutoff):
                transfer.fetch(server.url, {}, f, hashlib.sha256(), 0, timeout=10)
            have = os.fstat(f.fileno()).st_size
            assert have == cut and part.read_bytes() == BODY[:cut]  # exactly what arrived, nothing more
            digest = hashlib.sha256(part.read_bytes())  # as Client.pull starts a resume: the file's bytes
            transfer.fetch(server.url, {"Range": f"bytes={have}-"}, f, digest, have, timeout=10)
        assert part.read_bytes() == BODY
        assert digest.hexdigest() == hashlib.sha256(BODY).hexdigest()
        assert f"Range: bytes={cut}-".encode() in server.requests[-1]
    finally:
        server.close()


def test_a_stalled_body_is_given_up_within_the_timeout(way: str, tmp_path: Path) -> None:
    release = threading.Event()

    def answer(conn: socket.socket, _: bytes) -> None:
        conn.sendall(_head(len(BODY)) + BODY[: 1 << 20])
        release.wait(30)  # holds the connection open and sends nothing more

    server = OneShot(answer)
    try:
        part = tmp_path / "blob.part"
        t0 = time.monotonic()
        with open(part, "ab") as f, pytest.raises(transfer.Cutoff):
            transfer.fetch(server.url, {}, f, hashlib.sha256(), 0, timeout=0.5)
        assert time.monotonic() - t0 < 10
        assert part.read_bytes() == BODY[: 1 << 20]
    finally:
        release.set()
        server.close()


@pytest.mark.parametrize("splice", [True, False])
def test_a_body_announced_longer_than_the_signed_size_is_refused_before_a_byte_is_written(
        splice: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`limit` is what the signed size leaves: a server that announces more (a hostile one filling the consumer's
    disk: the size was only compared once the whole body had landed) is refused at the headers."""
    monkeypatch.setattr(transfer, "SPLICE", splice)
    server = OneShot(lambda c, _: c.sendall(_head(len(BODY), BODY[:1000])) or c.sendall(BODY[1000:]))
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f, pytest.raises(transfer.Refused) as got:
            transfer.fetch(server.url, {}, f, hashlib.sha256(), 0, timeout=10, limit=1000)
        assert got.value.status == 502 and b"signed size leaves 1000" in got.value.body
        assert part.stat().st_size == 0
    finally:
        server.close()


def test_a_chunked_body_is_cut_at_the_signed_size(tmp_path: Path) -> None:
    """A chunked body has no length to refuse up front: the pull reads at most one byte past the limit, then
    refuses, however much more the server would send."""
    def answer(conn: socket.socket, _: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(BODY), 65536):  # the client hangs up long before the end
            piece = BODY[i:i + 65536]
            conn.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        conn.sendall(b"0\r\n\r\n")

    server = OneShot(answer)
    try:
        part = tmp_path / "blob.part"
        limit = 100_000
        with open(part, "ab") as f, pytest.raises(transfer.Refused) as got:
            transfer.fetch(server.url, {}, f, hashlib.sha256(), 0, timeout=10, limit=limit)
        assert b"more bytes than the artifact's signed size" in got.value.body
        assert part.stat().st_size <= limit + 1
        assert part.read_bytes() == BODY[:part.stat().st_size]
    finally:
        server.close()


def test_a_redirect_is_followed_only_to_the_services_host_https_names_and_hosts_named_for_it() -> None:
    refuse = transfer.refuse_redirect
    origin = "http://127.0.0.1:8000/v1/artifacts/k/package"
    assert refuse("http://127.0.0.1:9000/bucket/k?X-Amz-Signature=s", origin) is None  # the service's host
    assert refuse("https://bucket.s3.eu-west-1.amazonaws.com/k?sig", origin) is None  # https by name
    assert refuse("http://localhost:8333/b/k", origin) is None  # loopback to loopback: docker-compose's store
    assert refuse("http://127.0.0.1:8333/b/k", "http://localhost:8000/") is None
    message = refuse("http://127.0.0.1:8333/b/k", "https://aotc.example/")  # a remote service: not to loopback
    assert message is not None and "an IP address" in message
    for bad, why in [("http://169.254.169.254/latest/meta-data/", "an IP address"),
                     ("https://169.254.169.254/x", "an IP address"), ("https://[fd00::1]/x", "an IP address"),
                     ("http://minio.internal:9000/b/k", "plain http"), ("file:///etc/passwd", "not an http(s) URL"),
                     ("gopher://x/", "not an http(s) URL"), ("http:///nohost", "not an http(s) URL")]:
        message = refuse(bad, origin)
        assert message is not None and why in message, (bad, message)
    allowed = transfer.redirect_hosts(" minio.internal, *.store.example ,10.0.0.7,")
    assert allowed == {"minio.internal", "*.store.example", "10.0.0.7"}
    for ok in ("http://minio.internal:9000/b/k", "http://MINIO.internal./b", "http://a.b.store.example/k",
               "http://10.0.0.7/k"):
        assert refuse(ok, origin, allowed) is None, ok
    assert refuse("http://store.example/k", origin, allowed) is not None  # the wildcard names what is under it
    assert refuse("http://evilminio.internal/k", origin, allowed) is not None


def test_a_pull_redirected_to_another_host_is_refused_unless_that_host_is_named(tmp_path: Path) -> None:
    """The service's 307 (a presigned URL) once took the pull to any host it named: a hostile service could have a
    consumer fetch from its cloud's metadata address or an internal plain-HTTP service. Here the service is on
    another host than loopback would be (this machine's own non-loopback address, where it has one) and redirects
    to a loopback address that stands for such a host: not fetched from by default, fetched from once named."""
    home = _own_address()
    if home is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    target = OneShot(lambda c, _: c.sendall(_head(len(BODY), BODY)), host="127.0.0.2")
    service = OneShot(host=home, answer=lambda c, _: c.sendall(
        f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {target.url}?X-Amz-Signature=s\r\nContent-Length: 0\r\n\r\n"
        .encode()))
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f:
            with pytest.raises(transfer.Refused) as got:
                transfer.fetch(service.url, {}, f, hashlib.sha256(), 0, timeout=10, redirect_headers={})
        assert got.value.status == 502 and b"redirected the pull to 127.0.0.2 (an IP address" in got.value.body, \
            got.value.body
        assert target.requests == [] and part.stat().st_size == 0
        digest = hashlib.sha256()
        with open(part, "ab") as f:
            transfer.fetch(service.url, {"Authorization": "Bearer secret"}, f, digest, 0, timeout=10,
                           redirect_headers={}, allowed=transfer.redirect_hosts("127.0.0.2"))
        assert part.read_bytes() == BODY and digest.hexdigest() == hashlib.sha256(BODY).hexdigest()
        assert len(target.requests) == 1 and b"secret" not in target.requests[0]  # the API key stays behind
    finally:
        service.close()
        target.close()


def _own_address() -> str | None:
    """This machine's address on its default route (no packet is sent: a UDP socket only picks its source)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


# -- ranges: one body over several connections (fetch_ranges) --------------------------------------------------------

ETAG = "e" * 64


def _ranges(answer_range: Callable[[socket.socket, int, int], None] | None = None,
            ignore: str = "") -> Callable[[socket.socket, bytes], None]:
    """A server of BODY's ranges: `answer_range(conn, a, b)` answers bytes [a, b) where given, else exactly them;
    `ignore="whole"` answers every range with the whole body (200), `"longer"` with a 206 whose Content-Length
    runs past the range asked (a server filling the client's disk)."""
    def answer(conn: socket.socket, request: bytes) -> None:
        m = re.search(rb"Range: bytes=(\d+)-(\d+)", request)
        assert m is not None and f'If-Range: "{ETAG}"'.encode() in request
        a, b = int(m[1]), int(m[2]) + 1
        if ignore == "whole":
            conn.sendall(_head(len(BODY)) + BODY)
            return
        n = b - a + (1 << 20 if ignore == "longer" else 0)
        head = (f"HTTP/1.1 206 Partial Content\r\nContent-Length: {n}\r\n"
                f"Content-Range: bytes {a}-{b - 1}/{len(BODY)}\r\n\r\n").encode()
        if answer_range is not None:
            conn.sendall(head)
            answer_range(conn, a, b)
        else:
            conn.sendall(head + BODY[a:a + n])
    return answer


@pytest.fixture
def small_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "RANGE_MIN", 1 << 20)  # three streams for BODY's 3 MiB


@pytest.mark.usefixtures("small_ranges")
def test_a_body_in_ranges_lands_whole_with_no_journal_left(way: str, tmp_path: Path) -> None:
    server = OneShot(_ranges())
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f:
            f.write(BODY[:1000])  # a prefix from before: the ranges cover the rest
            transfer.fetch_ranges(server.url, {}, part, f, 1000, len(BODY), 3, etag=ETAG, timeout=10)
            f.write(b"")  # still open for appending, at the end
        assert part.read_bytes() == BODY
        asked = sorted(re.search(rb"Range: bytes=(\d+)-", r)[1] for r in server.requests)  # type: ignore[index]
        assert len(asked) == 3 and int(asked[0]) == 1000
        assert not transfer.journal(part).exists()
    finally:
        server.close()


@pytest.mark.usefixtures("small_ranges")
def test_a_range_cut_off_leaves_the_longest_whole_prefix_and_a_resume_completes_it(way: str, tmp_path: Path) -> None:
    """The middle range ends halfway: the file is cut back to a prefix of the body that arrived whole (the
    ranges after it may have landed, but not contiguously), Cutoff is raised, and the ordinary resume from the
    file's end completes it."""
    third = len(BODY) // 3

    def cut_middle(conn: socket.socket, a: int, b: int) -> None:
        conn.sendall(BODY[a:b] if a != third else BODY[a:a + (b - a) // 2])  # then closes

    server = OneShot(_ranges(cut_middle))
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f:
            with pytest.raises(transfer.Cutoff):
                transfer.fetch_ranges(server.url, {}, part, f, 0, len(BODY), 3, etag=ETAG, timeout=10)
            have = os.fstat(f.fileno()).st_size
            assert have <= third + (third // 2) + 1 and part.read_bytes() == BODY[:have]
            assert not transfer.journal(part).exists()
            rest = OneShot(lambda c, r: c.sendall(
                f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(BODY) - have}\r\n"
                f"Content-Range: bytes {have}-{len(BODY) - 1}/{len(BODY)}\r\n\r\n".encode() + BODY[have:]))
            digest = hashlib.sha256(part.read_bytes())
            transfer.fetch(rest.url, {"Range": f"bytes={have}-"}, f, digest, have, timeout=10)
            rest.close()
        assert part.read_bytes() == BODY and digest.hexdigest() == hashlib.sha256(BODY).hexdigest()
    finally:
        server.close()


@pytest.mark.usefixtures("small_ranges")
@pytest.mark.parametrize("ignore", ["whole", "longer"])
def test_ranges_answered_otherwise_are_not_written_past_what_was_asked(ignore: str, tmp_path: Path) -> None:
    """A whole body for a range (the artifact was built again; a server that ignores ranges) or a range longer
    than asked (a hostile server filling the disk): NotRanged, the file back at the prefix it began with, for
    the caller's ordinary pull."""
    server = OneShot(_ranges(ignore=ignore))
    try:
        part = tmp_path / "blob.part"
        with open(part, "ab") as f:
            f.write(BODY[:5000])
            with pytest.raises(transfer.NotRanged):
                transfer.fetch_ranges(server.url, {}, part, f, 5000, len(BODY), 3, etag=ETAG, timeout=10)
        assert part.read_bytes() == BODY[:5000] and not transfer.journal(part).exists()
    finally:
        server.close()


def test_a_journal_left_by_a_killed_pull_cuts_the_file_back(tmp_path: Path) -> None:
    """A process killed while it fetched ranges leaves holes past the prefix it began with: the next pull cuts
    the file back to that prefix (the journal's), never resumes over the holes."""
    part = tmp_path / "blob.part"
    for note, want in (('{"whole": 1000}', 1000), ("not json", 0), (None, 5000)):
        part.write_bytes(BODY[:1000] + b"\0" * 4000)  # a hole where a range had not landed
        if note is not None:
            transfer.journal(part).write_text(note)
        with open(part, "ab") as f:
            transfer.recover(part, f)
        assert part.stat().st_size == want and not transfer.journal(part).exists()
