"""The SDK's HTTP side against a scripted transport: following a job's events across reconnects, pulling and
verifying an artifact, shapes read before they are sent. tests/e2e runs the same calls against a real service."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from client.sdk import Client, ClientError, JobFailed
from compiler.digests import Want, file_digests
from compiler.errors import BadSignature
from compiler.signing import Signer, key_record, statement
from procs import ROOT

JOB = "a26295e1974f4d7eb225520e162a5310"
KEY = "491be8f7" * 4
BLOB = b"an AOTInductor package" * 100
META = {"key": KEY, "sha256": hashlib.sha256(BLOB).hexdigest(), "size": len(BLOB), "target": "cpu"}
SIGNER = Signer.generate()
MANIFEST = SIGNER.sign(statement(artifact_key=KEY, package_sha256=META["sha256"], package_size=len(BLOB),
                                 model_sha256="0" * 64, factors={}, toolchain={}, target="cpu", check={},
                                 worker={"id": "test"}))


def signed(request: httpx.Request) -> httpx.Response | None:
    """The service's answers about signatures: the manifest of KEY and the key that signed it."""
    if request.url.path == f"/v1/artifacts/{KEY}/manifest":
        return httpx.Response(200, json=MANIFEST)
    if request.url.path == "/v1/signing-keys":
        return httpx.Response(200, json={"keys": [key_record(SIGNER.public)]})
    return None


def frame(event: str, data: object, event_id: str | None = None) -> str:
    return (f"id: {event_id}\n" if event_id else "") + f"event: {event}\ndata: {json.dumps(data)}\n\n"


def sse(*frames: str) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, text="retry: 1000\n\n" + "".join(frames))


def scripted(tmp_path, handler: Callable[[httpx.Request], httpx.Response]) -> Client:
    c = Client("http://aotc.test", cache_dir=tmp_path / "cache")
    c.http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(handler))
    return c


def test_wait_follows_the_events_and_resumes_after_the_last_one_seen(tmp_path):
    streams = [
        sse(frame("state", {"state": "queued", "stage": "queued"}, "1-0"),
            ": keepalive\n\n",
            frame("state", {"state": "running", "stage": "fetch", "attempt": "1"}, "2-0"),
            frame("unavailable", {})),  # the API is going away: reconnect
        httpx.Response(503, json={"error": {"message": "redis is down"}}),
        sse(frame("state", {"state": "running", "stage": "capture"}, "3-0"),
            frame("end", {"id": JOB, "state": "succeeded", "stage": "succeeded", "artifact": KEY})),
    ]
    resumed_after: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == f"/v1/jobs/{JOB}/events":
            assert request.headers["accept"] == "text/event-stream"
            resumed_after.append(request.headers.get("last-event-id"))
            return streams.pop(0)
        assert request.url.path == f"/v1/artifacts/{KEY}/meta"
        return httpx.Response(200, json=META)

    seen: list[tuple[str, str, int]] = []
    with scripted(tmp_path, handler) as c:
        art = c.wait(JOB, progress=lambda j: seen.append((j["state"], j["stage"], j.get("attempts", 0))),
                     poll_s=0.01)
    assert art.key == KEY and art.sha256 == META["sha256"]
    assert resumed_after == [None, "2-0", "2-0"]
    assert seen == [("queued", "queued", 0), ("running", "fetch", 1), ("running", "capture", 1),
                    ("succeeded", "succeeded", 0)]


def test_wait_raises_job_failed_with_the_jobs_error(tmp_path):
    failed = {"id": JOB, "state": "failed", "stage": "failed",
              "error": {"stage": "capture", "message": "input 'x' dim 0 is 300, the exported program allows 1..256"}}

    with scripted(tmp_path, lambda request: sse(frame("end", failed))) as c, pytest.raises(JobFailed) as got:
        c.wait(JOB)
    assert str(got.value) == f"job {JOB} failed at stage capture: {failed['error']['message']}"


