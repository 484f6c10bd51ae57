"""Downloads over HTTP from every blob store: ranges, conditional requests, a pull killed midway that resumes,
pins, and the API's memory while 16 streams run at once."""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import psutil
import pytest

from compiler.digests import file_digests
from compiler.errors import BadSignature
from compiler.signing import Signer, key_record, statement
from compiler.weightsfile import describe, read_header_file, write
from procs import ROOT, Cluster, api
from service.api.http import protocol
from service.store import StorageOptions, Store, keys

SIGNER = Signer.generate()
STALL_S = 6  # AOTC_SEND_STALL_S: long enough that no pull of these tests stalls that long on a busy machine
S3 = {"AWS_ACCESS_KEY_ID": "aotc-test", "AWS_SECRET_ACCESS_KEY": "aotc-test", "AWS_DEFAULT_REGION": "us-east-1"}


class Service:
    def __init__(self, cluster: Cluster, store: Store, backend: str) -> None:
        self.cluster, self.store, self.backend, self.url = cluster, store, backend, cluster.url

    def publish(self, tmp: Path, size: int, weights: Path | None = None, *, blake3: str | None = "computed",
                weights_blake3: str | None = "computed") -> tuple[str, bytes]:
        """A signed artifact of `size` random bytes; with `weights`, a weightless one binding that blob. `blake3`,
        `weights_blake3`: the BLAKE3 digests signed ("computed": the true ones; None: none, as manifests signed
        before BLAKE3 are)."""
        key = os.urandom(16).hex()
        data = os.urandom(size)
        (tmp / key).write_bytes(data)
        factors = {"format": 1, "model": "f" * 64, "options": {}, "spec": [], "target": "cpu-x86_64-avx2",
                   "toolchain": {"torch": "2.13.0"}}
        signed_weights = None
        if weights is not None:
            signed_weights = {**file_digests(weights), "size": weights.stat().st_size,
                              "constants": describe(read_header_file(weights))}
            if weights_blake3 != "computed":
                signed_weights.pop("blake3")
                if weights_blake3 is not None:
                    signed_weights["blake3"] = weights_blake3
        # Signed as a worker signs what it publishes (sha256 and BLAKE3), so that the SDK's pulls verify it.
        digests = file_digests(tmp / key)
        manifest = SIGNER.sign(statement(
            artifact_key=key, package_sha256=digests["sha256"], package_size=size,
            package_blake3=digests["blake3"] if blake3 == "computed" else blake3,
            model_sha256="f" * 64, factors=factors, toolchain=factors["toolchain"], target=factors["target"],
            check={}, worker={"id": "test"}, weights=signed_weights))
        self.store.signing.publish(key_record(SIGNER.public))
        record: dict[str, Any] = {"key": key, "factors": factors, "model_id": "f" * 64, "target": factors["target"],
                                  "spec": [], "options": {}, "manifest": manifest}
        if signed_weights is not None:
            record["weights"] = {"sha256": signed_weights["sha256"], "size": signed_weights["size"], "constants": 1}
        self.store.artifacts.put(record, tmp / key, weights=weights)
        return key, data


