"""Disk space: how much a filesystem has free, and telling an out-of-space failure apart from other failures.

A full disk is the machine's fault, never the request's or the job's. The API answers it with a 507 that names the
free space and AOTC_DISK_LOW_WATER_MB (service/api/disk.py); a worker hands the job back with its attempt refunded
and claims nothing until its disks have room again (worker/disk.py). Both recognise it here:

    OSError with errno ENOSPC or EDQUOT     a local disk or a quota (anywhere in the exception's cause chain)
    NoSpace                                 a blob store's own "out of space" answer (an S3 507, InsufficientStorage)

Torch-free and HTTP-free: the API, the worker and the blob stores import it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

MB = 2**20
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoSpace(OSError):
    """A blob store that refused a write for lack of room (an S3 endpoint's 507 or InsufficientStorage). An OSError
    with errno ENOSPC, so whatever handles a full local disk handles it too; `where` names the store."""

    def __init__(self, where: str, detail: str) -> None:
        super().__init__(errno.ENOSPC, f"{where} is out of space: {detail}")
        self.where = where
        self.detail = detail

    def __str__(self) -> str:
        return str(self.strerror)


def is_disk_full(exc: BaseException) -> bool:
    """An out-of-space failure anywhere in the cause chain (a write wrapped by a library still counts)."""
    seen: BaseException | None = exc
    hops = 0
    while seen is not None and hops < 32:  # a cycle in a hand-made chain must not hang us
        if isinstance(seen, OSError) and seen.errno in FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
        hops += 1
    return False


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: the filesystem a dir not yet made will be on."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


@dataclass(frozen=True)
class Space:
    """What statvfs says of the filesystem that holds `path`: bytes an unprivileged writer may still use."""

    path: Path
    free: int
    total: int
    device: int

    @classmethod
    def of(cls, path: Path) -> Space:
        at = existing(path)
        st = os.statvfs(at)
        return cls(path=Path(path), free=st.f_bavail * st.f_frsize, total=st.f_blocks * st.f_frsize,
                   device=os.stat(at).st_dev)

    def describe(self) -> str:
        return f"{self.path} has {mb(self.free)} free of {mb(self.total)}"


def mb(n: int) -> str:
    """Bytes as a person reads them in a message: MB with one decimal (bytes below 1 MB)."""
    return f"{n} bytes" if abs(n) < MB else f"{n / MB:.1f} MB"
