"""Starting and stopping the real processes the tests use."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from service.store import Store
from service.store.embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
MAX_UPLOAD_MB = 8  # the API under test refuses larger uploads; every test model is far smaller
# The free disk the test services keep (AOTC_DISK_LOW_WATER_MB): far below the default of 512 MB, so that a CI machine
# with little free disk still runs the suite; the disk-full tests set their own.
DISK_LOW_WATER_MB = 32
# Test workers share one set of trusted precompiled headers (worker/headers.py), built by the first worker that
# needs it and kept across runs (a new toolchain builds a new set): without it each test worker's warm-up compile
# would build its own, about a minute on 2 cores. Workers still run their compiles sandboxed (AOTC_SANDBOX=on).
HEADERS_DIR = ROOT / ".aotc" / "test-headers"
# Every test service runs with auth on: its API gets this bootstrap admin key (AOTC_ADMIN_KEY), and the tests,
# the SDK and the CLI they run send it (AOTC_API_KEY, set by conftest.py). Tests of scopes and namespaces create
# their own keys with it; the open mode has its own test.
ADMIN_KEY = "aotc-test-admin-key-3f9c2a7d51e04b68"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
# httpx's module-level calls, with the admin key: `api.get(url)` where a test would write `httpx.get(url)`.
api = httpx.Client(headers=AUTH, timeout=5.0)


def _worker_env(env: dict[str, str], **extra: str) -> dict[str, str]:
    return {"AOTC_HEADERS_DIR": str(HEADERS_DIR), **env, **extra}


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            if api.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_api(env: dict[str, str], log_path: Path, *,
              log_level: str = "warning") -> tuple[str, subprocess.Popen[bytes]]:
    """The API served by uvicorn on a free port, in its own process; returns its URL once it answers.
    `log_level="info"` logs each request and the shutdown, for tests that read the log."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", log_level],
        env=env, cwd=ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc)
    return url, proc


def start_worker(env: dict[str, str], log_path: Path, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "worker"], env=_worker_env(env, **extra), cwd=ROOT,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def wait_workers(store: Store, n: int = 1, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = store.workers.live()
        if len(live) >= n:
            return live
        time.sleep(0.2)
    raise RuntimeError(f"{n} worker(s) did not register in {timeout} s")




def wait_job(api_url: str, job_id: str, timeout: float = 600, poll_s: float = 0.3) -> dict:
    """Poll a job until it ends; the tests that need the event stream use it directly."""
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = api.get(f"{api_url}/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(poll_s)
    raise AssertionError(f"job {job_id} did not finish: {job}")


class Cluster:
    """A whole service of its own: a redis-server, the API over HTTP, and CPU workers the test starts and stops
    (tests that need workers apart from the session's, or that kill them)."""

    def __init__(self, base: Path, *, env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None,
                 worker_path: list[str] | None = None) -> None:
        self.base = base
        self.redis = EmbeddedRedis(base / "redis").start()
        self.store = Store(self.redis.url)
        common = {**os.environ, "AOTC_REDIS_URL": self.redis.url, "AOTC_DATA_DIR": str(base),
                  "AOTC_ADMIN_KEY": ADMIN_KEY, **(env or {})}
        self.api_env = {**common, "PYTHONPATH": str(ROOT)}  # the API never imports torch
        self.worker_env = {
            **common, "PYTHONPATH": os.pathsep.join([str(ROOT), *(worker_path or [])]), "AOTC_DEVICE": "cpu",
            "AOTC_WORK_DIR": str(base / "work"), **(worker_env or {}),
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self.url, self.api = self.start_api()

    def start_api(self) -> tuple[str, subprocess.Popen[bytes]]:
        url, proc = start_api(self.api_env, self.base / f"api-{len(self.procs)}.log")
        self.procs.append(proc)
        return url, proc

    def start_worker(self, **env: str) -> tuple[subprocess.Popen[bytes], str]:
        """Start a worker; returns the process and its worker id once it has registered."""
        n = len(self.procs)
        proc = subprocess.Popen([sys.executable, "-m", "worker"], env=_worker_env(self.worker_env, **env), cwd=ROOT,
                                stdout=open(self.base / f"worker-{n}.log", "wb"), stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"worker exited with {proc.returncode}"
            mine = [w for w in self.store.workers.live() if w["pid"] == proc.pid]
            if mine:
                return proc, mine[0]["id"]
            time.sleep(0.1)
        raise AssertionError("worker did not register")

    def upload(self, path: Path) -> str:
        r = api.post(f"{self.url}/v1/models", content=path.read_bytes(), timeout=60)
        assert r.status_code in (200, 201), r.text
        return str(r.json()["id"])

    def submit(self, model_id: str, shapes: dict[str, list[int]], url: str | None = None,
               **extra: Any) -> dict[str, Any]:
        r = api.post(f"{url or self.url}/v1/compilations", json={"model_id": model_id, "shapes": shapes, **extra},
                       timeout=30)
        assert r.status_code == 202, r.text
        return dict(r.json()["job"])

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.store.jobs.get(job_id)
        assert job is not None
        return job

    def wait_for(self, job_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if pred(job):
                return job
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} never got there: {self.job(job_id)}")

    def wait_end(self, job_id: str, timeout: float = 240) -> dict[str, Any]:
        return self.wait_for(job_id, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), timeout)

    def close(self) -> None:
        for p in self.procs:
            stop(p)
        self.store.close()
        self.redis.stop()
