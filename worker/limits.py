"""The resource limits of compile and check children, and how a child that went past one is recognised.

worker/shim.py sets them, the first thing to run inside the sandbox (`Limits.argv` are its flags), so they hold
before any code that an upload shaped runs, and every process the child starts inherits them (Inductor's compile
workers, g++, the package under check).

Each limit is a worker setting, and a breach names it: SIGXCPU (RLIMIT_CPU), SIGXFSZ or EFBIG (RLIMIT_FSIZE),
MemoryError, ENOMEM or std::bad_alloc (RLIMIT_AS), EMFILE (RLIMIT_NOFILE), EAGAIN from fork or thread creation
(RLIMIT_NPROC), read from the exit signal, the failure the child reported and the tail of its log.
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

    memory_bytes: int | None = None  # RLIMIT_AS
    cpu_s: int | None = None  # RLIMIT_CPU, per process, all its threads
    file_bytes: int | None = None  # RLIMIT_FSIZE
    procs: int | None = None  # RLIMIT_NPROC: processes and threads of the uid, host-wide
    open_files: int | None = None  # RLIMIT_NOFILE

    def argv(self) -> list[str]:
        out: list[str] = []
        for flag, value in (("--as", self.memory_bytes), ("--cpu", self.cpu_s), ("--fsize", self.file_bytes),
                            ("--nproc", self.procs), ("--nofile", self.open_files)):
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
}

_MEMORY = re.compile(r"MemoryError|std::bad_alloc|Cannot allocate memory|failed to map segment|"
                     r"virtual memory exhausted|out of memory allocating|\[Errno 12\]")
_FILE = re.compile(r"File too large|File size limit exceeded|SIGXFSZ|\[Errno 27\]")
_CPU = re.compile(r"CPU time limit exceeded|SIGXCPU")
_OPEN_FILES = re.compile(r"Too many open files|\[Errno 24\]")
_PROCS = re.compile(r"can't start new thread|Thread creation failed|pthread_create|"
                    r"fork: (?:retry: )?Resource temporarily unavailable|BlockingIOError: \[Errno 11\]")


@dataclass(frozen=True)
class Breach:
    limit: str  # a key of SETTINGS
    what: str  # "used more than 16 GiB of memory"

    @property
    def setting(self) -> str:
        return SETTINGS[self.limit]


def breach(limits: Limits | None, died_of: int | None, text: str) -> Breach | None:
    """The limit a failed child went past, if its exit signal or what it wrote says so (text: the failure's
    message and excerpt and the log's tail). None: it failed some other way."""
    if limits is None:
        return None
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
