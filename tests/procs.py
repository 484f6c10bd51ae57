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

from compiler import cachekey
from service.store import Store
from service.store.embedded import EmbeddedRedis, free_port
from service.store.redis_url import with_password_file

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


def new_key(url: str, scope: str, ns: str, name: str) -> str:
    """A new API key of `scope` in namespace `ns`, made with the admin key."""
    r = api.post(f"{url}/v1/keys", json={"scope": scope, "namespace": ns, "name": name})
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def publish(store: Store, tmp: Path, model_id: str, spec: list[dict[str, Any]], target: str, *, torch: str,
            options: dict[str, Any] | None = None, **record: Any) -> str:
    """An artifact of `model_id` stored as a worker stores one (its package a few bytes: nothing runs it), with
    `record`'s fields besides; its key."""
    options = options if options is not None else {}
    factors = cachekey.factors(model_id, spec, target, {"torch": torch}, options)
    key = cachekey.cache_key(factors)
    package = tmp / f"{key}.pt2"
    package.write_bytes(b"package " + key.encode())
    store.artifacts.put({"key": key, "factors": factors, "model_id": model_id, "target": target, "spec": spec,
                         "options": options, **record}, package)
    return key


def _worker_env(env: dict[str, str], **extra: str) -> dict[str, str]:
    # Test workers wait for the shared set before their first job (on a fresh checkout the first one builds it), so
    # every test compile includes it as before; tests/worker/test_headers.py tests the background build.
    return {"AOTC_HEADERS_DIR": str(HEADERS_DIR), "AOTC_HEADERS_WARMUP": "before", **env, **extra}


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


def start_api(env: dict[str, str], log_path: Path, *, log_level: str = "warning",
              http: str | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """The API served by uvicorn on a free port, in its own process; returns its URL once it answers.
    `log_level="info"` logs each request and the shutdown, for tests that read the log. `http`: uvicorn's HTTP
    protocol, e.g. aotc-server's (service.api.http.protocol)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", log_level, *(["--http", http] if http else [])],
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
                 worker_path: list[str] | None = None, api_http: str | None = None) -> None:
        self.base = base
        self.api_http = api_http
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
        url, proc = start_api(self.api_env, self.base / f"api-{len(self.procs)}.log", http=self.api_http)
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

    def workers(self) -> dict[str, dict[str, Any]]:
        """GET /v1/workers: id -> record."""
        r = api.get(f"{self.url}/v1/workers", timeout=10)
        assert r.status_code == 200, r.text
        return {w["id"]: w for w in r.json()["workers"]}

    def wait_worker(self, wid: str, healthy: bool, timeout: float = 120) -> dict[str, Any]:
        """The worker's record once it says it is (un)healthy."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            w = self.workers().get(wid)
            if w is not None and w["healthy"] is healthy:
                return w
            time.sleep(0.2)
        raise AssertionError(f"worker {wid} never became {'healthy' if healthy else 'unhealthy'}: {self.workers()}")

    def close(self) -> None:
        for p in self.procs:
            stop(p)
        self.store.close()
        self.redis.stop()


# -- aotc-server as an operator runs it -------------------------------------------------------------------------


def children_of() -> dict[int, list[int]]:
    """Every live process's children, from /proc: pid -> child pids."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = children_of(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class AotcServer:
    """`python -m service` (what the aotc-server script runs) on free ports with its own data dir, its output
    (workers' too) in a log file beside the data dir. `env` adds to or overrides this process's environment."""

    def __init__(self, data_dir: Path, *args: str, redis_port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.redis_port = redis_port or free_port()
        full = {"AOTC_HEADERS_DIR": str(HEADERS_DIR),  # the test workers' shared precompiled headers
                **{k: v for k, v in os.environ.items() if k != "AOTC_REDIS_URL"},
                "AOTC_DATA_DIR": str(data_dir), "PYTHONPATH": str(ROOT), "AOTC_MAX_UPLOAD_MB": "64",
                "AOTC_ADMIN_KEY": ADMIN_KEY, **(env or {})}
        self.log = data_dir.parent / f"{data_dir.name}-server-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(self.port), "--redis-port", str(self.redis_port),
             "--log-level", "warning", *args], env=full, cwd=ROOT, stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        """Its embedded Redis, with the password that aotc-server keeps in the data dir."""
        return with_password_file(f"redis://127.0.0.1:{self.redis_port}/0", self.data_dir / "redis" / "password")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, targets: int = 0, timeout: float = 180.0) -> dict[str, Any]:
        """/readyz's answer once it is 200 with at least `targets` targets served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"aotc-server exited with {self.proc.returncode}: {self.output()[-4000:]}"
            try:
                r = api.get(f"{self.url}/readyz", timeout=2)
                if r.status_code == 200 and len(r.json()["targets"]) >= targets:
                    return dict(r.json())
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"aotc-server was not ready in {timeout} s: {self.output()[-4000:]}")

    def children(self) -> dict[int, str]:
        """Its live child processes: pid -> command line."""
        return {p: cmdline(p) for p in children_of().get(self.proc.pid, []) if alive(p)}

    def redis_pid(self) -> int:
        pids = [p for p, cmd in self.children().items() if "redis-server" in cmd]
        assert len(pids) == 1, self.children()
        return pids[0]
