"""Reading what a child wrote: everything in its dir is the child's word. The worker opens it without following a
symlink at any level, refuses anything but plain dirs and files, caps what it reads, and takes outputs out only once
the child and everything it started are dead."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path


def open_beneath(base: Path, rel: str, flags: int = os.O_RDONLY) -> int:
    """Open base/rel without following a symlink anywhere below `base` (the child may have planted one at any
    level) and without blocking on a FIFO; OSError if anything on the way is not a plain dir or file."""
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"bad path {rel!r}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(errno.EINVAL, f"{rel} is not a regular file")
    return out


def read_untrusted(base: Path, rel: str, cap: int, offset: int = 0) -> bytes | None:
    """Up to `cap` bytes of base/rel from `offset` (see open_beneath); None if it cannot be read as a plain file."""
    try:
        fd = open_beneath(base, rel)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read(cap)


def take(childdir: Path, name: str, dest_dir: Path) -> Path | None:
    """Move the child's output `name` (a plain file directly in childdir) into the worker's `dest_dir`, the
    worker's and read-only to children from now on; None if it is missing or not a plain file. Call only when the
    child is dead: nothing can swap the file between the check and the move."""
    src = childdir / name
    try:
        st = os.lstat(src)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return None
    dest_dir.mkdir(mode=0o755, exist_ok=True)
    os.chmod(dest_dir, 0o755)  # whatever the umask (aotc-server's is 077): the check child reads the package here
    dest = dest_dir / name
    os.rename(src, dest)
    os.chown(dest, os.getuid(), os.getgid())
    os.chmod(dest, 0o644)
    return dest




def open_beneath_dir(base: Path, rel: str) -> int:
    """A dir fd for base/rel, following no link below `base`."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in [p for p in rel.split("/") if p]:
        if part in (".", ".."):
            os.close(fd)
            raise OSError(errno.EINVAL, f"bad path {rel!r}")
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def copy_out(base: Path, keep: Iterable[str], dest: Path) -> list[str]:
    """Copy each of `keep` (paths relative to `base`; "dir/" for every plain file directly in dir) to the same
    place under `dest`, the worker's, as plain files of its own (0644); what is missing, a link or not a plain file
    is skipped. Returns what was copied. Call when the child is dead."""
    names: list[str] = []
    for rel in keep:
        if not rel.endswith("/"):
            names.append(rel)
            continue
        try:
            fd = open_beneath_dir(base, rel)
        except OSError:
            continue
        try:
            names += [f"{rel}{e.name}" for e in os.scandir(fd) if e.is_file(follow_symlinks=False)]
        finally:
            os.close(fd)
    copied = []
    for rel in names:
        try:
            src = open_beneath(base, rel)
        except OSError:
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(src, "rb") as fin, open(target, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.chmod(target, 0o644)
        copied.append(rel)
    return copied