def test_wait_reports_an_unknown_job_as_refused(tmp_path):
    gone = httpx.Response(404, json={"error": {"message": f"no job {JOB}"}})
    with scripted(tmp_path, lambda request: gone) as c, pytest.raises(ClientError) as got:
        c.wait(JOB)
    assert got.value.status == 404 and got.value.message == f"no job {JOB}"


def test_pull_verifies_the_sha256_and_reuses_the_cached_copy(tmp_path):
    downloads = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/meta"):
            return httpx.Response(200, json=META)
        if (answer := signed(request)) is not None:
            return answer
        downloads.append(request.url.path)
        return httpx.Response(200, content=BLOB)

    with scripted(tmp_path, handler) as c:
        first = c.pull(KEY, tmp_path / "out" / "model.pt2")
        again = c.pull(KEY, tmp_path / "again.pt2")
    assert first.read_bytes() == again.read_bytes() == BLOB
    assert downloads == [f"/v1/artifacts/{KEY}"]  # the second came from the cache, its hash checked
    assert (tmp_path / "cache" / "artifacts" / f"{KEY}.pt2").read_bytes() == BLOB


def test_pull_refuses_a_corrupt_download(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/meta"):
            return httpx.Response(200, json=META)
        if (answer := signed(request)) is not None:
            return answer
        return httpx.Response(200, content=BLOB[:-1] + b"!")

    with scripted(tmp_path, handler) as c, pytest.raises(BadSignature, match="arrived corrupt"):
        c.pull(KEY)
    assert not list((tmp_path / "cache" / "artifacts").iterdir())


def test_lookup_sends_shapes_in_the_grammar_compiler_shapes_reads(tmp_path):
    asked: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params.get_list("shape"))
        return httpx.Response(200, json=META)

    with scripted(tmp_path, handler) as c:
        art = c.lookup("a07a21adf616", {"x": [{"min": 1, "max": 32}, 3, 64, 64], "y": "8x4", "z": []})
    assert art is not None and art.key == KEY
    assert asked == [["x=1..32x3x64x64", "y=8x4", "z=scalar"]]


