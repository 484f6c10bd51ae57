"""A child's writable dir as a tmpfs of a fixed size, so that everything the child writes, all files together, is
bounded (AOTC_CHILD_MAX_DISK_MB), not each file alone (RLIMIT_FSIZE).

The worker mounts it on the host at JOBDIR/KIND before it seeds the dir, and bwrap binds it into the sandbox like
any dir: the worker relays the child's stages from it while it runs and reads its result after, as before. Once the
child is dead the worker copies out only what it will use (the package, the report, the timings, the headers:
plain files, never following a link, each within the tmpfs's size), then unmounts it, which frees its memory. Each
mount's source is named after the worker's pid, so a worker that starts removes the mounts of workers gone
(`sweep`). Mounting needs CAP_SYS_ADMIN in the worker's mount namespace: root in privileged mode; elsewhere the
worker says at start that only RLIMIT_FSIZE holds.

A tmpfs lives in memory: its pages are charged to the memory cgroup of whoever wrote them, the sandbox's, so the
memory bound covers both.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

log = logging.getLogger("aotc.worker")

MS_NOSUID, MS_NODEV = 2, 4  # not MS_NOEXEC: the compile dlopens the .so files it builds there
MNT_DETACH = 2
SOURCE = "aotc-child-"  # + the worker's pid: whose mount it is
FULL_BELOW_BYTES = 1 << 20  # a tmpfs with less room than this left counts as full

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str, path: Path) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what} {path}: {os.strerror(e)}")


def mount(path: Path, size_bytes: int, uid: int, gid: int) -> None:
    """A fresh tmpfs of `size_bytes` at `path`, owned by uid:gid, mode 0755."""
    opts = f"size={size_bytes},mode=0755,uid={uid},gid={gid}"
    _check(_libc.mount(f"{SOURCE}{os.getpid()}".encode(), str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                       opts.encode()), "mount tmpfs on", path)


def unmount(path: Path) -> None:
    """Detach the tmpfs at `path` (lazily: the kernel frees it once nothing holds a file in it)."""
    _check(_libc.umount2(str(path).encode(), MNT_DETACH), "unmount", path)


def is_mount(path: Path) -> bool:
    real = os.path.realpath(path)
    return any(mount_point == real for mount_point, _ in _mounts())


def _mounts() -> list[tuple[str, str]]:
    """(mount point, source) of every mount this process sees."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 2:
                    out.append((fields[4].encode().decode("unicode_escape"), rfields[1]))
    except OSError:
        pass
    return out


def can_mount(probe_dir: Path) -> str | None:
    """None if this process can mount a tmpfs (tried in `probe_dir`), else why not. The probe's mount point is this
    process's own: workers started together share a work dir, and one's unmount under another's mount made that
    one's rmdir fail with EBUSY (seen on an H200: a service's start failed)."""
    target = probe_dir / f"tmpfs-probe-{os.getpid()}"
    target.mkdir(parents=True, exist_ok=True)
    try:
        mount(target, 1 << 20, os.getuid(), os.getgid())
    except OSError as e:
        return str(e)
    finally:
        if is_mount(target):
            unmount(target)
        target.rmdir()
    return None


def sweep() -> None:
    """Detach the child tmpfs mounts of workers that are gone."""
    for point, source in _mounts():
        if source.startswith(SOURCE) and source[len(SOURCE):].isdigit():
            pid = int(source[len(SOURCE):])
            try:
                os.kill(pid, 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            try:
                unmount(Path(point))
                log.info("detached a child's tmpfs that a worker now gone left at %s", point)
            except OSError as e:
                log.warning("could not detach %s: %s", point, e)


def full(path: Path) -> bool:
    """Whether the tmpfs at `path` has (almost) no room left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < FULL_BELOW_BYTES
