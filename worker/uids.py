"""A uid of its own for each concurrent child, where no cgroup bounds a sandbox's processes: RLIMIT_NPROC counts
the processes of a uid across the host, so with one uid for every child a sandbox holding many processes leaves the
next one few. With a uid per child the count is per sandbox.

The uids come from a pool (AOTC_SANDBOX_UID_POOL_START, AOTC_SANDBOX_UID_POOL_SIZE) shared by the workers of a
host through lock files in AOTC_SANDBOX_UID_LOCK_DIR: a child holds an exclusive flock on its uid's file while it
runs, and the lock goes with the worker if it dies. Only root can run children as other uids.
"""

from __future__ import annotations

import fcntl
import os
import random
import time
from pathlib import Path


class UidPool:
    def __init__(self, start: int, size: int, lock_dir: Path) -> None:
        self.start = start
        self.size = size
        self.lock_dir = lock_dir

    def setup(self) -> None:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def acquire(self, wait_s: float = 600.0) -> tuple[int, int]:
        """(uid, lock fd): a uid no other child on this host holds; release() the fd when the child is done."""
        deadline = time.monotonic() + wait_s
        while True:
            offsets = list(range(self.size))
            random.shuffle(offsets)  # workers starting together do not all try the same uid first
            for off in offsets:
                uid = self.start + off
                fd = os.open(self.lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                return uid, fd
            if time.monotonic() > deadline:
                raise TimeoutError(f"all {self.size} uids of AOTC_SANDBOX_UID_POOL_SIZE are held by running children")
            time.sleep(0.2)

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)

    def describe(self) -> str:
        return (f"RLIMIT_NPROC of a uid of its own per sandbox ({self.start}..{self.start + self.size - 1}, "
                f"locks in {self.lock_dir})")