@pytest.fixture(scope="module", params=["redis", "file", "s3"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    base = tmp_path_factory.mktemp(f"dl-{request.param}")
    env: dict[str, str] = {"AOTC_SEND_STALL_S": str(STALL_S)}
    if request.param == "redis":
        env["AOTC_BLOB_STORE"] = "redis"
    elif request.param == "s3":  # "file": the default, a folder under AOTC_DATA_DIR
        env.update(S3, AOTC_BLOB_STORE="s3://aotc-dl/t", AOTC_S3_ENDPOINT_URL=request.getfixturevalue("s3_endpoint"))
    # The API as aotc-server serves it (its HTTP protocol): the file store's packages go out with sendfile.
    cluster = Cluster(base, env=env, api_http=protocol("auto"))
    store = Store(cluster.redis.url, storage=StorageOptions(
        blob_store=env.get("AOTC_BLOB_STORE"), s3_endpoint_url=env.get("AOTC_S3_ENDPOINT_URL")))
    yield Service(cluster, store, request.param)
    store.close()
    cluster.close()


def _get(svc: Service, key: str, **headers: str) -> httpx.Response:
    """GET the package as a client would, following the S3 store's redirect with the same headers."""
    r = api.get(f"{svc.url}/v1/artifacts/{key}", headers=headers, timeout=60)
    if svc.backend == "s3" and r.status_code == 307:
        assert r.headers["etag"] and r.headers["x-aotc-sha256"]
        # A presigned URL carries its own signature: never the API key.
        r = httpx.get(r.headers["location"], headers={k: v for k, v in headers.items() if k != "If-Range"},
                      timeout=60)
    return r


def test_whole_ranges_and_conditional_requests(service: Service, tmp_path: Path) -> None:
    key, data = service.publish(tmp_path, 2_500_000)
    sha, size = hashlib.sha256(data).hexdigest(), len(data)
    etag = f'"{sha}"'

    whole = _get(service, key)
    assert whole.status_code == 200 and whole.content == data
    if service.backend == "s3":  # the bytes never pass through the API
        r = api.get(f"{service.url}/v1/artifacts/{key}")
        assert r.status_code == 307 and "X-Amz-Signature" in r.headers["location"]
    else:
        assert whole.headers["etag"] == etag and whole.headers["accept-ranges"] == "bytes"
        assert whole.headers["content-length"] == str(size) and whole.headers["x-aotc-sha256"] == sha

    for header, (start, end) in {"bytes=100-199": (100, 200), "bytes=-10": (size - 10, size),
                                 f"bytes={size - 5}-": (size - 5, size), "bytes=7-": (7, size),
                                 f"bytes=0-{size + 50}": (0, size)}.items():
        r = _get(service, key, Range=header)
        assert r.status_code == 206, (header, r.status_code)
        assert r.content == data[start:end] and r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"

    if service.backend != "s3":  # what the API itself answers (S3 has its own rules past the redirect)
        r = _get(service, key, Range=f"bytes={size}-")
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{size}"
        assert r.json()["error"]["code"] == "range_not_satisfiable"
        assert _get(service, key, Range="bytes=0-1,5-6").content == data  # several ranges: the whole body
        assert _get(service, key, Range="bytes=5-9", **{"If-Range": '"stale"'}).status_code == 200
        assert _get(service, key, Range="bytes=5-9", **{"If-Range": etag}).content == data[5:10]

    for inm in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        r = api.get(f"{service.url}/v1/artifacts/{key}", headers={"If-None-Match": inm})
        assert r.status_code == 304 and r.headers["etag"] == etag and not r.content, inm
    assert api.get(f"{service.url}/v1/artifacts/{key}", headers={"If-None-Match": '"other"'}).status_code in (
        200, 307)
    head = api.head(f"{service.url}/v1/artifacts/{key}")
    assert head.status_code == 200 and head.headers["content-length"] == str(size) and not head.content


def test_every_get_is_a_pull_in_the_eviction_order(service: Service, tmp_path: Path) -> None:
    key, _ = service.publish(tmp_path, 1000)
    before = service.store.r.zscore(keys.ARTIFACTS_PULLED, key)
    time.sleep(0.01)
    assert _get(service, key).status_code == 200
    after = service.store.r.zscore(keys.ARTIFACTS_PULLED, key)
    assert before is not None and after is not None and after > before


class Sent(NamedTuple):
    url: str  # with its host: the API's, or object storage's (a presigned URL)
    path: str  # without the query
    range: str | None
    keyed: bool  # it carried the API key


def _spy_requests(monkeypatch: pytest.MonkeyPatch) -> list[Sent]:
    """Every request the SDK's downloads send from now on (client/transfer.py speaks http.client)."""
    sent: list[Sent] = []
    request = http.client.HTTPConnection.request

    def spy(conn: http.client.HTTPConnection, method: str, url: str, *a: Any, **kw: Any) -> None:
        headers = kw.get("headers") or (a[1] if len(a) > 1 else {})
        sent.append(Sent(f"http://{conn.host}:{conn.port}{url}", url.split("?", 1)[0], headers.get("Range"),
                         "authorization" in {k.lower() for k in headers}))
        request(conn, method, url, *a, **kw)

    monkeypatch.setattr(http.client.HTTPConnection, "request", spy)
    return sent


_KILLED_PULL = """
import http.client, os, signal, sys, threading
sys.path[:0] = [sys.argv[1]]
from client import Client, transfer
limit, written = int(sys.argv[4]), [0]
transfer.SPLICE = sys.argv[6] == "splice"
dying = threading.Lock()  # a pull in ranges writes from several threads: the first to pass the limit kills

def die(path):  # the first 1 MiB block is on disk by now: die like a killed process, mid-download
    dying.acquire()
    with open(sys.argv[7], "w") as f:
        f.write(path)
    os.kill(os.getpid(), signal.SIGKILL)

original = http.client.HTTPResponse.readinto
def readinto(self, b):
    n = original(self, b)
    written[0] += n
    if written[0] >= limit:
        die("buffered")
    return n
http.client.HTTPResponse.readinto = readinto

splice = os.splice
def spliced(src, dst, count, offset_src=None, offset_dst=None, flags=0):
    n = splice(src, dst, count, offset_src, offset_dst, flags)
    if offset_dst is not None:  # pipe -> file: the bytes are in the file
        written[0] += n
        if written[0] >= limit:
            die("splice")
    return n
os.splice = spliced
Client(sys.argv[2], cache_dir=sys.argv[3]).pull(sys.argv[5])
"""


@pytest.mark.parametrize("path", ["splice", "buffered"])
def test_a_pull_killed_midway_resumes_with_range_and_ends_verified(service: Service, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   path: str) -> None:
    """Both ways a pull writes (client/transfer.py): splice(2) from the socket into the file, and the buffered
    path (TLS, chunked bodies, systems without splice); the killed process says which one it was in."""
    from client import Client, transfer

    key, data = service.publish(tmp_path, 4_000_000)
    cache = tmp_path / "cache"
    # Killed once 2 MB are in the file: a prefix of the artifact is on disk by then.
    marker = tmp_path / "killed-in"
    killed = subprocess.run([sys.executable, "-c", _KILLED_PULL, str(ROOT), service.url, str(cache),
                             str(2_000_000), key, path, str(marker)], env={**os.environ, **S3}, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert marker.read_text() == path
    part = cache / "artifacts" / f"{key}.pt2.part"
    have = part.stat().st_size
    assert 0 < have < len(data) and part.read_bytes() == data[:have]
    assert not (cache / "artifacts" / f"{key}.pt2").exists()

    # The pull's own connections: what each asked for, and the answers.
    sent = _spy_requests(monkeypatch)
    statuses: list[int] = []
    getresponse = http.client.HTTPConnection.getresponse

    def spy_getresponse(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
        resp = getresponse(conn)
        statuses.append(resp.status)
        return resp

    monkeypatch.setattr(http.client.HTTPConnection, "getresponse", spy_getresponse)
    monkeypatch.setattr(transfer, "SPLICE", path == "splice")
    with Client(service.url, cache_dir=cache) as c:
        path = c.pull(key)
    assert path.read_bytes() == data and not part.exists()
    assert (sent[-1].range, statuses[-1]) == (f"bytes={have}-", 206)  # only the rest came down
    if service.backend == "s3":
        assert statuses[-2] == 307 and "X-Amz-Signature" in sent[-1].url
        assert sent[-2].url.startswith(service.url)
        assert [s.keyed for s in sent[-2:]] == [True, False]  # the API key goes to the API, never to object storage


@pytest.mark.parametrize("path", ["splice", "buffered"])
def test_a_large_pull_comes_in_ranges_at_once_and_is_verified_whole(service: Service, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   path: str) -> None:
    """AOTC_PULL_STREAMS=4: four ranged GETs at once, each written at its offset, the whole file then hashed
    (BLAKE3, every core); from the S3 store each follows its own redirect.
    The bytes come whole, and a stored package swapped for other bytes is refused as ever."""
    from client import Client, transfer

    monkeypatch.setenv("AOTC_PULL_STREAMS", "4")
    monkeypatch.setattr(transfer, "SPLICE", path == "splice")
    key, data = service.publish(tmp_path, 36_000_000)
    sent = _spy_requests(monkeypatch)
    with Client(service.url, cache_dir=tmp_path / "cache") as c:
        got = c.pull(key)
    assert got.read_bytes() == data
    to_api = sorted((x.range for x in sent if x.range and x.url.startswith(service.url)),
                    key=lambda r: int(r[6:].split("-")[0]))
    elsewhere = sorted(x.range for x in sent if x.range and not x.url.startswith(service.url))
    assert len(to_api) == 4 and to_api[0].startswith("bytes=0-") and to_api[-1].endswith(f"-{len(data) - 1}")
    # From the S3 store each range follows its own redirect to object storage; the others come from the API.
    assert elsewhere == (sorted(to_api) if service.backend == "s3" else [])
    assert not transfer.journal(tmp_path / "cache" / "artifacts" / f"{key}.pt2.part").exists()

    if service.backend == "file":  # the stored bytes swapped: refused, nothing kept
        tampered = tmp_path / "swap"
        tampered.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
        record = service.store.artifacts.get(key)
        assert record is not None
        with open(tampered, "rb") as f:
            service.store.blobs.put("artifact", service.store.artifacts.blob_id(record), f)
        with Client(service.url, cache_dir=tmp_path / "fresh") as c:
            with pytest.raises(BadSignature, match="arrived corrupt or tampered with: blake3"):
                c.pull(key)
        assert not list((tmp_path / "fresh" / "artifacts").glob(f"{key}*"))


@pytest.mark.parametrize("path", ["splice", "buffered"])
def test_a_pull_in_ranges_killed_midway_starts_over_from_its_journal_and_ends_verified(
        service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Killed with ranges half landed, the `.part` file has holes: its journal makes the next pull cut it back to
    the prefix it began from (nothing), never resume over the holes, which would end in a false 'tampered'."""
    from client import Client, transfer

    key, data = service.publish(tmp_path, 36_000_000)
    cache = tmp_path / "cache"
    marker = tmp_path / "killed-in"
    killed = subprocess.run([sys.executable, "-c", _KILLED_PULL, str(ROOT), service.url, str(cache),
                             str(12_000_000), key, path, str(marker)],
                            env={**os.environ, **S3, "AOTC_PULL_STREAMS": "4"}, timeout=120)
    assert killed.returncode == -signal.SIGKILL and marker.read_text() == path
    part = cache / "artifacts" / f"{key}.pt2.part"
    # Its file may have holes (ranges land at their offsets, the later ones often first): the journal says so.
    assert part.stat().st_size > 0 and transfer.journal(part).exists()

    monkeypatch.setenv("AOTC_PULL_STREAMS", "4")
    with Client(service.url, cache_dir=cache) as c:
        assert c.pull(key).read_bytes() == data
    assert not part.exists() and not transfer.journal(part).exists()


def test_a_corrupt_part_file_is_started_over(service: Service, tmp_path: Path) -> None:
    from client import Client

    key, data = service.publish(tmp_path, 300_000)
    part = tmp_path / "cache" / "artifacts" / f"{key}.pt2.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)  # not a prefix of the package: the digest check fails, the file is dropped
    with Client(service.url, cache_dir=tmp_path / "cache") as c:
        with pytest.raises(Exception, match="corrupt"):
            c.pull(key)
        assert c.pull(key).read_bytes() == data  # and the next pull starts from nothing


def test_a_pull_verifies_the_signed_blake3_and_a_manifest_without_one_by_sha256(service: Service, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker signs a package's sha256 and its BLAKE3 (4x faster to compute here: compiler/digests.py), and the
    SDK verifies the BLAKE3. Shown by a manifest whose BLAKE3 alone is wrong: refused, naming BLAKE3, though the
    sha256 would have passed. AOTC_PULL_DIGEST=sha256 verifies the other, and so does a manifest signed before
    BLAKE3 (sha256 only). The same for a weights blob, and for a copy hashed again (`rehash`)."""
    from client import Client, sdk

    if service.backend != "file":
        pytest.skip("the digest is the client's: the same whatever the blob store")
    weights = tmp_path / "w.safetensors"
    with open(weights, "wb") as f:
        write(f, [("w", "float32", (64, 64), os.urandom(64 * 64 * 4))], {})
    good, data = service.publish(tmp_path, 400_000, weights=weights)
    bad, _ = service.publish(tmp_path, 400_000, blake3="0" * 64)
    bad_weights, _ = service.publish(tmp_path, 50_000, weights=weights, weights_blake3="1" * 64)
    legacy, legacy_data = service.publish(tmp_path, 400_000, weights=weights, blake3=None, weights_blake3=None)

    with Client(service.url, cache_dir=tmp_path / "a") as c:
        assert c.pull(good).read_bytes() == data
        assert c.pull_weights(good).read_bytes() == weights.read_bytes()  # type: ignore[union-attr]
        with pytest.raises(BadSignature, match=f"blake3 [0-9a-f]{{64}} \\(400000 bytes\\), but its signed manifest "
                                               f"says {'0' * 64}"):
            c.pull(bad)
        assert not (tmp_path / "a" / "artifacts" / f"{bad}.pt2").exists()
        # A cached copy is held to the same digest when it is hashed again.
        assert c.pull(good, rehash=True).read_bytes() == data

    sdk._VERIFIED.clear()
    with Client(service.url, cache_dir=tmp_path / "b") as c:
        with pytest.raises(BadSignature, match=f"blake3 .* says {'1' * 64}"):
            c.pull_weights(bad_weights)
        assert c.pull(legacy).read_bytes() == legacy_data  # signed before BLAKE3: its sha256 verified
        assert c.pull_weights(legacy).read_bytes() == weights.read_bytes()  # type: ignore[union-attr]

    monkeypatch.setenv("AOTC_PULL_DIGEST", "sha256")
    sdk._VERIFIED.clear()
    with Client(service.url, cache_dir=tmp_path / "c") as c:
        assert len(c.pull(bad).read_bytes()) == 400_000  # its sha256 is right
        assert c.pull_weights(bad_weights) is not None


def test_a_cached_pull_checks_the_signature_and_its_record_not_every_byte(service: Service, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from client import Client, sdk

    if service.backend != "file":
        pytest.skip("the client's cache is the same whatever the blob store")
    key, data = service.publish(tmp_path, 3_000_000)
    hashed: list[Path] = []
    whole_file_digest = sdk._file_digest
    monkeypatch.setattr(sdk, "_file_digest", lambda p, a: hashed.append(p) or whole_file_digest(p, a))
    with Client(service.url, cache_dir=tmp_path / "cache") as c:
        path = c.pull(key)
        assert hashed == []  # hashed while it streamed in: the file is not read again
        assert c.pull(key) == path and hashed == []  # verified before: the signature and the record, no bytes
        linked = c.pull(key, tmp_path / "out" / "model.pt2")
        assert linked.read_bytes() == data and hashed == [] and linked.stat().st_ino == path.stat().st_ino
        assert c.pull(key, rehash=True) == path and hashed == [path]  # asked for: every byte

        # Corrupt in place with its mtime put back: a rehash sees it, and then the record no longer vouches for it
        # (nor could it, for bit rot that leaves the stat as it was), so the pull downloads it again.
        st = path.stat()
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.write(b"\xff" * 8)
        path.chmod(0o444)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert c.pull(key, rehash=True).read_bytes() == data and hashed == [path, path]
        assert c.pull(key) == path and hashed == [path, path]  # the fresh copy's own record

        time.sleep(0.05)  # a later edit: past the file system's timestamp granularity
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.write(b"\0" * 8)
        downloads = []
        monkeypatch.setattr(c, "_download", lambda *a: downloads.append(a[0].key) or Client._download(c, *a))
        assert c.pull(key).read_bytes() == data  # the record no longer fits: hashed, found wrong, pulled again
        assert hashed == [path, path, path] and downloads == [key]


def test_pin_and_unpin(service: Service, tmp_path: Path) -> None:
    key, _ = service.publish(tmp_path, 100)
    r = api.post(f"{service.url}/v1/artifacts/{key}/pin")
    assert r.status_code == 200 and r.json() == {"key": key, "pinned": True}
    assert service.store.artifacts.pinned(key)
    r = api.delete(f"{service.url}/v1/artifacts/{key}/pin")
    assert r.status_code == 200 and r.json() == {"key": key, "pinned": False}
    r = api.post(f"{service.url}/v1/artifacts/{'0' * 32}/pin")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    if service.backend != "file":
        return
    cli = [sys.executable, "-m", "client.cli", "--url", service.url]
    pinned = subprocess.run([*cli, "pin", key], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert pinned.returncode == 0 and pinned.stdout.strip() == f"pinned {key}", pinned.stderr
    assert service.store.artifacts.pinned(key)
    unpinned = subprocess.run([*cli, "unpin", key], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert unpinned.returncode == 0 and unpinned.stdout.strip() == f"unpinned {key}"
    missing = subprocess.run([*cli, "pin", "0" * 32], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no artifact" in missing.stderr and "404" in missing.stderr


def test_sixteen_streams_at_once_hold_little_memory(service: Service, tmp_path: Path) -> None:
    """Before, every stream held whole 64 MB chunks; now pieces of 512 KB. 16 streams of a 24 MB package would
    have held 384 MB of chunks."""
    if service.backend == "s3":
        pytest.skip("S3 downloads do not pass through the API")
    key, data = service.publish(tmp_path, 24 * 2**20)
    server = psutil.Process(service.cluster.api.pid)
    base = server.memory_info().rss
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], server.memory_info().rss)

    def pull(results: list[Any]) -> None:
        digest = hashlib.sha256()
        with api.stream("GET", f"{service.url}/v1/artifacts/{key}", timeout=120) as r:
            for piece in r.iter_raw():
                digest.update(piece)
        results.append(digest.hexdigest())

    results: list[Any] = []
    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=pull, args=(results,)) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    assert results == [hashlib.sha256(data).hexdigest()] * 16
    assert peak[0] - base < 64 * 2**20, f"the API grew by {(peak[0] - base) / 2**20:.0f} MB"


def test_a_client_that_stops_reading_a_sendfile_download_is_cut_off(service: Service, tmp_path: Path) -> None:
    """The file store's packages go out with sendfile from a thread (service/api/http.py): a client that takes no
    bytes for AOTC_SEND_STALL_S loses its connection, where a streamed answer waited for it for ever."""
    import socket

    if service.backend != "file":
        pytest.skip("only a file on the API's disk goes out with sendfile")
    size = 48 * 2**20  # far more than both sockets' buffers hold
    key, _ = service.publish(tmp_path, size)
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.sendall(f"GET /v1/artifacts/{key} HTTP/1.1\r\nHost: {host}\r\n"
                     f"Authorization: {api.headers['authorization']}\r\n\r\n".encode())
        time.sleep(STALL_S + 3)  # reads nothing meanwhile
        got, t0 = 0, time.monotonic()
        try:
            while piece := sock.recv(1 << 20):
                got += len(piece)
        except ConnectionResetError:
            pass
    assert got < size, "the whole package came: the stalled client was waited for"
    assert time.monotonic() - t0 < 30
    r = api.get(f"{service.url}/v1/artifacts/{key}", timeout=60)  # the API serves on
    assert r.status_code == 200 and len(r.content) == size


def test_a_weights_blob_is_served_pulled_once_verified_and_refused_when_tampered(service: Service, tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    from client import Client

    weights = tmp_path / "w.safetensors"
    with open(weights, "wb") as f:
        write(f, [("head.weight", "float32", (256, 512), os.urandom(256 * 512 * 4)), ("head.bias", "float32", (4,),
                                                                                       os.urandom(16))], {})
    key, _ = service.publish(tmp_path, 50_000, weights=weights)
    other, _ = service.publish(tmp_path, 50_000, weights=weights)  # a second bucket: the same blob
    plain, _ = service.publish(tmp_path, 50_000)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert service.store.r.smembers(keys.weights_users(digest)) == {key, other}

    r = api.get(f"{service.url}/v1/artifacts/{key}/weights", headers={"Range": "bytes=8-15"}, timeout=60)
    if service.backend == "s3":
        assert r.status_code == 307 and r.headers["etag"] == f'"{digest}"'
    else:
        assert r.status_code == 206 and r.content == weights.read_bytes()[8:16] and r.headers["etag"] == f'"{digest}"'
    r = api.get(f"{service.url}/v1/artifacts/{plain}/weights", timeout=60)
    assert r.status_code == 409 and "carries its own weights" in r.json()["error"]["message"]

    sent = _spy_requests(monkeypatch)
    with Client(service.url, cache_dir=tmp_path / "cache") as c:
        got = c.pull_weights(key)
        assert got is not None and got.read_bytes() == weights.read_bytes()
        assert c.pull_weights(other) == got  # the other bucket names the same blob: nothing more comes down
        assert [x.path for x in sent if x.path.endswith("/weights")] == [f"/v1/artifacts/{key}/weights"]
        assert c.pull_weights(plain) is None

    # A new process (the per-process memo empty) finds the blob by its verified record: its bytes are not read again.
    from client import sdk

    sdk._VERIFIED.clear()
    hashed: list[Path] = []
    whole_file_digest = sdk._file_digest
    monkeypatch.setattr(sdk, "_file_digest", lambda p, a: hashed.append(p) or whole_file_digest(p, a))
    with Client(service.url, cache_dir=tmp_path / "cache") as c:
        assert c.pull_weights(key) == got and hashed == []
        # Beside a package (`aotc pull -o`): a hard link to the verified blob, not hashed a second time.
        beside = c.pull_weights(key, tmp_path / "beside" / "x.weights.safetensors")
        assert beside is not None and beside.stat().st_ino == got.stat().st_ino and hashed == []
    monkeypatch.setattr(sdk, "_file_digest", whole_file_digest)

    # The stored bytes swapped for others: the client refuses them, keeping nothing.
    tampered = tmp_path / "t.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    tampered.write_bytes(bytes(data))
    with open(tampered, "rb") as f:
        service.store.blobs.put("weights", digest, f)
    with Client(service.url, cache_dir=tmp_path / "fresh") as c:
        with pytest.raises(BadSignature, match="arrived corrupt or tampered with"):
            c.pull_weights(key)
    assert not list((tmp_path / "fresh" / "weights").glob("*.safetensors"))
