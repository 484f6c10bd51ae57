"""One timing pass at a time per device on a host: the latency figures are what deploy-time lookup ranks artifacts
by, and two passes timing on one GPU (or on the same cores) at once slow each other down.

Workers that share AOTC_DATA_DIR (`aotc serve --workers N`, or containers mounting the same volume) take an
exclusive flock on AOTC_DATA_DIR/locks/check-<device>.lock around each timing child (compiler/timing.py). The
correctness check before it takes no lock: it runs beside compiles and other checks, so one check no longer sets
the farm's pace (issue 24: one job ended every 18 s, the length of a check, and jobs waited up to 91 s). The lock is
held by the trusted worker, never by the sandboxed child, and the kernel drops it when the worker dies. Compiles do
not take it: they mostly use the CPU, and the figure records the host's load beside it."""

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


@contextlib.contextmanager
def exclusive(path: Path | None, max_wait_s: float, should_stop: Callable[[], bool] = lambda: False,
              poll_s: float = 0.05) -> Iterator[dict[str, Any]]:
    """Hold `path`'s lock for the block; yields what the check records about it: whether it was held, how long the
    worker waited, and the host's load when the wait ended. Waits at most `max_wait_s` (a stuck sibling must not
    stop this worker: it then runs unlocked and says so), and stops waiting when `should_stop()`."""
    info: dict[str, Any] = {"exclusive": False, "waited_s": 0.0}
    if path is None:
        info["reason"] = "off (AOTC_CHECK_EXCLUSIVE=false)"
        yield _load(info)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    t0 = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                info["exclusive"] = True
                break
            except BlockingIOError:
                if time.monotonic() - t0 >= max_wait_s or should_stop():
                    info["reason"] = f"another check held the device for over {max_wait_s:.0f} s"
                    break
                time.sleep(poll_s)
        info["waited_s"] = round(time.monotonic() - t0, 3)
        yield _load(info)
    finally:
        os.close(fd)  # releases the lock


def _load(info: dict[str, Any]) -> dict[str, Any]:
    """The host's 1-minute load average and core count, beside the figure they may have moved."""
    with contextlib.suppress(OSError):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    info["cpus"] = os.cpu_count()
    return info
