"""One cgroup per compile or check child, so that memory and processes are bounded per sandbox, all its processes
together, rather than per process (RLIMIT_AS) or per uid across the host (RLIMIT_NPROC).

    v2  a delegated subtree: a cgroup the worker may write whose cgroup.subtree_control holds memory and pids
        (AOTC_SANDBOX_CGROUP, default the worker's own); each child's group is made in it
    v1  root on a host with the memory and pids hierarchies mounted (this project's VMs and CI): one group per
        child under aotc/ in the worker's own memory and pids groups (/sys/fs/cgroup/memory/<its group>/aotc/...)

A group is named `w<worker pid>-<n>`. The launcher (worker/shim.py, before it execs bwrap) writes its own pid into
the group's cgroup.procs files, so bwrap and everything it starts are in it from their first instruction: no
preexec_fn in the threaded worker, and nothing forks before it is counted. After the child died the worker reads
what the kernel counted (OOM kills, refused forks, peaks), kills whatever is left and removes the group. At start,
groups of workers that are gone are removed (`sweep`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from worker.limits import Counted

log = logging.getLogger("aotc.worker")

V1_ROOT = Path("/sys/fs/cgroup")
V1_PARENT = "aotc"
_counter = itertools.count()


class Group(Protocol):
    """One child's cgroup."""

    @property
    def procs(self) -> tuple[Path, ...]:
        """The cgroup.procs files the launcher writes its pid to."""

    def counted(self) -> Counted: ...

    def peaks(self) -> dict[str, int | None]: ...

    def remove(self) -> None: ...


