"""What keeps `aotc-server`'s processes tidy: children that die with it, and lock files that say who holds a
folder.

- `dying_with_this_process`: Linux's PR_SET_PDEATHSIG, set in a child (by a launcher that then execs the real
  program, or first thing in a spawned Python child), makes the kernel signal the child when its parent dies,
  `kill -9` included. Without it a killed
  aotc-server leaves redis-server and the workers running, and the next start attaches to them or starts a second
  redis-server on the same append-only file.
- `DirLock`: an exclusive `flock` on a file in a folder, held for a process's life. The kernel drops it when the
  last process holding the open file ends, so it never outlives its holders and needs no stale-lock clean-up.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def set_parent_death_signal(sig: int, parent: int | None) -> None:
    """Have the kernel send `sig` to this process when its parent dies; exit now if `parent` (the pid expected)
    is already gone, since the request only covers a death that comes after it."""
    if _libc is None:
        return
    _libc.prctl(PR_SET_PDEATHSIG, int(sig))
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def dying_with_this_process(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """The command line that runs `argv` so that it gets `sig` when this process dies.

    A small launcher (this file run as a script) sets the signal in the child, then execs `argv`: the setting
    survives exec, and the pid stays the same, so Popen's pid is the program's. A Popen preexec_fn would do the
    same, but runs Python between fork and exec, which can deadlock in a process with other threads (a lock held
    at fork time), and a supervisor restarts workers from a thread while the API serves.

    The kernel ties the signal to the thread that started the child, so start children from a thread that lives
    as long as they should (aotc-server: its main thread, or the one that supervises its workers)."""
    # By path, isolated (-I): the launcher needs only the standard library, whatever sys.path the child would have.
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), str(int(sig)), *argv]


class LockHeld(RuntimeError):
    """Another process holds the lock."""


class DirLock:
    """An exclusive lock on `path` (created if need be), with the holder's pid written in it for the message."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def acquire(self, wait_s: float = 0.0) -> DirLock:
        """Take the lock, waiting up to `wait_s` for a holder that is on its way out; LockHeld otherwise."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited unless passed on (pass_fds)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                    os.close(fd)
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise LockHeld(f"{self.path} is held by pid {self.holder()}") from None
                    raise
                time.sleep(0.1)
        self.fd = fd
        self.note(str(os.getpid()))
        return self

    def note(self, text: str) -> None:
        """Say who holds the lock (what a refused process prints)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{text}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # other holders (children it was passed to) keep it until they end
            self.fd = None


if __name__ == "__main__":  # the launcher: python -I service/procs.py PARENT_PID SIGNAL PROGRAM [ARGS...]
    _parent, _sig, *_argv = sys.argv[1:]
    set_parent_death_signal(int(_sig), int(_parent))
    os.execvp(_argv[0], _argv)
