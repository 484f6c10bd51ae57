"""The resource limits of compile and check children, and how a child that went past one is recognised.

Two kinds hold them. Per sandbox, all its processes together: memory and processes by the sandbox's cgroup
(worker.cgroups), everything it writes by the size of the tmpfs its writable dir is (worker.scratch). Per process:
rlimits, which worker/shim.py sets, the first thing to run inside the sandbox (`Limits.argv` are its flags), so they
hold before any code that an upload shaped runs, and every process the child starts inherits them (Inductor's compile
workers, g++, the package under check). Where no cgroup can be had, memory and processes fall back to rlimits
(RLIMIT_AS, RLIMIT_NPROC), and the worker says so at start (worker.isolation).

Each limit is a worker setting, and a breach names it. What the kernel counted comes first: an OOM kill or a refused
fork in the sandbox's cgroup, a full tmpfs. Then the exit signal, the failure the child reported and the tail of its
log: SIGXCPU (RLIMIT_CPU), SIGXFSZ or EFBIG (RLIMIT_FSIZE), ENOSPC (the tmpfs), MemoryError, ENOMEM or
std::bad_alloc (RLIMIT_AS), EMFILE (RLIMIT_NOFILE), EAGAIN from fork or thread creation (RLIMIT_NPROC).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Limits:
    """rlimits for one child; None leaves that one as the worker has it."""

    memory_bytes: int | None = None  # the sandbox's cgroup; else RLIMIT_AS of each process (CPU children only)
    cpu_s: int | None = None  # RLIMIT_CPU, per process, all its threads
    file_bytes: int | None = None  # RLIMIT_FSIZE
    procs: int | None = None  # the sandbox's cgroup; else RLIMIT_NPROC: processes and threads of the uid, host-wide
    open_files: int | None = None  # RLIMIT_NOFILE
    disk_bytes: int | None = None  # the size of the tmpfs that is the child's writable dir

    def argv(self, *, address_space: bool = True, nproc: bool = True) -> list[str]:
        """The shim's flags. `address_space`/`nproc`: whether memory and processes fall to rlimits (no cgroup)."""
        out: list[str] = []
        for flag, value in (("--as", self.memory_bytes if address_space else None), ("--cpu", self.cpu_s),
                            ("--fsize", self.file_bytes), ("--nproc", self.procs if nproc else None),
                            ("--nofile", self.open_files)):
            if value is not None:
                out += [flag, str(value)]
        return out


# Which setting each limit comes from (worker/settings.py), and what a breach is called in a failure message.
SETTINGS = {
    "memory": "AOTC_COMPILE_MAX_MEMORY_GB",
    "cpu": "AOTC_CHILD_MAX_CPU_S",
    "file": "AOTC_CHILD_MAX_FILE_MB",
    "procs": "AOTC_CHILD_MAX_PROCS",
    "open_files": "AOTC_CHILD_MAX_OPEN_FILES",
    "disk": "AOTC_CHILD_MAX_DISK_MB",
}

_MEMORY = re.compile(r"MemoryError|std::bad_alloc|Cannot allocate memory|failed to map segment|"
                     r"virtual memory exhausted|out of memory allocating|\[Errno 12\]")
_FILE = re.compile(r"File too large|File size limit exceeded|SIGXFSZ|\[Errno 27\]")
_CPU = re.compile(r"CPU time limit exceeded|SIGXCPU")
_DISK = re.compile(r"No space left on device|\[Errno 28\]")
_OPEN_FILES = re.compile(r"Too many open files|\[Errno 24\]")
_PROCS = re.compile(r"can't start new thread|Thread creation failed|pthread_create|"
                    r"fork: (?:retry: )?Resource temporarily unavailable|BlockingIOError: \[Errno 11\]")


@dataclass(frozen=True)
class Counted:
    """What the kernel counted for one sandbox (its cgroup, its tmpfs), read after its child died."""

    oom_kills: int = 0  # processes the OOM killer took at the cgroup's memory limit
    forks_refused: int = 0  # forks and clones refused at the cgroup's pids.max
    disk_full: bool = False  # the tmpfs had (almost) no room left


@dataclass(frozen=True)
class Breach:
    limit: str  # a key of SETTINGS
    what: str  # "used more than 16 GiB of memory"

    @property
    def setting(self) -> str:
        return SETTINGS[self.limit]


def breach(limits: Limits | None, died_of: int | None, text: str, counted: Counted | None = None) -> Breach | None:
    """The limit a failed child went past, if what the kernel counted, its exit signal or what it wrote says so
    (text: the failure's message and excerpt and the log's tail). None: it failed some other way."""
    if limits is None:
        return None
    c = counted or Counted()
    if limits.memory_bytes is not None and c.oom_kills:
        return Breach("memory", f"used more than {limits.memory_bytes / GIB:g} GiB of memory")
    if limits.procs is not None and c.forks_refused:
        return Breach("procs", f"ran more than {limits.procs} processes and threads")
    if limits.disk_bytes is not None and (c.disk_full or _DISK.search(text)):
        return Breach("disk", f"wrote more than {limits.disk_bytes / MIB:g} MiB in its dir")
    if limits.cpu_s is not None and (died_of == signal.SIGXCPU or _CPU.search(text)):
        return Breach("cpu", f"used more than {limits.cpu_s} s of CPU time")
    if limits.file_bytes is not None and (died_of == signal.SIGXFSZ or _FILE.search(text)):
        return Breach("file", f"wrote a file larger than {limits.file_bytes / MIB:g} MiB")
    if limits.memory_bytes is not None and _MEMORY.search(text):
        return Breach("memory", f"used more than {limits.memory_bytes / GIB:g} GiB of memory")
    if limits.open_files is not None and _OPEN_FILES.search(text):
        return Breach("open_files", f"had more than {limits.open_files} files open")
    if limits.procs is not None and _PROCS.search(text):
        return Breach("procs", f"ran more than {limits.procs} processes and threads")
    return None
