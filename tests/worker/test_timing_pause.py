"""A compile on a CPU device stops while another worker's timing pass holds the device (AOTC_TIMING_PAUSE): on a CPU
device the device is the host, and a compile beside the timing pass put eager's figure off by up to 100x on the
2-core box. A real child in the real sandbox, another real process holding the device lock, the child's state read
from /proc; the wiring through a real worker is in test_devlock.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from worker.devlock import lock_path, timing_now
from worker.isolation import setup
from worker.sandbox import Outcome, run_child
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from pathlib import Path
from worker.devlock import exclusive
with exclusive(Path(sys.argv[1]), 5) as held:
    assert held["exclusive"]
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it (or dies)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def _release(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=30)


def _children_states() -> dict[int, str]:
    """The state (R, S, T, ...) of each process under this one that runs worker.child (bwrap's included)."""
    out: dict[int, str] = {}
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for task in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else ():
            try:
                kids = [int(k) for k in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                todo.append(k)
                try:
                    cmd = Path(f"/proc/{k}/cmdline").read_bytes()
                    stat = Path(f"/proc/{k}/stat").read_text()
                except OSError:
                    continue
                if b"worker.child" in cmd:
                    out[k] = stat.rsplit(")", 1)[1].split()[0]
    return out


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("needs root and bubblewrap for the sandbox the worker runs children in")
    d = tmp_path_factory.mktemp("pause")
    return setup(WorkerSettings(work_dir=d / "work", data_dir=d / "data"), "cpu")


def _run_in_thread(**kwargs) -> tuple[threading.Thread, list[Outcome]]:
    got: list[Outcome] = []
    t = threading.Thread(target=lambda: got.append(run_child(**kwargs)), daemon=True)
    t.start()
    return t, got


def test_timing_now_sees_another_process_holding_the_device_and_not_a_free_or_missing_lock(tmp_path: Path) -> None:
    path = lock_path(tmp_path, "cpu")
    assert timing_now(path) is False and timing_now(None) is False  # no lock file yet, no lock at all
    holder = _holder(path)
    try:
        assert timing_now(path) is True
        assert timing_now(lock_path(tmp_path, "cuda:0")) is False  # another device
    finally:
        _release(holder)
    assert timing_now(path) is False  # the pass ended: the kernel dropped its lock


def test_a_child_stops_while_the_device_is_held_its_time_limit_stands_still_and_it_finishes_after(
        sandbox, tmp_path: Path) -> None:
    lock = lock_path(tmp_path / "data", "cpu")
    t0 = time.monotonic()
    alone = run_child({"kind": "probe", "device": "cpu"}, tmp_path / "alone", sandbox=sandbox, timeout_s=120)
    took = time.monotonic() - t0
    assert alone.ok and alone.paused_s == 0.0, alone.failure
    # Held for longer than the child's whole time limit: were the limit's clock running while it is stopped, it would
    # be killed for it.
    limit = 2 * took + 5
    hold = limit + 3
    holder = _holder(lock)
    try:
        thread, got = _run_in_thread(task={"kind": "probe", "device": "cpu"}, jobdir=tmp_path / "held",
                                     sandbox=sandbox, timeout_s=limit, pause=partial(timing_now, lock))
        deadline = time.monotonic() + 30
        while not (states := _children_states()) or set(states.values()) != {"T"}:
            assert time.monotonic() < deadline, f"the child did not stop while the device was held: {states}"
            time.sleep(0.1)
        time.sleep(hold)
        assert set(_children_states().values()) == {"T"}  # still stopped, every process of it
    finally:
        _release(holder)
    thread.join(timeout=120)
    out = got[0]
    assert out.ok, out.failure  # not killed for its time limit
    assert hold <= out.paused_s < hold + 10
    assert out.seconds < limit  # the time it ran, the pause left out


def test_a_child_is_stopped_no_longer_than_the_cap_when_the_holder_never_lets_go(sandbox, tmp_path: Path) -> None:
    lock = lock_path(tmp_path / "data", "cpu")
    holder = _holder(lock)  # a timing pass that hangs holding the device
    try:
        out = run_child({"kind": "probe", "device": "cpu"}, tmp_path / "capped", sandbox=sandbox, timeout_s=120,
                        pause=partial(timing_now, lock), pause_max_s=1.5)
        assert timing_now(lock)  # held all along
    finally:
        _release(holder)
    assert out.ok, out.failure
    assert 1.5 <= out.paused_s < 2.5


SHARE = """
import sys
from pathlib import Path
from worker.devlock import shared
with shared(Path(sys.argv[1]), 30) as held:
    assert held["shared"]
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_timing_pass_waits_for_the_checks_that_hold_the_device_and_no_check_starts_while_it_waits(
        tmp_path: Path) -> None:
    from worker.devlock import exclusive, shared

    path = lock_path(tmp_path, "cpu")
    check = subprocess.Popen([sys.executable, "-c", SHARE, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT)  # another worker's check, running
    assert check.stdout is not None and check.stdout.readline().strip() == "held"
    with shared(path, 5) as beside:  # checks run beside each other
        assert beside["shared"] and beside["waited_s"] < 1
    got: dict[str, dict] = {}

    def timing() -> None:
        with exclusive(path, 60, announce=True) as held:
            got["timing"] = held

    pass_ = threading.Thread(target=timing)
    pass_.start()
    time.sleep(0.5)
    assert "timing" not in got  # it waits for the running check
    # ... and announced itself: a check that comes now does not start beside the pass, even though the device is
    # only held shared now.
    t0 = time.monotonic()
    with shared(path, 1.0) as late:
        assert late["shared"] is False and "over 1 s" in late["reason"] and time.monotonic() - t0 >= 1.0
    _release(check)
    pass_.join(timeout=30)
    assert got["timing"]["exclusive"] is True and got["timing"]["waited_s"] >= 1.2  # the check and the late one
    with shared(path, 5) as after:  # the pass ended: checks start again
        assert after["shared"] is True


def test_a_time_limit_that_waits_starts_when_the_wait_ends_and_does_not_stop_again() -> None:
    """An early check (worker/earlycheck.py) waits for its package beside the compile: its time limit
    (AOTC_CHECK_TIMEOUT_S) counts from the package on, not from the child's start."""
    from worker.sandbox import _Clock, _Stopped

    went = threading.Event()
    clock = _Clock(100.0, _Stopped(None, None, 0.0), lambda: not went.is_set())  # type: ignore[arg-type]
    assert clock.ran(100.0) == 0.0 and clock.ran(400.0) == 0.0  # 300 s of waiting: none of it counts
    went.set()
    assert clock.ran(401.0) == 1.0 and clock.ran(460.0) == 60.0  # from the last poll that saw it waiting
    went.clear()  # a wait that ended does not come back
    assert clock.ran(470.0) == 70.0
    plain = _Clock(100.0, _Stopped(None, None, 0.0), None)  # type: ignore[arg-type]
    assert plain.ran(130.0) == 30.0
