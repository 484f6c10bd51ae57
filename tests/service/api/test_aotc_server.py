"""`aotc-server` as a whole: its children die with it (kill -9 included), one server per data dir, and a restart
after a kill cleans what the killed one left and loses no job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from procs import ROOT, AotcServer, alive, api, children_of, cmdline, descendants, stop
from service.store import Store, keys
from service.store.embedded import free_port


@pytest.fixture
def servers() -> Iterator[list[AotcServer]]:
    started: list[AotcServer] = []
    yield started
    for s in started:
        stop(s.proc)


def _all_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_kill_9_of_aotc_server_leaves_no_process_behind(tmp_path, servers):
    server = AotcServer(tmp_path / "data", "--workers", "1", "--device", "cpu", "--api-workers", "2")
    servers.append(server)
    server.wait_ready(targets=1)
    kids = descendants(server.proc.pid)
    lines = {p: cmdline(p) for p in kids}
    assert any("redis-server" in c for c in lines.values()), lines
    assert any("-m worker" in c for c in lines.values()), lines
    assert sum("multiprocessing" in c for c in lines.values()) >= 2, lines  # the API processes (and a tracker)

    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    left = _all_gone(kids)
    assert not left, {p: cmdline(p) for p in left}


def test_a_worker_that_dies_is_started_again(tmp_path, servers):
    server = AotcServer(tmp_path / "data", "--workers", "1", "--device", "cpu", "--api-workers", "1")
    servers.append(server)
    server.wait_ready(targets=1)

    def workers() -> list[int]:
        return [p for p in children_of().get(server.proc.pid, []) if cmdline(p).endswith("-m worker ") and alive(p)]

    first = workers()
    assert len(first) == 1
    os.kill(first[0], signal.SIGKILL)  # as the OOM killer would
    deadline = time.monotonic() + 60
    # SIGKILL lands when the kernel has torn the process down, which a loaded box takes a while to do for a process
    # with torch mapped: until then workers() still lists the killed pid.
    while alive(first[0]):
        assert time.monotonic() < deadline, f"worker pid {first[0]} outlived SIGKILL"
        time.sleep(0.05)
    while not (again := workers()):
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.2)
    assert again[0] != first[0]
    assert "exited with -9; starting another" in server.output()


def test_a_second_server_on_the_same_data_dir_is_refused(tmp_path, servers):
    first = AotcServer(tmp_path / "data", "--workers", "0", "--api-workers", "1")
    servers.append(first)
    first.wait_ready()
    second = AotcServer(tmp_path / "data", "--workers", "0", "--api-workers", "1")
    servers.append(second)
    assert second.proc.wait(30) == 1
    assert "another aotc-server" in second.output() and "AOTC_DATA_DIR" in second.output()
    assert api.get(f"{first.url}/readyz").status_code == 200  # the first one is untouched


def test_cuda_all_without_a_gpu_says_so(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "AOTC_DATA_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "service", "--device", "cuda:all", "--port", str(free_port())],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "cuda:all found no GPU" in p.stderr


@pytest.mark.slow
def test_a_restart_after_kill_9_cleans_up_and_runs_the_queued_job(tmp_path, servers):
    import torch

    from compiler.device import detect
    from modelzoo import MLP, export, seeded

    data = tmp_path / "data"
    # One API process, inside aotc-server, so that the kill cuts the upload below off mid-way (API processes of
    # their own would get SIGTERM and remove their temp files themselves).
    first = AotcServer(data, "--workers", "0", "--api-workers", "1")
    servers.append(first)
    first.wait_ready()
    store = Store(first.redis_url)
    try:
        # A worker record like the one the restarted server's worker will have, so the job is keyed for it and
        # waits in its queue: this server runs no worker.
        info = detect("cpu")
        store.workers.heartbeat({"id": "placeholder", "pid": 0, "started": time.time(), "jobs_done": 0, "job": None,
                                 **info}, 60.0)
        path = export(seeded(MLP, 11, d_in=16), (torch.randn(4, 16),), tmp_path / "mlp.pt2")
        up = api.post(f"{first.url}/v1/models", content=path.read_bytes(), timeout=60)
        assert up.status_code == 201, up.text
        queued = api.post(f"{first.url}/v1/compilations",
                            json={"model_id": up.json()["id"][:12], "shapes": {"x": [4, 16]}, "target": "cpu"})
        assert queued.status_code == 202, queued.text
        job_id = queued.json()["job"]["id"]
        store.workers.remove("placeholder")

        # Debris: an upload cut off by the kill, a blob write cut short, a work dir of a job that is not running.
        def slow_upload() -> None:
            def body() -> Iterator[bytes]:
                for _ in range(200):
                    yield b"x" * 65536
                    time.sleep(0.05)
            try:
                api.post(f"{first.url}/v1/models", content=body(), timeout=60)
            except httpx.HTTPError:
                pass

        threading.Thread(target=slow_upload, daemon=True).start()
        uploads = data / "uploads"
        deadline = time.monotonic() + 20
        while not (uploads.is_dir() and any(p.stat().st_size > 0 for p in uploads.iterdir())):
            assert time.monotonic() < deadline, "the slow upload never reached the disk"
            time.sleep(0.1)
        store.raw.set(keys.blob_chunk("model", "ab" * 32, 0), b"half a blob")  # old layout, no manifest
        store.raw.set(f"{keys.blob('artifact', 'cd' * 16)}:g1:0", b"an unfinished write", px=3_600_000)
        stale = data / "work" / f"{'e' * 32}-1"
        stale.mkdir(parents=True)
        (stale / "model.pt2").write_bytes(b"x" * 1000)
        warmup = data / "work" / "warmup-999999999"  # a pid no process has
        warmup.mkdir()
        (data / "work" / "tmp").mkdir(parents=True, exist_ok=True)
    finally:
        store.close()

    kids = descendants(first.proc.pid)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    assert not _all_gone(kids)
    assert any(uploads.iterdir())

    second = AotcServer(data, "--workers", "1", "--device", "cpu", "--api-workers", "2", redis_port=first.redis_port)
    servers.append(second)
    second.wait_ready(targets=1)
    assert not any(uploads.iterdir()), list(uploads.iterdir())
    assert not stale.exists() and not warmup.exists() and (data / "work" / "tmp").is_dir()
    store = Store(second.redis_url)
    try:
        assert not store.raw.exists(keys.blob_chunk("model", "ab" * 32, 0))
        assert not store.raw.exists(f"{keys.blob('artifact', 'cd' * 16)}:g1:0")
        deadline = time.monotonic() + 300
        while (job := store.jobs.get(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
        assert job["state"] == "succeeded", job.get("error")
    finally:
        store.close()
    metrics = api.get(f"{second.url}/metrics").text
    assert f'aotc_compile_seconds_count{{target="{info["target"]}"}} 1.0' in metrics
    assert 'aotc_jobs{state="succeeded"} 1.0' in metrics

    kids = descendants(second.proc.pid)
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(60) == 0
    assert not _all_gone(kids)