def test_a_shape_string_that_cannot_be_read_is_refused_before_any_request(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no request expected, got {request.url}")

    with scripted(tmp_path, handler) as c, pytest.raises(ClientError) as got:
        c.lookup("a07a21adf616", {"x": "8x3xbig"})
    assert got.value.status == 422 and "cannot read shape '8x3xbig'" in got.value.message


def test_a_pull_by_name_detects_the_cpu_level_without_torch():
    code = ("import sys; from client.sdk import detect_target; from compiler.targets import detect_cpu_target; "
            "print(detect_target('cpu'), detect_cpu_target(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    detected, expected, torch_loaded = out.stdout.split()
    assert detected == expected and torch_loaded == "False"


def test_a_weights_blob_rewritten_in_place_is_hashed_again_though_its_mtime_was_restored(tmp_path) -> None:
    """A process remembers the blobs it verified, so a second bucket skips hashing them. It remembered a file by
    its mtime alone, which whoever can write the file can also set back: same size, same mtime, other bytes were
    taken as verified. Now it keys on the file's identity as the pull's `.verified` record does (inode, device,
    mtime and ctime, which no one can set)."""
    import os
    import time

    from client import sdk
    from compiler.weightsfile import describe, read_header_file, write

    path = tmp_path / "w.safetensors"
    with open(path, "wb") as f:
        write(f, [("fc.weight", "float32", (4, 4), bytes(range(64)))], {})
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    signed = {"constants": describe(read_header_file(path))}
    want = Want.of(file_digests(path), path.stat().st_size)  # as a worker signs it: sha256 and BLAKE3
    assert want.algorithm == "blake3" and want.sha256 == sha
    assert sdk._weights_verified(path, want, signed)
    assert sdk._VERIFIED[path][0] == sha

    st = path.stat()
    time.sleep(0.05)  # past the file system's timestamp tick (a coarse clock: a jiffy, up to 10 ms)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a weight's byte: the header still reads the same
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino
    assert not sdk._weights_verified(path, want, signed)


def test_an_upload_the_service_names_with_another_model_id_is_refused(tmp_path) -> None:
    """A model's id is the sha256 of its bytes. Client.compile holds the artifact it gets back to that id (its
    signed manifest must name it), so the id must be the bytes' own, not whatever the service answers."""
    path = tmp_path / "m.pt2"
    path.write_bytes(b"not really a program, but bytes all the same")
    honest = hashlib.sha256(path.read_bytes()).hexdigest()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(201, json={"id": answer["id"], "inputs": []})

    answer = {"id": honest}
    with scripted(tmp_path, handler) as c:
        assert c.upload(path)["id"] == honest
        answer["id"] = "f" * 64
        with pytest.raises(BadSignature) as got:
            c.upload(path)
    assert got.value.reason == "mismatch" and f"its bytes' sha256 is {honest}" in got.value.message


def test_a_compile_answered_with_another_models_artifact_is_refused_before_a_byte_is_written(tmp_path) -> None:
    """What Client.compile returns is held to what it asked: the uploaded bytes' model (their sha256), the target,
    the shapes. Here the service answers the compile with an artifact validly signed for another model."""
    path = tmp_path / "m.pt2"
    path.write_bytes(b"the program's bytes")
    model_id = hashlib.sha256(path.read_bytes()).hexdigest()

    def handler(request: httpx.Request) -> httpx.Response:
        if (answer := signed(request)) is not None:
            return answer
        if request.url.path == "/v1/models":
            return httpx.Response(201, json={"id": model_id, "inputs": [{"name": "x", "shape": [4, 8]}]})
        if request.url.path == "/v1/compilations":
            return httpx.Response(200, json={"status": "cached", "key": KEY, "artifact": META})
        raise AssertionError(f"unexpected {request.method} {request.url}")  # no byte of the package is asked for

    with scripted(tmp_path, handler) as c:
        art = c.compile(path, {"x": [4, 8]}, target="cpu")
        assert art.key == KEY and art.asked is not None and art.asked.model_id == model_id
        with pytest.raises(BadSignature) as got:
            c.pull(art)
    assert got.value.reason == "mismatch"
    assert f"does not answer what the compile asked: it is signed as built from model None, not {model_id[:12]}" \
        in got.value.message
    assert not (tmp_path / "cache" / "artifacts").exists() or not list((tmp_path / "cache" / "artifacts").iterdir())


def _self_signed(tmp_path):
    """A certificate for 127.0.0.1 signed by its own key (cryptography, the SDK's signing dependency): files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem"


def test_a_client_of_a_plain_http_service_starts_without_the_ca_bundle_and_verifies_no_tls_it_is_sent_to(tmp_path):
    """httpx loads the CA bundle when a client is made (about 25 ms on 2 cores, in every serving process's start). A
    Client of a plain-HTTP service needs no bundle: its `http` gets a context that trusts no certificate, so a TLS
    request sent through it (an absolute https URL) fails its handshake instead of going unverified. An https
    service keeps httpx's default."""
    import http.server
    import ssl
    import threading

    from client.sdk import _tls_for

    ctx = _tls_for("http://127.0.0.1:8080")
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] == 0
    assert _tls_for("https://aotc.example") is True and _tls_for("HTTPS://aotc.example") is True

    cert, key = _self_signed(tmp_path)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}/"
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as trusting:
            assert trusting.get(url).status_code in (200, 404)  # the server answers a client that trusts it
        with Client("http://127.0.0.1:1", cache_dir=tmp_path / "cache") as c:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                c.http.get(url)
    finally:
        server.shutdown()


def test_the_verify_pool_works_in_a_process_forked_after_it_ran():
    """A server that preloads the client and forks workers (gunicorn --preload, multiprocessing's fork) copies the
    pool's bookkeeping but none of its threads: work handed to that pool in the child would wait forever. The child
    gets a pool of its own."""
    import os

    from client.verify import pool

    assert pool().submit(lambda: 1 + 1).result(timeout=10) == 2  # the parent's threads exist now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its work ran
        code = 1
        try:
            code = 0 if pool().submit(os.getpid).result(timeout=10) == os.getpid() else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool().submit(os.getpid).result(timeout=10) == os.getpid()
