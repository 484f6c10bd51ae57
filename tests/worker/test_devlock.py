"""One timing pass at a time per device: the lock the worker holds around each timing child (worker/devlock.py),
against another real process holding it, and in a real compile's artifact record: on a CPU device a compile pauses
while another holds it and the check waits, holding the device shared (AOTC_TIMING_PAUSE)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.devlock import exclusive, lock_path

HOLD = """
import sys, time
from pathlib import Path
from worker.devlock import exclusive
with exclusive(Path(sys.argv[1]), 5) as held:
    assert held["exclusive"]
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(path: Path, seconds: float) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_lock_file_per_device_under_the_data_dir(tmp_path: Path) -> None:
    assert lock_path(tmp_path, "cuda:0") == tmp_path / "locks" / "check-cuda0.lock"
    assert lock_path(tmp_path, "cuda:1") != lock_path(tmp_path, "cuda:0")
    assert lock_path(tmp_path, "../../x").parent == tmp_path / "locks"


def test_a_second_check_waits_for_the_first(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "cuda:0")
    holder = _holder(path, 1.5)
    t0 = time.monotonic()
    with exclusive(path, 30) as held:
        waited = time.monotonic() - t0
    holder.wait()
    assert held["exclusive"] is True and 1.0 < held["waited_s"] <= waited + 0.01  # the holder kept it 1.5 s
    assert held["cpus"] >= 1 and "load_avg_1m" in held


def test_another_device_does_not_wait(tmp_path: Path) -> None:
    holder = _holder(lock_path(tmp_path, "cuda:0"), 3)
    try:
        with exclusive(lock_path(tmp_path, "cuda:1"), 30) as held:
            assert held["exclusive"] is True and held["waited_s"] < 0.5
    finally:
        holder.kill()


def test_a_stuck_holder_costs_at_most_the_wait_then_the_check_runs_unlocked(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "cpu")
    holder = _holder(path, 30)
    try:
        t0 = time.monotonic()
        with exclusive(path, 0.5) as held:
            assert time.monotonic() - t0 < 3
        assert held["exclusive"] is False and "over 0 s" in held["reason"]
        stop = time.monotonic() + 0.3
        with exclusive(path, 30, should_stop=lambda: time.monotonic() > stop) as held:
            assert held["exclusive"] is False and held["waited_s"] < 2
    finally:
        holder.kill()
        holder.wait()
    with exclusive(path, 1) as held:  # the kernel dropped the dead holder's lock
        assert held["exclusive"] is True


def test_off_says_so(tmp_path: Path) -> None:
    with exclusive(None, 1) as held:
        assert held["exclusive"] is False and "AOTC_CHECK_EXCLUSIVE" in held["reason"]


@pytest.mark.slow
def test_on_a_cpu_device_a_timing_pass_holding_it_pauses_the_compile_and_holds_off_the_check(
        api_url, worker, client, service_env, tmp_path) -> None:
    import torch

    from modelzoo import MLP, export, seeded

    path = export(seeded(MLP, 24), (torch.randn(5, 32),), tmp_path / "mlp.pt2")
    holder = _holder(lock_path(Path(service_env["AOTC_DATA_DIR"]), "cpu"), 600)  # another worker's timing, say
    try:
        answer = client.submit(client.upload(path)["id"], {"x": [5, 32]}, "cpu")
        job_id = answer["job"]["id"]
        deadline = time.monotonic() + 240
        # The compile stops for the 5 s the session allows (AOTC_TIMING_PAUSE_MAX_S), then goes on; its check then
        # waits for the device: on a CPU device no check runs beside a timing pass (AOTC_TIMING_PAUSE).
        while (job := client.job(job_id))["stage"] != "check":
            assert job["state"] in ("queued", "running"), job
            assert time.monotonic() < deadline, f"the compile did not go on past its pause: {job}"
            time.sleep(0.2)
        time.sleep(1.5)
        assert client.job(job_id)["stage"] == "check"  # compiled, and its check waits for the device
    finally:
        holder.kill()
        holder.wait()
    art = client.wait(job_id, timeout=300)
    check, timings = art.meta["check"], art.meta["timings"]
    assert check["host"]["exclusive"] is False and check["host"]["waited_s"] >= 1.5
    assert "holds the device shared" in check["host"]["reason"]
    timing = check["timing"]
    assert timing["pass"] == "separate" and timing["exclusive"] is True
    assert timing["cpus"] >= 1 and "load_avg_1m" in timing and timing["seconds"] == timings["timing"] > 0
    assert timings["check_wait"] == timing["waited_s"]
    assert 5 <= timings["compile_paused"] < 8
    assert timing["compiles"] == "paused, and checks held off (AOTC_TIMING_PAUSE)"
    # Each child's cores as it reported them (worker/cpus.py): on a CPU device AOTC_TIMING_CPUS=auto splits none.
    cores = timing["cores"]
    assert cores["timing"] == cores["compile"] == cores["check"] == sorted(os.sched_getaffinity(0))
    assert "CPU device" in cores["why"]
    # The figures are the timing pass's, everywhere the record shows them.
    point = check["points"][0]
    assert check["compiled_ms"] == point["compiled_ms"] == round(point["latency"]["compiled"]["median_ms"], 4)
    assert check["latency"]["compiled"] == point["latency"]["compiled"]
    assert point["latency"]["compiled"]["method"] == "wall-clock"  # timed by the pass; the check ran untimed
    assert art.meta["speed"]["vs_eager"] == round(check["eager_ms"] / check["compiled_ms"], 3)
