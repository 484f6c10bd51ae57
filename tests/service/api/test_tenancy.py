"""No tenant can starve another: event streams hold no pooled Redis connection, streams and uploads are capped per
API key across API processes, slow clients are cut off (408), the job quota is admitted atomically, and
`aotc-server` keeps its data dir private. Real processes throughout: uvicorn (or `aotc-server`) over HTTP, the
session's redis-server, and for the data-dir test a real worker running a real sandboxed compile.

No real worker serves the made-up target most of these tests use: a registry record makes the API accept jobs for
it, so they stay queued (the job a crowd of streams watches), and the test moves one along through the Store as a
worker would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from compiler import cachekey
from compiler.errors import Failure
from modelzoo import MLP, export, seeded
from procs import ADMIN_KEY, AotcServer, api, start_api, stop
from service.store import Store, keys
from service.store.leases import Lease

TARGET = f"cpu-ztenancy-{uuid.uuid4().hex[:8]}"
ART_TARGET = "cpu-x86_64-test"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key(url: str, scope: str, ns: str) -> str:
    r = api.post(f"{url}/v1/keys", json={"scope": scope, "namespace": ns, "name": f"tenancy {scope}"})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


@pytest.fixture
def servers() -> Iterator[list[AotcServer]]:
    started: list[AotcServer] = []
    yield started
    for s in started:
        stop(s.proc)


@pytest.fixture(scope="module")
def fake_target(store: Store) -> Iterator[str]:
    store.workers.heartbeat({"id": f"fake-{TARGET}", "target": TARGET, "toolchain": {"torch": "fake"},
                             "device_name": "none", "started": time.time()}, ttl_s=3600)
    yield TARGET
    store.workers.remove(f"fake-{TARGET}")


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    batch = torch.export.Dim("batch", min=1, max=64)  # many static shapes: many distinct jobs of one model
    path = export(seeded(MLP, int(uuid.uuid4().int % 10**6), d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),),
                  tmp_path_factory.mktemp("tenancy") / "m.pt2", dynamic_shapes={"x": {0: batch}})
    return path.read_bytes()


# Tight limits, so that each can be met in a second or two: 3 streams and 2 uploads per key, 2 s leases, a body
# must not stall 1.5 s nor average under 1 KiB/s, no body but an upload's may pass 8 KiB, and a namespace keeps
# the records of 5 jobs.
LIMITS = {"AOTC_MAX_STREAMS_PER_KEY": "3", "AOTC_MAX_UPLOADS_PER_KEY": "2", "AOTC_SLOT_LEASE_S": "2",
          "AOTC_BODY_IDLE_TIMEOUT_S": "1.5", "AOTC_BODY_MIN_RATE_KBPS": "1", "AOTC_MAX_BODY_KB": "8",
          "AOTC_NS_KEPT_JOBS": "5"}


@pytest.fixture(scope="module")
def limited(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two API processes on the session Redis with LIMITS: [(url, proc), (url, proc)]."""
    logs = tmp_path_factory.mktemp("limited")
    env = {**service_env, **LIMITS}
    apis = [list(start_api(env, logs / f"api-{i}.log")) for i in range(2)]
    yield apis
    for _, proc in apis:
        stop(proc)


def _upload(url: str, key: str, body: bytes) -> str:
    r = httpx.post(f"{url}/v1/models", content=body, headers=_bearer(key), timeout=30)
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _queued_job(url: str, key: str, model: bytes, batch: int) -> str:
    """A queued job of its own: each test uses its own batch size (the quota test takes 1..48), since the same
    model, shape and target from another namespace would join that namespace's job."""
    model_id = _upload(url, key, model)
    r = httpx.post(f"{url}/v1/compilations", headers=_bearer(key), timeout=30,
                   json={"model_id": model_id, "shapes": {"x": [batch, 4]}, "target": TARGET})
    assert r.status_code == 202, r.text
    return str(r.json()["job"]["id"])


