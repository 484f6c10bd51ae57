"""Starting and stopping the real processes the tests use."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from service.store import Store

ROOT = Path(__file__).resolve().parent.parent
MAX_UPLOAD_MB = 8  # the API under test refuses larger uploads; every test model is far smaller


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
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


def start_worker(env: dict[str, str], log_path: Path, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "worker"], env={**env, **extra}, cwd=ROOT,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def wait_workers(store: Store, n: int = 1, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = store.live_workers()
        if len(live) >= n:
            return live
        time.sleep(0.2)
    raise RuntimeError(f"{n} worker(s) did not register in {timeout} s")




def wait_job(api_url: str, job_id: str, timeout: float = 600, poll_s: float = 0.3) -> dict:
    """Poll a job until it ends; the tests that need the event stream use it directly."""
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = httpx.get(f"{api_url}/v1/jobs/{job_id}").json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(poll_s)
    raise AssertionError(f"job {job_id} did not finish: {job}")
