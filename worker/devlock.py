"""One timing pass at a time per device on a host: the latency figures are what deploy-time lookup ranks artifacts
by, and two passes timing on one GPU (or on the same cores) at once slow each other down.

Workers that share AOTC_DATA_DIR (`aotc serve --workers N`, or containers mounting the same volume) take an
exclusive flock on AOTC_DATA_DIR/locks/check-<device>.lock around each timing child (compiler/timing.py). The
correctness check before it takes no lock: it runs beside compiles and other checks, so one check no longer sets
the farm's pace (issue 24: one job ended every 18 s, the length of a check, and jobs waited up to 91 s). The lock is
held by the trusted worker, never by the sandboxed child, and the kernel drops it when the worker dies. Compiles do
not take it: on a GPU they mostly use the CPU, and the timing child keeps cores of its own (AOTC_TIMING_CPUS). On a
CPU device, where the device is the host (AOTC_TIMING_PAUSE): compiles stop while a pass holds the lock
(`timing_now`), and checks hold it shared (`shared`), waiting for a pass that holds it or waits for it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def lock_path(data_dir: Path, device: str) -> Path:
    return data_dir / "locks" / f"check-{re.sub(r'[^A-Za-z0-9]', '', device)}.lock"


def intent_path(lock: Path) -> Path:
    """Where a timing pass waiting for the device says so (`exclusive(..., announce=True)`): checks holding the
    device shared (`shared`) start no more meanwhile, so that a stream of overlapping checks cannot starve it."""
    return lock.with_suffix(".intent")


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _try(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _wait(take: Callable[[], bool], max_wait_s: float, should_stop: Callable[[], bool],
          poll_s: float) -> tuple[bool, float]:
    """Try `take()` every `poll_s` until it succeeds, `max_wait_s` has passed or `should_stop()`: whether it took,
    and the seconds waited."""
    t0 = time.monotonic()
    while not (took := take()):
        if time.monotonic() - t0 >= max_wait_s or should_stop():
            break
        time.sleep(poll_s)
    return took, round(time.monotonic() - t0, 3)


@contextlib.contextmanager
def exclusive(path: Path | None, max_wait_s: float, should_stop: Callable[[], bool] = lambda: False,
              poll_s: float = 0.05, announce: bool = False) -> Iterator[dict[str, Any]]:
    """Hold `path`'s lock for the block; yields what the check records about it: whether it was held, how long the
    worker waited, and the host's load when the wait ended. Waits at most `max_wait_s` (a stuck sibling must not
    stop this worker: it then runs unlocked and says so), and stops waiting when `should_stop()`. `announce`: say
    that this pass waits (intent_path) while it waits, for the checks that hold the device shared."""
    info: dict[str, Any] = {"exclusive": False, "waited_s": 0.0}
    if path is None:
        info["reason"] = "off (AOTC_CHECK_EXCLUSIVE=false)"
        yield _load(info)
        return
    fd = _open(path)
    intent = _open(intent_path(path)) if announce else None
    try:
        # The intent first (once taken it is kept while waiting), then the device.
        intended = [intent is None]

        def take() -> bool:
            if not intended[0]:
                assert intent is not None
                intended[0] = _try(intent, fcntl.LOCK_EX)
            return intended[0] and _try(fd, fcntl.LOCK_EX)

        info["exclusive"], info["waited_s"] = _wait(take, max_wait_s, should_stop, poll_s)
        if not info["exclusive"]:
            info["reason"] = f"another check held the device for over {max_wait_s:.0f} s"
        if intent is not None:
            os.close(intent)  # held: no check starts now; the next waiting pass may announce itself
            intent = None
        yield _load(info)
    finally:
        if intent is not None:
            os.close(intent)
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def shared(path: Path | None, max_wait_s: float, should_stop: Callable[[], bool] = lambda: False,
           poll_s: float = 0.05) -> Iterator[dict[str, Any]]:
    """Hold `path`'s lock shared for the block: a check on a device where compiles pause for the timing
    (AOTC_TIMING_PAUSE) runs beside other checks, never beside a timing pass, and none starts while a pass waits
    (intent_path). Yields whether it was held and the wait; past `max_wait_s` it runs anyway and says so."""
    info: dict[str, Any] = {"shared": False, "waited_s": 0.0}
    if path is None:
        yield info
        return
    fd = _open(path)
    try:
        info["shared"], info["waited_s"] = _wait(
            lambda: not timing_now(intent_path(path)) and _try(fd, fcntl.LOCK_SH), max_wait_s, should_stop, poll_s)
        if not info["shared"]:
            info["reason"] = f"timing passes held the device for over {max_wait_s:.0f} s"
        yield info
    finally:
        os.close(fd)


def timing_now(path: Path | None) -> bool:
    """Whether a timing pass holds `path`'s lock now (another worker's: one worker runs one job at a time). A shared
    lock taken and dropped at once tells, without waiting: a compile on a CPU device pauses while it is held
    (AOTC_TIMING_PAUSE), and resumes when the pass ends or its worker dies (the kernel drops the lock)."""
    if path is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no lock file yet: no pass has run on this device
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock, if taken
    return False


def _load(info: dict[str, Any]) -> dict[str, Any]:
    """The host's 1-minute load average and core count, beside the figure they may have moved."""
    with contextlib.suppress(OSError):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    info["cpus"] = os.cpu_count()
    return info