class Streams:
    """`n` event streams of one job, held open from a background event loop; each records the events it got."""

    def __init__(self, url: str, job_id: str, key: str, n: int) -> None:
        self.events: list[list[str]] = [[] for _ in range(n)]
        self.statuses: list[int] = [0] * n
        self.ready = threading.Semaphore(0)
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, args=(url, job_id, key, n), daemon=True)
        self.thread.start()

    def _main(self, url: str, job_id: str, key: str, n: int) -> None:
        try:
            self.loop.run_until_complete(self._run(url, job_id, key, n))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()

    async def _run(self, url: str, job_id: str, key: str, n: int) -> None:
        self._stop = asyncio.Event()
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, headers=_bearer(key), limits=limits,
                                     timeout=httpx.Timeout(30, read=60)) as http:
            tasks = [asyncio.create_task(self._one(http, job_id, i)) for i in range(n)]
            done = asyncio.create_task(self._stop.wait())
            await asyncio.wait([*tasks, done], return_when=asyncio.FIRST_COMPLETED)
            await asyncio.wait(tasks, timeout=30) if not self._stop.is_set() else None
            for t in [*tasks, done]:
                t.cancel()
            await asyncio.gather(*tasks, done, return_exceptions=True)

    async def _one(self, http: httpx.AsyncClient, job_id: str, i: int) -> None:
        try:
            async with http.stream("GET", f"/v1/jobs/{job_id}/events") as r:
                self.statuses[i] = r.status_code
                if r.status_code != 200:
                    self.ready.release()
                    return
                released = False
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        self.events[i].append(line[7:])
                        if not released:
                            released = True
                            self.ready.release()
                        if line[7:] in ("end", "unavailable"):
                            return
        except (httpx.HTTPError, OSError):
            self.ready.release()

    def wait_ready(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(n):
            assert self.ready.acquire(timeout=max(0.1, deadline - time.monotonic())), "streams did not open"

    def close(self) -> None:
        if self._stop is not None and self.thread.is_alive():
            try:
                self.loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has just finished
                pass
        self.thread.join(30)


def _take(store: Store, job_id: str) -> Lease:
    """Claim the fake target's queue entry for `job_id` and start it, as a worker does."""
    stream = keys.queue(TARGET, "interactive")
    for _ in range(100):
        for msg_id, fields in (store.r.xreadgroup(keys.QUEUE_GROUP, "fake-worker", {stream: ">"}, count=50) or
                               [(stream, [])])[0][1]:
            lease = Lease(stream, msg_id, "fake-worker")
            if fields["job"] == job_id:
                assert store.jobs.start(job_id, lease) == ("running", 1)
                return lease
            store.r.xack(stream, keys.QUEUE_GROUP, msg_id)  # another test's job: not ours to run
        time.sleep(0.05)
    raise AssertionError("no queue entry")


def _publish(store: Store, tmp: Path, model_id: str) -> None:
    """An artifact of `model_id`, stored as a worker would store one (its bytes made up)."""
    factors = cachekey.factors(model_id, [{"name": "x", "dtype": "float32", "shape": [2, 4]}], ART_TARGET,
                               {"torch": "test"}, {})
    key = cachekey.cache_key(factors)
    package = tmp / f"{key}.pt2"
    package.write_bytes(b"package of " + key.encode())
    store.artifacts.put({"key": key, "factors": factors, "model_id": model_id, "target": ART_TARGET,
                         "spec": factors["spec"], "options": {}, "created": time.time()}, package)


def test_eighty_streams_on_one_key_leave_other_tenants_lookups_fast(service_env, store, fake_target, model_bytes,
                                                                      tmp_path):
    # One API process, whose Redis pool has 64 connections; 80 streams of one key, on one queued job.
    url, proc = start_api({**service_env, "AOTC_MAX_STREAMS_PER_KEY": "200"}, tmp_path / "api.log")
    try:
        tag = uuid.uuid4().hex[:6]
        streamer = _key(url, "compile", f"streamer-{tag}")
        job_id = _queued_job(url, streamer, model_bytes, batch=50)
        other = _key(url, "compile", f"other-{tag}")
        model_id = _upload(url, other, model_bytes)
        _publish(store, tmp_path, model_id)
        lookup = f"/v1/artifacts/lookup?model_id={model_id}&target={ART_TARGET}&shape=x=2x4"
        assert httpx.get(url + lookup, headers=_bearer(other)).status_code == 200

        streams = Streams(url, job_id, streamer, 80)
        try:
            streams.wait_ready(80)
            assert streams.statuses == [200] * 80
            time.sleep(1.5)  # every stream is past its history, waiting live

            results: list[tuple[int, float]] = []

            def tenant(n: int) -> None:
                with httpx.Client(base_url=url, headers=_bearer(other), timeout=15) as http:
                    end = time.monotonic() + 3
                    while time.monotonic() < end:
                        t0 = time.perf_counter()
                        status = http.get(lookup).status_code
                        results.append((status, time.perf_counter() - t0))

            with ThreadPoolExecutor(4) as pool:
                list(pool.map(tenant, range(4)))
            statuses = sorted({s for s, _ in results})
            times = sorted(t for _, t in results)
            p99 = times[int(0.99 * (len(times) - 1))]
            print(f"\nother tenant's lookups beside 80 streams: {len(results)} in 3 s, statuses {statuses}, "
                  f"p50 {statistics.median(times) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, "
                  f"max {times[-1] * 1000:.1f} ms")
            assert statuses == [200], statuses
            assert times[-1] < 2.0, f"the slowest lookup took {times[-1]:.2f} s"

            # The streams still follow the job, each of them: a change reaches all 80, then the end.
            lease = _take(store, job_id)
            store.jobs.finish(job_id, "cancelled", lease=lease, error=Failure.cancelled("done watching", "fetch"))
            streams.thread.join(30)
            assert all(ev[-3:] == ["state", "state", "end"] for ev in streams.events), streams.events[:3]
        finally:
            streams.close()
    finally:
        stop(proc)


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    t0, out = time.monotonic(), b""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        raise AssertionError(f"the server kept the connection open {timeout} s; it sent {out[:200]!r}") from None
    except ConnectionResetError:
        pass
    return out, time.monotonic() - t0


def test_stream_cap_per_key_is_429_naming_the_setting_across_processes_and_a_dead_process_frees_its_slots(
        limited, fake_target, model_bytes, service_env, tmp_path):
    (url_a, _), (url_b, _) = limited
    tag = uuid.uuid4().hex[:6]
    key, neighbour = _key(url_a, "compile", f"cap-{tag}"), _key(url_a, "compile", f"cap-{tag}")
    job_id = _queued_job(url_a, key, model_bytes, batch=51)
    events = f"/v1/jobs/{job_id}/events"

    held = Streams(url_a, job_id, key, 3)
    try:
        held.wait_ready(3)
        assert held.statuses == [200] * 3
        for url in (url_a, url_b):  # the other API process counts the same slots
            r = httpx.get(url + events, headers=_bearer(key), timeout=10)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "key_limit" and err["setting"] == "AOTC_MAX_STREAMS_PER_KEY"
            assert "AOTC_MAX_STREAMS_PER_KEY" in err["message"] and int(r.headers["retry-after"]) > 0
        # Another key of the same namespace has slots of its own.
        with httpx.stream("GET", url_b + events, headers=_bearer(neighbour), timeout=10) as r:
            assert r.status_code == 200
    finally:
        held.close()
    deadline = time.monotonic() + 5  # closed streams give their slots back at once
    while (status := _stream_status(url_b + events, key)) != 200:
        assert status == 429 and time.monotonic() < deadline, status

    # A process that dies holding slots: they lapse within AOTC_SLOT_LEASE_S (2 s).
    url_c, proc_c = start_api({**service_env, **LIMITS}, tmp_path / "api-c.log")
    doomed = Streams(url_c, job_id, key, 3)
    try:
        doomed.wait_ready(3)
        assert _stream_status(url_a + events, key) == 429
        proc_c.send_signal(signal.SIGKILL)
        proc_c.wait()
        t0 = time.monotonic()
        while (status := _stream_status(url_a + events, key)) != 200:
            assert status == 429 and time.monotonic() - t0 < 10, status
            time.sleep(0.2)
        print(f"\nslots of a killed API process came back after {time.monotonic() - t0:.1f} s (lease 2 s)")
    finally:
        doomed.close()
        stop(proc_c)


def _stream_status(url: str, key: str) -> int:
    with httpx.stream("GET", url, headers=_bearer(key), timeout=10) as r:
        return r.status_code


def test_upload_cap_per_key_is_429_naming_the_setting(limited, model_bytes):
    (url_a, _), (url_b, _) = limited
    tag = uuid.uuid4().hex[:6]
    key, neighbour = _key(url_a, "compile", f"up-{tag}"), _key(url_a, "compile", f"up-{tag}")
    release = threading.Event()
    answers: list[int] = []

    def slow_upload(url: str) -> None:
        def body() -> Iterator[bytes]:
            yield model_bytes[:4096]
            while not release.wait(0.3):  # 4 KiB every 0.3 s: never idle, above the minimum rate
                yield b""
            yield model_bytes[4096:]
        r = httpx.post(f"{url}/v1/models", content=body(), headers=_bearer(key), timeout=60)
        answers.append(r.status_code)

    uploads = [threading.Thread(target=slow_upload, args=(u,)) for u in (url_a, url_b)]
    for t in uploads:
        t.start()
    try:
        time.sleep(1.0)  # both are in progress, one on each API process
        for url in (url_a, url_b):
            r = httpx.post(f"{url}/v1/models", content=model_bytes, headers=_bearer(key), timeout=30)
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "key_limit" and "AOTC_MAX_UPLOADS_PER_KEY" in err["message"]
            assert int(r.headers["retry-after"]) > 0
        assert _upload(url_a, neighbour, model_bytes)  # another key is not held back
    finally:
        release.set()
        for t in uploads:
            t.join(30)
    assert sorted(answers) in ([200, 201], [200, 200], [201, 201]), answers
    assert _upload(url_b, key, model_bytes)  # the slots came back


def test_a_stalled_or_trickling_body_is_408_naming_the_setting(limited, fake_target, model_bytes):
    (url, _), _ = limited
    key = _key(url, "compile", f"slow-{uuid.uuid4().hex[:6]}")
    auth = f"Authorization: Bearer {key}\r\n".encode()

    # Stalled: part of an upload (more than the minimum rate asks for), then nothing.
    sock = _raw(url)
    sock.sendall(b"POST /v1/models HTTP/1.1\r\nHost: t\r\n" + auth + b"Content-Length: 100000\r\n\r\n" +
                 model_bytes[:4000])
    out, took = _read_all(sock, 10)
    assert out.startswith(b"HTTP/1.1 408 ") and b"AOTC_BODY_IDLE_TIMEOUT_S" in out, out
    assert b"connection: close" in out.lower() and took < 4, took

    # Trickling: a byte every 0.25 s is never idle for 1.5 s, but far under 1 KiB/s.
    sock = _raw(url)
    sock.sendall(b"POST /v1/models HTTP/1.1\r\nHost: t\r\n" + auth + b"Content-Length: 100000\r\n\r\n")
    t0, out = time.monotonic(), b""
    sock.settimeout(0.25)
    for i in range(60):
        try:
            sock.sendall(model_bytes[i:i + 1])
            out += sock.recv(65536)
            break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    rest, _ = _read_all(sock, 10)
    out += rest
    assert out.startswith(b"HTTP/1.1 408 ") and b"AOTC_BODY_MIN_RATE_KBPS" in out, out
    assert time.monotonic() - t0 < 6

    # A JSON body read by FastAPI itself stalls the same way: 408, not a 400 "error parsing the body".
    sock = _raw(url)
    sock.sendall(b"POST /v1/compilations HTTP/1.1\r\nHost: t\r\n" + auth +
                 b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model_id\": ")
    out, _ = _read_all(sock, 10)
    assert out.startswith(b"HTTP/1.1 408 ") and b"(AOTC_BODY_" in out, out


def test_a_body_over_the_limit_is_413_before_a_key_is_checked_and_an_upload_is_not_held_to_it(limited, model_bytes):
    """FastAPI reads and parses a JSON body before its dependencies check the key: a caller with no key once had
    the API hold a 100 MiB body (its peak memory 78 -> 696 MB, 543 MB kept). Now every body but an upload's is
    refused past AOTC_MAX_BODY_KB, from its Content-Length or as its bytes pass it."""
    (url, _), _ = limited
    # Announced: refused at once, whatever follows (nothing does here), with no key.
    sock = _raw(url)
    sock.sendall(b"POST /v1/compilations HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 104857600\r\n\r\n{\"model_id\": \"")
    out, took = _read_all(sock, 10)
    assert out.startswith(b"HTTP/1.1 413 ") and b"AOTC_MAX_BODY_KB=8" in out and b"is 104857600 bytes" in out, out
    assert took < 5
    # Chunked (no length said): refused once 8 KiB have come, not after the whole body.
    sock = _raw(url)
    sock.sendall(b"POST /v1/keys HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b'"' + b"x" * 4094 + b'"'
    sent = 0
    try:
        for _ in range(64):  # 256 KiB if the server took it all
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    out, _ = _read_all(sock, 10)
    assert out.startswith(b"HTTP/1.1 413 ") and b"passed 8192 bytes" in out, out
    # A JSON body within the limit is the route's business (no key: 401), and an upload is held to its own limit.
    r = httpx.post(f"{url}/v1/compilations", json={"model_id": "0" * 64, "shapes": {}}, timeout=30)
    assert r.status_code == 401, r.text
    assert len(model_bytes) > 8 * 1024
    key = _key(url, "compile", f"big-{uuid.uuid4().hex[:6]}")
    assert _upload(url, key, model_bytes)


def test_submitting_and_cancelling_in_a_loop_keeps_a_namespaces_jobs_bounded(limited, fake_target, model_bytes, store):
    """Cancelling a queued job frees its quota slot at once, and job records were never deleted: a compile key that
    submitted and cancelled in a loop grew Redis by 8 KB a job (0.6 MiB/s from one client) until Redis, which must
    not evict, was full for every tenant. Now each new job lets go of the namespace's oldest ended ones past
    AOTC_NS_KEPT_JOBS (5 here); their records and event streams go with them."""
    (url, _), _ = limited
    ns = f"spam-{uuid.uuid4().hex[:6]}"
    key = _key(url, "compile", ns)
    ids = []
    for _ in range(12):
        job_id = _queued_job(url, key, model_bytes, batch=54)
        ids.append(job_id)
        r = httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_bearer(key), timeout=30)
        assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text
    assert len(set(ids)) == 12
    kept = store.namespaces.job_ids(ns, 100)
    assert kept == ids[-5:][::-1], (kept, ids)  # the newest first
    listed = httpx.get(f"{url}/v1/jobs", headers=_bearer(key), params={"limit": 100}, timeout=30).json()["jobs"]
    assert [j["id"] for j in listed] == kept
    for gone in ids[:7]:
        assert httpx.get(f"{url}/v1/jobs/{gone}", headers=_bearer(key), timeout=30).status_code == 404
        assert not store.r.exists(keys.job(gone)) and not store.r.exists(keys.job_events(gone))


def test_concurrent_compile_requests_admit_exactly_the_job_quota(limited, fake_target, model_bytes):
    (url_a, _), (url_b, _) = limited
    max_jobs, n = 2, 16
    for rnd in range(3):  # a race on main overshoots often, not every time: three rounds
        ns = f"quota-{uuid.uuid4().hex[:6]}"
        key = _key(url_a, "compile", ns)
        assert api.put(f"{url_a}/v1/namespaces/{ns}/quota", json={"max_jobs": max_jobs}).status_code == 200
        model_id = _upload(url_a, key, model_bytes)
        go = threading.Barrier(n)

        def request(i: int) -> httpx.Response:
            with httpx.Client(headers=_bearer(key), timeout=30) as http:
                body = {"model_id": model_id, "shapes": {"x": [1 + i + 16 * rnd, 4]}, "target": TARGET}
                go.wait()
                return http.post(f"{(url_a, url_b)[i % 2]}/v1/compilations", json=body)

        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(request, range(n)))
        codes = sorted(r.status_code for r in answers)
        assert codes == [202] * max_jobs + [429] * (n - max_jobs), (rnd, codes)
        refused = [r.json()["error"] for r in answers if r.status_code == 429]
        assert all(e["code"] == "quota_jobs" and "max_jobs" in e["message"] for e in refused)
        me = httpx.get(f"{url_a}/v1/me", headers=_bearer(key)).json()
        assert me["usage"]["jobs"] == max_jobs, me