class Cgroups(Protocol):
    """A way to make groups: `describe` says which, for the worker's record."""

    @property
    def version(self) -> str: ...

    def create(self, memory_bytes: int | None, procs: int | None) -> Group: ...

    def describe(self) -> dict[str, str]: ...


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _field(text: str, key: str) -> int:
    """`key N` from a flat keyed file (memory.events, pids.events, memory.oom_control)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return 0


def _int(path: Path) -> int | None:
    text = _read(path).strip()
    return int(text) if text.isdigit() else None


def _kill_and_rmdir(dirs: list[Path]) -> None:
    """SIGKILL what is left in the groups (the pid namespace took everything with it already, normally), then
    remove them; a group that stays busy is left for the next start's sweep."""
    for attempt in range(50):
        left = []
        for d in dirs:
            if not d.exists():
                continue
            for pid in _read(d / "cgroup.procs").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass
            try:
                d.rmdir()
            except OSError as e:
                if e.errno != errno.ENOENT:
                    left.append(d)
        if not left:
            return
        dirs = left
        time.sleep(0.02 * (attempt + 1) if attempt < 10 else 0.2)
    log.warning("could not remove cgroups %s; the next start removes them", ", ".join(map(str, dirs)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(name: str) -> bool:
    """A group of a worker that is gone (named w<pid>-<n>)."""
    head = name.split("-", 1)[0]
    return head.startswith("w") and head[1:].isdigit() and not _alive(int(head[1:]))


# -- cgroup v1 ------------------------------------------------------------------------------------------------------


@dataclass
class V1Group:
    memory: Path
    pids: Path

    @property
    def procs(self) -> tuple[Path, ...]:
        return (self.memory / "cgroup.procs", self.pids / "cgroup.procs")

    def counted(self) -> Counted:
        return Counted(oom_kills=_field(_read(self.memory / "memory.oom_control"), "oom_kill"),
                       forks_refused=_field(_read(self.pids / "pids.events"), "max"))

    def peaks(self) -> dict[str, int | None]:
        return {"memory_bytes": _int(self.memory / "memory.max_usage_in_bytes"),
                "procs": _int(self.pids / "pids.peak")}

    def remove(self) -> None:
        _kill_and_rmdir([self.memory, self.pids])


class V1:
    version = "v1"

    def __init__(self, root: Path = V1_ROOT) -> None:
        # Inside the worker's own groups, so that a limit on the worker's container holds its children too.
        self.memory = root / "memory" / own_v1_path("memory") / V1_PARENT
        self.pids = root / "pids" / own_v1_path("pids") / V1_PARENT

    def setup(self) -> None:
        """Make the parent groups (OSError where this process may not) and remove groups of workers gone."""
        for d in (self.memory, self.pids):
            d.mkdir(exist_ok=True)
        sweep([self.memory, self.pids])

    def create(self, memory_bytes: int | None, procs: int | None) -> V1Group:
        name = f"w{os.getpid()}-{next(_counter)}"
        g = V1Group(self.memory / name, self.pids / name)
        try:
            g.memory.mkdir()
            g.pids.mkdir()
            if memory_bytes is not None:
                (g.memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                # No swap beyond the limit, where the kernel accounts swap (memsw exists only with swap accounting).
                _try_write(g.memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
            (g.pids / "pids.max").write_text(str(procs) if procs is not None else "max")
        except BaseException:
            g.remove()
            raise
        return g

    def describe(self) -> dict[str, str]:
        return {"memory": f"cgroup v1 memory.limit_in_bytes per sandbox ({self.memory}/)",
                "processes": f"cgroup v1 pids.max per sandbox ({self.pids}/)"}


def _try_write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


# -- cgroup v2 ------------------------------------------------------------------------------------------------------


@dataclass
class V2Group:
    dir: Path

    @property
    def procs(self) -> tuple[Path, ...]:
        return (self.dir / "cgroup.procs",)

    def counted(self) -> Counted:
        return Counted(oom_kills=_field(_read(self.dir / "memory.events"), "oom_kill"),
                       forks_refused=_field(_read(self.dir / "pids.events"), "max"))

    def peaks(self) -> dict[str, int | None]:
        return {"memory_bytes": _int(self.dir / "memory.peak"), "procs": _int(self.dir / "pids.peak")}

    def remove(self) -> None:
        _try_write(self.dir / "cgroup.kill", "1")  # kernel 5.14+: the whole group at once
        _kill_and_rmdir([self.dir])


class V2:
    version = "v2"

    def __init__(self, parent: Path) -> None:
        self.parent = parent

    def setup(self) -> None:
        """Check the delegated parent: memory and pids available and enabled for its children (enabling them where
        it holds no process itself); OSError with the reason otherwise. Then remove groups of workers gone."""
        available = _read(self.parent / "cgroup.controllers").split()
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            raise OSError(errno.ENOTSUP, f"{self.parent} does not offer the {' and '.join(missing)} controller(s)")
        enabled = _read(self.parent / "cgroup.subtree_control").split()
        if not {"memory", "pids"} <= set(enabled):
            (self.parent / "cgroup.subtree_control").write_text("+memory +pids")  # EBUSY if processes live in it
        sweep([self.parent])

    def create(self, memory_bytes: int | None, procs: int | None) -> V2Group:
        g = V2Group(self.parent / f"w{os.getpid()}-{next(_counter)}")
        try:
            g.dir.mkdir()
            if memory_bytes is not None:
                (g.dir / "memory.max").write_text(str(memory_bytes))
                _try_write(g.dir / "memory.swap.max", "0")
            (g.dir / "pids.max").write_text(str(procs) if procs is not None else "max")
        except BaseException:
            g.remove()
            raise
        return g

    def describe(self) -> dict[str, str]:
        return {"memory": f"cgroup v2 memory.max per sandbox ({self.parent}/)",
                "processes": f"cgroup v2 pids.max per sandbox ({self.parent}/)"}


def sweep(parents: list[Path]) -> None:
    """Remove the groups that workers now gone left behind (a worker killed outright)."""
    for parent in parents:
        try:
            names = [e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False) and _stale(e.name)]
        except OSError:
            continue
        if names:
            log.info("removing %d cgroup(s) that workers now gone left in %s", len(names), parent)
            _kill_and_rmdir([parent / n for n in names])


def own_v1_path(controller: str) -> str:
    """This process's group in a cgroup v1 hierarchy, relative to its root ("" at the root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return ""
    for ln in lines:
        _, controllers, path = ln.split(":", 2)
        if controller in controllers.split(","):
            return path.lstrip("/")
    return ""


def own_v2_cgroup() -> Path | None:
    """This process's cgroup v2 dir, where v2 is mounted at /sys/fs/cgroup and the process is in it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rel = next((ln[3:] for ln in lines if ln.startswith("0::")), None)
    if not rel or not (V1_ROOT / "cgroup.controllers").exists():
        return None  # hybrid (v1 controllers, an empty v2 root) or no v2
    return V1_ROOT / rel.lstrip("/")


def find(parent: Path | None) -> tuple[Cgroups | None, str]:
    """The cgroups this worker can bound its children with, best first: v2 where delegated, then v1. (None, why)
    where neither works."""
    problems = []
    v2_parent = parent or own_v2_cgroup()
    if v2_parent is not None:
        v2 = V2(v2_parent)
        try:
            v2.setup()
            return v2, ""
        except OSError as e:
            problems.append(f"cgroup v2 at {v2_parent}: {e.strerror or e}")
    if (V1_ROOT / "memory").is_dir() and (V1_ROOT / "pids").is_dir():
        v1 = V1()
        try:
            v1.setup()
            return v1, ""
        except OSError as e:
            problems.append(f"cgroup v1 at {v1.memory.parent}, {v1.pids.parent}: {e.strerror or e}")
    else:
        problems.append("no cgroup v1 memory and pids hierarchies under /sys/fs/cgroup")
    return None, "; ".join(problems)
