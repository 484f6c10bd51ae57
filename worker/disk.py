"""A worker's disks: whether they have room (AOTC_DISK_LOW_WATER_MB), and whether a child's failure was a full disk.

A worker writes to its work dir (the model, each child's dir with its Inductor and Triton caches, compiler temp
files, the package, the report) and publishes to the blob store, which for `file://` is a local dir too. ENOSPC on
any of them is the machine's fault, never the job's. The trusted worker meets it as an OSError
(service.store.disk.is_disk_full); a compile or check child in its sandbox meets it in its own process, where
it shows up only in what the child reports or prints (errno 28 in a traceback, "No space left on device" from g++
or ld), or not at all (a short write that breaks a file read later, a child that could not even write its
result or log). So a failed child counts as a full disk when its output says so, or when the worker measures its
disks right after the child died and finds one below the low-water mark.

What a child prints is its word only: a child that claims a full disk gets its job handed back, but the worker
measures its disks itself before it stops claiming, and a job is refunded for a full disk at most its
max_attempts times (worker.job), so a lie costs nobody more than a retry.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from service.store.disk import MB, Space

log = logging.getLogger("aotc.worker")

SETTING = "AOTC_DISK_LOW_WATER_MB"
# errno 28 (ENOSPC) and 122 (EDQUOT) as Python, libc (g++, ld, make) and the kernel's names print them.
SAYS_FULL = re.compile(r"No space left on device|Disk quota exceeded|\[Errno (?:28|122)\]|\bENOSPC\b|\bEDQUOT\b")


def says_full(text: str) -> str | None:
    """The line of `text` that reports a full disk, cut short; None when no line does."""
    m = SAYS_FULL.search(text)
    if m is None:
        return None
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start:end if end >= 0 else len(text)].strip()
    return line[:200]


class DiskWatch:
    """The filesystems a worker writes to, measured with statvfs against the low-water mark. `paths` is called
    each time (a file blob store's dir becomes known once the API has announced it)."""

    def __init__(self, paths: Callable[[], list[Path]], low_water_mb: int) -> None:
        self.paths = paths
        self.low_water_mb = low_water_mb
        self.low_water = low_water_mb * MB

    def short(self) -> Space | None:
        """The first filesystem with less free than the low-water mark, else None. Any free space counts as room
        when the mark is 0, except none at all."""
        for path in self.paths():
            try:
                space = Space.of(path)
            except OSError as e:
                log.warning("cannot measure the free space of %s: %s", path, e)
                continue
            if space.free < max(self.low_water, 1):
                return space
        return None

    def reserve(self) -> str:
        return f"{SETTING}={self.low_water_mb}"