def test_aotc_server_closes_half_sent_requests_with_408(tmp_path, servers, monkeypatch, model_bytes):
    monkeypatch.setenv("AOTC_HEADER_TIMEOUT_S", "1.5")
    # uvicorn.run and the Multiprocess path; each HTTP parser (AOTC_HTTP; httptools is the default when installed)
    for api_workers, parser in (("1", "h11"), ("2", "httptools")):
        monkeypatch.setenv("AOTC_HTTP", parser)
        server = AotcServer(tmp_path / f"data-{api_workers}", "--workers", "0", "--api-workers", api_workers)
        servers.append(server)
        server.wait_ready()

        sock = _raw(server.url)  # half a request line and a header, then nothing
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        out, took = _read_all(sock, 10)
        assert out.startswith(b"HTTP/1.1 408 ") and b"AOTC_HEADER_TIMEOUT_S" in out, out
        assert 1.0 < took < 4, took

        sock = _raw(server.url)  # a connection that says nothing is closed too
        out, took = _read_all(sock, 10)
        assert out == b"" and took < 4, (out, took)

        sock = _raw(server.url)  # on a kept-alive connection the deadline runs from the end of the last answer
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        sock.settimeout(5)
        first = b""
        while not first.endswith(b'{"ok":true}'):  # the head and the body may come in two reads
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        time.sleep(0.5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        out, took = _read_all(sock, 10)
        assert out.startswith(b"HTTP/1.1 408 "), out

        # A request sent whole is the route's from then on, however long its answer lasts: an event stream
        # outlives the header deadline.
        store = Store(server.redis_url)
        try:
            store.workers.heartbeat({"id": "fake", "target": TARGET, "toolchain": {"torch": "fake"},
                                     "device_name": "none", "started": time.time()}, ttl_s=600)
            job_id = _queued_job(server.url, ADMIN_KEY, model_bytes, batch=2)
            with httpx.stream("GET", f"{server.url}/v1/jobs/{job_id}/events", headers=_bearer(ADMIN_KEY),
                              timeout=10) as r:
                lines = r.iter_lines()
                while next(lines) != "event: state":
                    pass
                time.sleep(3)  # twice the header deadline, in silence
                assert api.delete(f"{server.url}/v1/jobs/{job_id}").status_code == 200
                rest = list(lines)
            assert "event: end" in rest, rest
        finally:
            store.close()
        stop(server.proc)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if not stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = stat.S_IMODE(st.st_mode)
    return out


@pytest.mark.slow
def test_aotc_server_refuses_a_head_over_the_limit_with_431_and_never_parses_it(tmp_path, servers, monkeypatch,
                                                                                 model_bytes):
    """httptools has no limit on a request's head: a 128 MiB header held the API's event loop for 21 s (every other
    tenant waited), 256 MiB for 126 s. Now aotc-server's httptools protocol feeds the parser no more than
    AOTC_MAX_HEADER_KB of a request's line and headers; a body, even one that arrives with its headers in one
    read, is not counted."""
    monkeypatch.setenv("AOTC_HTTP", "httptools")
    monkeypatch.setenv("AOTC_MAX_HEADER_KB", "8")
    server = AotcServer(tmp_path / "data", "--workers", "0", "--api-workers", "1")
    servers.append(server)
    server.wait_ready()

    sock = _raw(server.url)
    t0 = time.monotonic()
    try:  # 32 MiB of one header's value, sent until the server stops reading
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (32 << 20))
    except (BrokenPipeError, ConnectionResetError):
        pass
    out, _ = _read_all(sock, 10)
    assert out.startswith(b"HTTP/1.1 431 ") and b"AOTC_MAX_HEADER_KB=8" in out, out
    assert time.monotonic() - t0 < 5
    assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200

    # Within the limit, over several reads and on a kept-alive connection: answered as ever.
    sock = _raw(server.url)
    for _ in range(2):
        for piece in (b"GET /healthz HTTP/1.1\r\nHost: t\r\n", b"X-Pad: " + b"p" * 6000 + b"\r\n", b"\r\n"):
            sock.sendall(piece)
        got = b""
        sock.settimeout(5)
        while not got.endswith(b'{"ok":true}'):
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200 "), got
    sock.close()

    # An upload's head and body in one write: the body's bytes are not the head's.
    r = httpx.post(f"{server.url}/v1/models", content=model_bytes * 8, headers=_bearer(ADMIN_KEY), timeout=30)
    assert len(model_bytes) * 8 > 8 * 1024 and r.status_code != 431, r.text


