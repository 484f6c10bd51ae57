"""Server-Sent Events, the CLI's live progress, and the API's graceful shutdown, without compiles.

The API runs as its own uvicorn process on the session Redis. No real worker serves the made-up target these
tests use: a registry record makes the API accept jobs for it, and the test drives each job through the same
Store transitions a worker uses.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from httpx_sse import connect_sse

from compiler.errors import Failure
from modelzoo import MLP, export, seeded
from procs import AUTH, ROOT, api, start_api, stop
from service.store import Store, keys
from service.store.leases import Lease

TARGET = f"cpu-zsse-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def sse_api(service_env: dict[str, str], store: Store,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    store.workers.heartbeat({"id": f"fake-{TARGET}", "target": TARGET, "toolchain": {"torch": "fake"},
                            "device_name": "none", "started": time.time()}, ttl_s=3600)
    log = tmp_path_factory.mktemp("sse") / "api.log"
    url, proc = start_api(service_env, log, log_level="info")  # the tests read its access log
    yield url, log
    stop(proc)
    store.workers.remove(f"fake-{TARGET}")


def _model(tmp_path: Path) -> Path:
    return export(seeded(MLP, int(uuid.uuid4().int % 10**6), d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),),
                  tmp_path / "m.pt2")


def _submit(url: str, tmp_path: Path) -> dict[str, Any]:
    model = api.post(f"{url}/v1/models", content=_model(tmp_path).read_bytes()).json()
    r = api.post(f"{url}/v1/compilations", json={"model_id": model["id"], "shapes": {"x": [2, 4]}, "target": TARGET})
    assert r.status_code == 202, r.text
    return dict(r.json()["job"])


def _take(store: Store, job_id: str) -> Lease:
    stream = keys.queue(TARGET, "interactive")
    for _ in range(50):
        res = store.r.xreadgroup(keys.QUEUE_GROUP, "fake-worker", {stream: ">"}, count=1)
        if res:
            msg_id, fields = res[0][1][0]
            assert fields["job"] == job_id
            lease = Lease(stream, msg_id, "fake-worker")
            assert store.jobs.start(job_id, lease) == ("running", 1)
            return lease
        time.sleep(0.05)
    raise AssertionError("no queue entry")


class SSE:
    """Collects a job's events from a background thread."""

    def __init__(self, url: str, job_id: str, last_id: str | None = None) -> None:
        self.frames: list[tuple[str, str | None, Any]] = []
        self.ended = threading.Event()
        headers = {"Last-Event-ID": last_id} if last_id else {}
        self.thread = threading.Thread(target=self._run, args=(f"{url}/v1/jobs/{job_id}/events", headers), daemon=True)
        self.thread.start()

    def _run(self, url: str, headers: dict[str, str]) -> None:
        with httpx.Client(timeout=30, headers=AUTH) as http, connect_sse(http, "GET", url, headers=headers) as events:
            assert events.response.headers["content-type"].startswith("text/event-stream")
            for sse in events.iter_sse():
                if sse.data:  # the `retry:` frame and keepalive comments carry no data
                    self.frames.append((sse.event, sse.id or None, json.loads(sse.data)))
        self.ended.set()

    def wait_for(self, n: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while len(self.frames) < n:
            assert time.monotonic() < deadline, self.frames
            time.sleep(0.02)


def test_events_stream_each_change_live_then_the_job_and_resume_after_last_event_id(sse_api, store, tmp_path):
    url, _ = sse_api
    job = _submit(url, tmp_path)
    sse = SSE(url, job["id"])
    sse.wait_for(1)
    lease = _take(store, job["id"])
    sse.wait_for(2)  # each change arrives as it happens, not at the end
    store.jobs.set_stage(job["id"], "fake-worker", "compile")
    sse.wait_for(3)
    store.jobs.retry_or_fail({**store.jobs.get(job["id"]), "worker": "fake-worker"}, lease,
                             Failure("CheckFailed", "max error 0.5 vs eager", "check"))
    assert sse.ended.wait(10)

    states = [(e, d.get("state"), d.get("stage")) for e, _, d in sse.frames]
    assert states == [("state", "queued", "queued"), ("state", "running", "fetch"), ("state", "running", "compile"),
                      ("state", "failed", "failed"), ("end", "failed", "failed")]
    assert sse.frames[1][2]["attempt"] == "1" and sse.frames[1][2]["worker"] == "fake-worker"
    assert sse.frames[3][2]["reason"] == "max error 0.5 vs eager"
    end = sse.frames[-1][2]
    assert end["id"] == job["id"] and end["error"]["type"] == "CheckFailed"

    # A reconnect with Last-Event-ID gets only what came after.
    again = SSE(url, job["id"], last_id=sse.frames[1][1])
    assert again.ended.wait(10)
    assert [(e, d.get("stage")) for e, _, d in again.frames] == [("state", "compile"), ("state", "failed"),
                                                                 ("end", "failed")]
    assert api.get(f"{url}/v1/jobs/{'0' * 32}/events").status_code == 404


def test_cli_compile_shows_live_progress_from_events_without_polling(sse_api, store, service_env, tmp_path):
    url, log = sse_api
    path = _model(tmp_path)
    cli = subprocess.Popen([sys.executable, "-m", "client.cli", "compile", str(path), "--shape", "x=2x4",
                            "--target", TARGET], env={**service_env, "AOTC_URL": url}, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    job_id = None
    while job_id is None:
        assert time.monotonic() < deadline and cli.poll() is None
        time.sleep(0.1)
        for j in store.jobs.recent(20):
            if j["target"] == TARGET and j["state"] == "queued":
                job_id = j["id"]
    lease = _take(store, job_id)
    for stage in ("load", "capture", "fusion", "codegen", "package", "check"):
        time.sleep(0.2)
        store.jobs.set_stage(job_id, "fake-worker", stage)
    store.jobs.finish(job_id, "cancelled", lease=lease,
                      error=Failure.cancelled("cancelled while running (check)", "check"))
    out, err = cli.communicate(timeout=30)
    assert cli.returncode == 1, err
    shown = [re.fullmatch(r"\[ *[0-9.]+s\] job (\w+) \[([#-]{20})\] (.*)", ln) for ln in err.splitlines()
             if ln.startswith("[")]
    assert all(m and m[1] == job_id[:8] for m in shown), err
    assert [m[3] for m in shown] == ["queued: queued", "running: fetch", "running: load", "running: capture",
                                     "running: fusion", "running: codegen", "running: package", "running: check",
                                     "cancelled: cancelled"]
    filled = [m[2].count("#") for m in shown]
    assert filled[0] == 0 and filled == sorted(filled) and filled[-1] > filled[1]  # a bar that only moves on
    assert f"aotc: job {job_id} cancelled at stage check: cancelled while running (check)" in err
    # The CLI followed the event stream: it never polled the job.
    access = log.read_text()
    assert f'"GET /v1/jobs/{job_id}/events HTTP/1.1" 200' in access
    assert f'"GET /v1/jobs/{job_id} HTTP/1.1"' not in access


def test_sigterm_drains_requests_and_ends_event_streams(service_env, store, tmp_path):
    store.workers.heartbeat({"id": f"fake-drain-{TARGET}", "target": TARGET, "toolchain": {"torch": "fake"},
                            "device_name": "none", "started": time.time()}, ttl_s=120)
    url, proc = start_api(service_env, tmp_path / "api.log", log_level="info")
    try:
        job = _submit(url, tmp_path)
        sse = SSE(url, job["id"])
        sse.wait_for(1)

        body = _model(tmp_path).read_bytes()
        answer: dict[str, Any] = {}

        def slow_upload() -> None:
            def chunks() -> Iterator[bytes]:
                step = len(body) // 8 + 1
                for i in range(0, len(body), step):
                    yield body[i:i + step]
                    time.sleep(0.25)

            answer["r"] = api.post(f"{url}/v1/models", content=chunks(), timeout=30)

        uploader = threading.Thread(target=slow_upload)
        uploader.start()
        time.sleep(0.6)  # the upload is under way
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert sse.ended.wait(5), "the event stream did not end on shutdown"
        assert sse.frames[-1][0] == "unavailable" and "shutting down" in sse.frames[-1][2]["message"]
        uploader.join(15)
        assert answer["r"].status_code == 201, answer["r"].text  # the request in flight was finished
        # uvicorn re-raises the SIGTERM once it has drained, so the exit status is the signal's; the log shows the
        # drain finished rather than being cut short.
        assert proc.wait(15) in (0, -signal.SIGTERM)
        log = (tmp_path / "api.log").read_text()
        assert "Finished server process" in log and "timeout graceful shutdown exceeded" not in log
        print(f"\nAPI exit after SIGTERM with an upload and an event stream open: {time.monotonic() - t0:.2f} s")
        with pytest.raises(httpx.TransportError):
            api.get(f"{url}/healthz", timeout=2)
    finally:  # a failed assertion must not leave the API running
        stop(proc)
        store.workers.remove(f"fake-drain-{TARGET}")