def test_aotc_server_keeps_its_data_dir_private_and_a_sandboxed_compile_still_runs(tmp_path, servers):
    data = tmp_path / "data"
    # What an older version left: world-readable dirs, and a Redis log that redis-server goes on appending to.
    (data / "redis").mkdir(parents=True)
    (data / "redis" / "redis.log").write_text("an older server's log\n")
    for path, mode in ((data, 0o755), (data / "redis", 0o755), (data / "redis" / "redis.log", 0o644)):
        os.chmod(path, mode)

    server = AotcServer(data, "--workers", "1", "--device", "cpu", "--api-workers", "2")
    servers.append(server)
    server.wait_ready(targets=1)
    model = export(seeded(MLP, 7, d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),), tmp_path / "m.pt2")
    up = api.post(f"{server.url}/v1/models", content=model.read_bytes(), timeout=60)
    assert up.status_code == 201, up.text
    r = api.post(f"{server.url}/v1/compilations", json={"model_id": up.json()["id"], "shapes": {"x": [2, 4]},
                                                          "target": "cpu"}, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["job"]["id"]
    deadline = time.monotonic() + 600
    while (job := api.get(f"{server.url}/v1/jobs/{job_id}").json())["state"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(1)
    assert job["state"] == "succeeded", job  # the sandboxed compile and check still read what they need
    assert api.get(f"{server.url}/v1/workers").json()["workers"][0]["sandbox"] == "on"

    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    modes = _modes(data)
    aof = [p for p in modes if p.startswith("redis/appendonly")]  # Redis 6: one file; 7: appendonlydir/
    assert aof and "redis/password" in modes and "redis/redis.log" in modes, sorted(modes)
    assert any(p.startswith("blobs/") for p in modes) and any(p.startswith("signing/") for p in modes)
    work = {p for p in modes if p.startswith(("work/", "work-"))}  # the worker sets modes for its children there
    loose = {p: oct(m) for p, m in modes.items() if m & 0o077 and p not in work}
    assert not loose, loose
    assert modes["work"] & 0o077 == 0 and modes["redis"] == 0o700
    stop(server.proc)


def test_the_sdk_waits_through_a_429_on_its_event_stream(limited, fake_target, model_bytes, tmp_path):
    from client import Client
    from client.sdk import JobFailed

    (url, _), _ = limited
    key = _key(url, "compile", f"sdk-{uuid.uuid4().hex[:6]}")
    job_id = _queued_job(url, key, model_bytes, batch=52)
    held = Streams(url, job_id, key, 3)  # every stream slot of the key
    outcome: dict[str, BaseException] = {}

    def wait() -> None:
        try:
            with Client(url, api_key=key, cache_dir=tmp_path / "cache") as c:
                c.wait(job_id, poll_s=0.2, timeout=60)
        except BaseException as e:  # noqa: BLE001 - the test looks at what ended the wait
            outcome["e"] = e

    try:
        held.wait_ready(3)
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(1.5)  # it is refused (429) and keeps trying
        assert waiter.is_alive(), outcome
    finally:
        held.close()  # a slot frees: the SDK's stream gets in
    time.sleep(1.0)
    assert httpx.delete(f"{url}/v1/jobs/{job_id}", headers=_bearer(key)).status_code == 200
    waiter.join(30)
    assert isinstance(outcome.get("e"), JobFailed) and outcome["e"].job["state"] == "cancelled", outcome


def test_a_job_keeps_the_namespace_that_created_it_for_its_tuning_share_and_no_view_shows_it(
        limited, fake_target, model_bytes, store):
    """The worker shares max-autotune timings within the namespace whose request created the job (worker/tuning.py):
    a second namespace's identical request joins the job without changing that, and neither namespace's view of the
    job (the compile answer, GET /v1/jobs/{id}, the listing) names who asked first."""
    (url_a, _), (url_b, _) = limited
    first, second = (f"tune-{c}-{uuid.uuid4().hex[:6]}" for c in "ab")
    key_a, key_b = _key(url_a, "compile", first), _key(url_a, "compile", second)
    job_id = _queued_job(url_a, key_a, model_bytes, batch=53)
    model_id = _upload(url_b, key_b, model_bytes)
    r = httpx.post(f"{url_b}/v1/compilations", headers=_bearer(key_b), timeout=30,
                   json={"model_id": model_id, "shapes": {"x": [53, 4]}, "target": TARGET})
    assert r.status_code == 202 and r.json()["job"]["id"] == job_id, r.text  # the same job, joined
    assert store.jobs.namespace_of(job_id) == first
    for url, key in ((url_a, key_a), (url_b, key_b)):
        seen = [r.json()["job"], httpx.get(f"{url}/v1/jobs/{job_id}", headers=_bearer(key), timeout=30).json(),
                *httpx.get(f"{url}/v1/jobs", headers=_bearer(key), timeout=30).json()["jobs"]]
        for view in seen:
            assert "namespace" not in view and first not in json.dumps(view), view
