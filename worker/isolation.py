"""How compile and check children are confined: bubblewrap (bwrap), an unprivileged uid, no network, a seccomp
filter, only the host paths a compile needs, bounds per sandbox, and nothing secret in sight. The children run torch,
Inductor, g++ and the native code they generate from a graph an upload shaped: treat them as hostile.

    worker ──spawn──▶ shim.py ──exec──▶ bwrap ──▶ python -I -S shim.py ──exec──▶ python -P -m worker.child JOBDIR KIND
            (root)    joins the          namespaces, mounts,  rlimits, drop to       (the sandbox uid, no capabilities,
                      child's cgroup     seccomp              the uid, no_new_privs   no_new_privs, only `lo`, seccomp)

Inside, the child sees:

- read-only: /usr and its links (/bin, /lib...), a few files of /etc, Python, this checkout, PYTHONPATH,
  AOTC_SANDBOX_MOUNT, the CPU topology in /sys (worker.mounts lists them, and the CUDA extras); not the rest of the
  host: no /home, no /root, no /var, no /sys/class/net, no other user's files;
- a fresh /dev (plus every /dev/nvidia* for CUDA children), its own /proc (its pid namespace) with a synthetic
  /proc/loadavg and /proc/meminfo (its own memory bound, not the host's);
- its job dir read-only (the model, its task) and one writable dir of its own (JOBDIR/KIND: HOME, TMPDIR, the
  Inductor and Triton caches, its outputs; also its /tmp), plus the trusted precompiled headers, each file bound
  read-only; an empty tmpfs over the work, data and headers dirs and AOTC_SANDBOX_HIDE where they lie under what is
  bound;
- only `lo` in its own network namespace: no route to Redis, the API or anything else;
- an environment of PATH, HOME, LANG, USER, PYTHONPATH, TMPDIR, the cache dirs, CUDA_VISIBLE_DEVICES, LD_PRELOAD
  and OMP_NUM_THREADS: no AOTC_* setting, no Redis URL, no key.

Bounds per sandbox, each picked at start (`setup`) and reported (`describe`, GET /v1/workers): memory and processes
by a cgroup per child (worker.cgroups; the launcher joins it before it execs bwrap), else by a uid per child
(worker.uids) and rlimits; everything the child writes by a tmpfs of AOTC_CHILD_MAX_DISK_MB as its writable dir
(worker.scratch); system calls by seccomp (worker.seccomp).

Two modes, chosen at start by running a trivial command in each:

- `privileged`, when the worker is root with CAP_SYS_ADMIN (a VM, a bare host): bwrap runs as root, so it can bind
  paths that the sandbox uid could not reach (a Python under /root; the dirs above a bound path are made 0755); it
  drops every capability but SETUID/SETGID, and shim.py drops to the uid before exec. bwrap's --disable-userns needs
  its own user namespace, which as root would map the child to root outside: here seccomp refuses new namespaces.
- `userns`, otherwise: the worker drops to the uid (if root) *before* bwrap, and bwrap makes an unprivileged user
  namespace (--unshare-user --disable-userns). Never bwrap --unshare-user as root: the child would be root outside,
  and root's 0600 files readable. Here bwrap resolves paths as the uid, so Python, the code and the work dir must be
  reachable by it.

Files the child writes are owned by the sandbox uid outside. The trusted parent does all I/O for it: it fetches the
model, seeds and reads caches, and copies the outputs out with O_NOFOLLOW once the child is dead (worker.sandbox).
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from worker import mounts, scratch
from worker.cgroups import Cgroups, Group
from worker.cgroups import find as find_cgroups
from worker.limits import GIB, MIB, Counted, Limits
from worker.seccomp import Filter, SeccompUnavailable
from worker.seccomp import build as build_seccomp
from worker.settings import WorkerSettings
from worker.uids import UidPool
from worker.untrusted import copy_out

log = logging.getLogger("aotc.worker")

ROOT = Path(__file__).resolve().parent.parent  # this checkout: `python -m worker.child` imports it
SHIM = ROOT / "worker" / "shim.py"
USER = "aotc"  # USER/LOGNAME in children: Inductor names its per-user temp dirs after it (torchinductor_aotc)
CAP_SYS_ADMIN = 21
Mode = Literal["privileged", "userns", "off"]
PROBE_LIMITS = Limits(memory_bytes=2 * GIB, procs=256, disk_bytes=16 * MIB)  # enough for `import worker`


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here; the message says why and what to do."""


@dataclass(frozen=True)
class Bounds:
    """What bounds a sandbox as a whole, picked at start: a cgroup per child, else a uid per child; a tmpfs as its
    writable dir; a seccomp filter. None/False: that mechanism is not available, and rlimits hold alone."""

    cgroups: Cgroups | None = None
    uids: UidPool | None = None
    tmpfs: bool = False
    seccomp: Filter | None = None

    def describe(self, uid: int, mode: Mode) -> dict[str, str]:
        """Which mechanism bounds each resource: the worker logs it at start and its record shows it."""
        if self.cgroups is not None:
            out = dict(self.cgroups.describe())
        else:
            out = {"memory": "RLIMIT_AS per process (CPU children only; none for CUDA children)",
                   "processes": self.uids.describe() if self.uids is not None else
                   f"RLIMIT_NPROC of uid {uid}, shared by every child of that uid on this host"}
        out["disk"] = ("tmpfs of AOTC_CHILD_MAX_DISK_MB per sandbox, plus RLIMIT_FSIZE per file" if self.tmpfs
                       else "RLIMIT_FSIZE per file only (the worker cannot mount a tmpfs)")
        out["syscalls"] = self.seccomp.describe() if self.seccomp is not None else "no seccomp filter"
        out["user_namespaces"] = ("refused by bwrap --disable-userns and seccomp" if mode == "userns" else
                                  "refused by seccomp" if self.seccomp is not None else "not refused")
        return out


@dataclass(frozen=True)
class Sandbox:
    """How this worker confines its children (`setup` picks the mode). `uid`/`gid`: who the children run as."""

    mode: Mode
    bwrap: str | None = None
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    hidden: tuple[Path, ...] = ()  # an empty tmpfs over each, where it lies under a bound path
    needed: tuple[Path, ...] = ()  # what children must read: Python, this checkout, PYTHONPATH, AOTC_SANDBOX_MOUNT
    pythonpath: tuple[str, ...] = ()
    ld_preload: str = ""
    bounds: Bounds = field(default_factory=Bounds)
    files_dir: Path | None = None  # the worker's synthetic /etc/passwd, /proc/meminfo...

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def describe(self) -> dict[str, Any]:
        """For the worker's registry record (GET /v1/workers)."""
        if not self.on:
            return {"sandbox": "off"}
        return {"sandbox": "on", "sandbox_mechanism": "bwrap", "sandbox_mode": self.mode, "sandbox_uid": self.uid,
                "sandbox_bounds": self.bounds.describe(self.uid, self.mode)}

    def visible(self, path: Path) -> bool:
        """Whether a child could read `path` (if its permissions let it): under a bound path and not hidden, or
        bound back inside a hidden dir."""
        p = Path(os.path.realpath(path))
        roots = [*self.needed, *(Path(os.path.realpath(d)) for d in mounts.SYSTEM), *mounts.etc_files(),
                 *map(Path, mounts.SYS_CPU)]
        if not any(p.is_relative_to(r) for r in roots):
            return False
        above = [h for h in self.hidden if p.is_relative_to(h)]
        if not above:
            return True
        deepest = max(above, key=lambda h: len(h.parts))
        return any(p.is_relative_to(n) and n.is_relative_to(deepest) and n != deepest for n in self.needed)

    # -- one child ----------------------------------------------------------------------------------------------

    @contextmanager
    def cell(self, limits: Limits | None, device: str) -> Iterator[Cell]:
        """One child's confinement, released on exit: its uid (from the pool, if the sandbox uses one), its cgroup,
        its tmpfs (`Cell.scratch`)."""
        uid_lock = None
        child = self
        if self.on and self.bounds.uids is not None:
            uid, uid_lock = self.bounds.uids.acquire()
            child = replace(self, uid=uid, gid=uid)
        group = None
        try:
            if self.on and limits is not None and self.bounds.cgroups is not None:
                group = self.bounds.cgroups.create(limits.memory_bytes, limits.procs)
            cell = Cell(child, limits, device, group)
            try:
                yield cell
            finally:
                cell.release()
        finally:
            if group is not None:
                group.remove()
            if uid_lock is not None:
                UidPool.release(uid_lock)

    def env(self, childdir: Path) -> dict[str, str]:
        """A child's whole environment: nothing of the worker's but what it needs to run."""
        env = {
            "PATH": os.environ.get("PATH") or "/usr/local/bin:/usr/bin:/bin",
            "LANG": os.environ.get("LANG") or "C.UTF-8",
            "HOME": str(childdir / "home"),
            "USER": USER,
            "LOGNAME": USER,
            "PYTHONPATH": os.pathsep.join(self.pythonpath),
            "PYTHONDONTWRITEBYTECODE": "1",
            "TMPDIR": str(childdir / "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": str(childdir / "cache"),
            "TRITON_CACHE_DIR": str(childdir / "triton"),
            # Inductor's Redis caches stay off: a child has no route to Redis, and what it would write there other
            # compiles would read. (The max-autotune timings go through the worker instead: worker.tuning.)
            "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "0",
            "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0",
        }
        for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "AOTC_WEIGHTS_MAX_HEADER_MB"):
            if os.environ.get(name):
                env[name] = os.environ[name]
        if self.ld_preload:
            env["LD_PRELOAD"] = self.ld_preload
        return env

    def command(self, cmd: Sequence[str], *, jobdir: Path, childdir: Path, device: str, limits: Limits | None,
                ro_files: Iterable[tuple[Path, Path]] = (), hide: Iterable[Path] = (), group: Group | None = None,
                seccomp_fd: int | None = None) -> tuple[list[str], dict[str, Any]]:
        """(argv, extra Popen arguments) to run `cmd` confined: `jobdir` read-only, `childdir` writable, each
        (source, dest) of `ro_files` bound read-only, `hide` hidden besides the sandbox's own list, every process in
        `group` (a cgroup) from the start, `seccomp_fd` (a BPF program) loaded before `cmd` runs."""
        env = self.env(childdir)
        # With a cgroup, memory and processes are bounded per sandbox: no RLIMIT_AS (which counts address space,
        # not memory) and no RLIMIT_NPROC (which counts the uid across the host). Without one they fall back to
        # rlimits, RLIMIT_AS only for CPU children (CUDA reserves far more address space than it uses).
        rlimits = limits.argv(address_space=group is None and not device.startswith("cuda"),
                              nproc=group is None) if limits else []
        shim = [sys.executable, "-I", "-S", str(SHIM)]
        inner = [*shim, *(["--uid", str(self.uid), "--gid", str(self.gid)] if self.mode == "privileged" else []),
                 *(["--no-new-privs"] if not self.on else []), *rlimits, "--", *cmd]
        if not self.on:  # unconfined: the shim still sets the limits and no_new_privs (bwrap sets it otherwise)
            return inner, {"env": env, "cwd": str(childdir)}
        assert self.bwrap is not None
        made: set[Path] = set()
        argv = [self.bwrap, *self._namespaces(),
                *self._mounts(device, [*self.hidden, *hide], childdir, made, limits),
                *_bind("--ro-bind", jobdir, jobdir, made), *_bind("--bind", childdir, childdir, made)]
        for src, dest in ro_files:
            argv += _bind("--ro-bind", src, dest, made)
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += ["--chdir", str(childdir), "--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--", *inner]
        kw: dict[str, Any] = {"env": _bwrap_env(), "pass_fds": (seccomp_fd,) if seccomp_fd is not None else ()}
        drop = self.mode == "userns" and os.geteuid() == 0
        if group is not None:
            # The launcher joins the cgroup, then (userns mode, as root) drops to the uid and execs bwrap: no
            # preexec_fn in the threaded worker, and bwrap is counted from its first instruction.
            launch = [*shim, *(x for f in group.procs for x in ("--cgroup", str(f)))]
            if drop:
                launch += ["--uid", str(self.uid), "--gid", str(self.gid)]
            return [*launch, "--", *argv], kw
        if drop:  # dropped by Popen itself (in C, between fork and exec)
            kw.update(user=self.uid, group=self.gid, extra_groups=[])
        return argv, kw

    def own(self, path: Path) -> None:
        """Give a fresh dir tree to the sandbox uid (the parent made it; no child has run in it yet). Its dirs are
        made 0755 whatever the umask (aotc-server's is 077): bwrap, root without capabilities in privileged mode,
        must pass through them to bind and chdir, and they are no longer root's."""
        if not self.on or (self.uid, self.gid) == (os.getuid(), os.getgid()):
            return
        for dirpath, dirnames, filenames in os.walk(path):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o755)
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), self.uid, self.gid)
        os.chmod(path, 0o755)
        os.lchown(path, self.uid, self.gid)

    def _namespaces(self) -> list[str]:
        args = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                "--new-session"]
        if self.mode == "privileged":
            return [*args, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return [*args, "--unshare-user", "--disable-userns"]

    def _mounts(self, device: str, hidden: Iterable[Path], childdir: Path, made: set[Path],
                limits: Limits | None) -> list[str]:
        """Only what a compile needs (worker.mounts), read-only; the child's own tmp dir as /tmp (some torch code
        ignores TMPDIR: the AOTInductor loader of torch 2.11 extracts packages into /tmp/XXXXXX); tmpfs over what
        is hidden under a bound path, and what children need bound back inside it: the ops ordered by depth, so
        that a bind inside a hidden dir comes after the tmpfs over it, and a hidden dir inside a bound one after
        the bind."""
        out = [*mounts.system_ops(), "--dev", "/dev"]
        roots = list(self.needed)
        if device.startswith("cuda"):
            for dev in sorted(Path("/dev").glob("nvidia*")):
                out += ["--dev-bind", str(dev), str(dev)]
            dirs, links = mounts.cuda_paths()
            roots += dirs
        else:
            links = []
        out += ["--proc", "/proc"]
        files = self.files_dir
        if files is not None:
            memory = limits.memory_bytes if limits else None
            out += ["--ro-bind", str(mounts.synthetic(files, "loadavg", mounts.LOADAVG)), "/proc/loadavg",
                    "--ro-bind", str(mounts.synthetic(files, f"meminfo-{memory or 0}", mounts.meminfo(memory))),
                    "/proc/meminfo"]
            out += _bind("--ro-bind", mounts.synthetic(files, f"passwd-{self.uid}-{self.gid}",
                                                       mounts.passwd(self.uid, self.gid, USER)), Path("/etc/passwd"),
                         made)
            out += _bind("--ro-bind", mounts.synthetic(files, f"group-{self.gid}", mounts.group(self.gid, USER)),
                         Path("/etc/group"), made)
        for f in mounts.etc_files():
            out += _bind("--ro-bind", f, f, made)
        for d in mounts.SYS_CPU:
            if os.path.isdir(d):
                out += _bind("--ro-bind", Path(d), Path(d), made)
        hidden = {Path(os.path.realpath(p)) for p in hidden if os.path.lexists(p)}
        roots = sorted({Path(os.path.realpath(p)) for p in roots if os.path.exists(p)})
        ops: list[tuple[int, int, Path, str]] = [(len(p.parts), 0, p, "--ro-bind") for p in roots]
        ops.append((1, 1, Path("/tmp"), "/tmp"))
        for h in sorted(hidden):
            if not any(h.is_relative_to(r) for r in roots):
                continue  # not bound: the child cannot see it anyway
            if self.mode != "privileged" and first_blocking(h, self.uid, self.gid) is not None:
                continue  # bwrap works as the uid here and cannot reach it; nor can the child
            ops.append((len(h.parts), 1, h, "--tmpfs"))
            for p in roots:
                if p.is_relative_to(h) and p != h:
                    ops.append((len(p.parts), 2, p, "--ro-bind"))
        for _, _, path, op in sorted(ops, key=lambda o: (o[0], o[1])):
            if op == "/tmp":
                out += _bind("--bind", childdir / "tmp", path, made)
            elif op == "--tmpfs":
                out += ["--tmpfs", str(path)]
            else:
                out += _bind(op, path, path, made)
        for link, target in links:
            out += _bind("--symlink", target, link, made)
        return out


class Cell:
    """One child's confinement: the sandbox as it runs this child (its uid), its cgroup, its tmpfs, its seccomp fd."""

    def __init__(self, sandbox: Sandbox, limits: Limits | None, device: str, group: Group | None) -> None:
        self.sandbox = sandbox
        self.limits = limits
        self.device = device
        self.group = group
        self.tmpfs: Path | None = None
        self.keep: list[str] = []

    def scratch(self, childdir: Path) -> None:
        """Make the fresh, empty `childdir` a tmpfs of the disk bound, where the sandbox can mount one."""
        disk = self.limits.disk_bytes if self.limits else None
        if self.sandbox.on and disk and self.sandbox.bounds.tmpfs:
            scratch.mount(childdir, disk, self.sandbox.uid, self.sandbox.gid)
            self.tmpfs = childdir

    def spawn(self, cmd: Sequence[str], *, jobdir: Path, childdir: Path, ro_files: Iterable[tuple[Path, Path]],
              hide: Iterable[Path], **popen: Any) -> subprocess.Popen[bytes]:
        seccomp = self.sandbox.bounds.seccomp
        fd = seccomp.fd() if seccomp is not None and self.sandbox.on else None
        try:
            argv, kw = self.sandbox.command(cmd, jobdir=jobdir, childdir=childdir, device=self.device,
                                            limits=self.limits, ro_files=ro_files, hide=hide, group=self.group,
                                            seccomp_fd=fd)
            return subprocess.Popen(argv, **popen, **kw)
        finally:
            if fd is not None:
                os.close(fd)

    def counted(self) -> Counted:
        """What the kernel counted against this child's bounds; call once it is dead."""
        c = self.group.counted() if self.group is not None else Counted()
        return replace(c, disk_full=self.tmpfs is not None and scratch.full(self.tmpfs))

    def peaks(self) -> dict[str, int | None]:
        """The most memory and processes the sandbox held at once (where its cgroup records them)."""
        return self.group.peaks() if self.group is not None else {}

    def release(self) -> None:
        """Copy what the caller keeps out of the tmpfs into the same dir beneath it, then detach the tmpfs."""
        if self.tmpfs is None:
            return
        fd = os.open(self.tmpfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            scratch.unmount(self.tmpfs)  # the fd keeps the detached tmpfs readable until it is closed
            if self.keep:
                copy_out(Path(f"/proc/self/fd/{fd}"), self.keep, self.tmpfs)
        finally:
            os.close(fd)
            self.tmpfs = None


def _bind(op: str, src: Path, dest: Path, made: set[Path]) -> list[str]:
    """A bind, after `--dir` for each of dest's parents: where bwrap has to create them (inside a tmpfs) it would
    make them 0700 and root's in privileged mode, which the uid could not pass; existing ones stay as they are."""
    out = []
    for parent in reversed(dest.parents):
        if parent != Path("/") and parent not in made:
            made.add(parent)
            out += ["--perms", "0755", "--dir", str(parent)]
    made.add(dest)
    return [*out, op, str(src), str(dest)]


def _bwrap_env() -> dict[str, str]:
    """bwrap's own environment (the child's is set with --clearenv/--setenv): no secrets in /proc/PID/environ."""
    return {"PATH": os.environ.get("PATH") or "/usr/bin:/bin", "LANG": os.environ.get("LANG") or "C.UTF-8"}


def first_blocking(path: Path, uid: int, gid: int) -> Path | None:
    """The first directory on the way to `path` (itself included) that `uid` cannot search, or None."""
    if uid == 0:
        return None
    p = Path(os.path.realpath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return None  # gone: nothing to reach
        if not stat.S_ISDIR(st.st_mode):
            continue
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return d
    return None


def _needed(settings: WorkerSettings) -> tuple[Path, ...]:
    paths = {ROOT, Path(os.path.realpath(sys.executable)).parent}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        paths.add(Path(os.path.realpath(p)))
    for p in [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *map(str, settings.sandbox_mount)]:
        if p and os.path.isabs(p) and os.path.exists(p):
            paths.add(Path(os.path.realpath(p)))
    return tuple(sorted(paths))


def _pythonpath() -> tuple[str, ...]:
    """This checkout first, then the worker's own PYTHONPATH (e.g. the fault tests' custom ops)."""
    out = [str(ROOT)]
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p and p not in out:
            out.append(os.path.abspath(p))
    return tuple(out)


def _hidden(settings: WorkerSettings) -> tuple[Path, ...]:
    paths = [Path("/tmp"), Path("/run"), Path("/var/run"), settings.work_dir, settings.data_dir,
             settings.data_dir / "redis", headers_dir(settings), Path(os.path.expanduser("~")), *settings.sandbox_hide]
    if settings.redis_url.startswith("unix://"):  # a socket by path ignores the network namespace: hide its dir
        paths.append(Path(urlsplit(settings.redis_url).path).parent)  # unix://[:password@]/path?db=0
    out = []
    for p in paths:
        real = Path(os.path.realpath(p))
        if real != Path("/") and real not in out:
            out.append(real)
    return tuple(out)


def headers_dir(settings: WorkerSettings) -> Path:
    return (settings.headers_dir or settings.work_dir / "headers").resolve()


def _can_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            eff = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(eff >> CAP_SYS_ADMIN & 1)


def _ids(settings: WorkerSettings) -> tuple[int, int]:
    if os.geteuid() != 0:
        return os.getuid(), os.getgid()
    gid = settings.sandbox_gid
    if gid is None:
        try:
            gid = pwd.getpwuid(settings.sandbox_uid).pw_gid
        except KeyError:
            gid = settings.sandbox_uid
    return settings.sandbox_uid, gid


def unconfined(settings: WorkerSettings) -> Sandbox:
    return Sandbox("off", None, os.getuid(), os.getgid(), (), (), _pythonpath(), settings.child_ld_preload)


def bounds(settings: WorkerSettings) -> Bounds:
    """The mechanisms that bound each sandbox here, per AOTC_SANDBOX_BOUNDS, AOTC_CHILD_MAX_DISK_MB and
    AOTC_SANDBOX_SECCOMP; SandboxUnavailable where one the settings ask for cannot be had."""
    seccomp = None
    if settings.sandbox_seccomp:
        try:
            seccomp = build_seccomp()
        except SeccompUnavailable as e:
            raise SandboxUnavailable(f"the sandbox cannot be set up: {e}; or set AOTC_SANDBOX_SECCOMP=false") from None
    else:
        log.warning("AOTC_SANDBOX_SECCOMP=false: children run without a seccomp filter (namespaces, mount, ptrace, "
                    "bpf, io_uring... are open to them)")
    cgroups, uids = None, None
    if settings.sandbox_bounds in ("auto", "cgroup"):
        cgroups, why = find_cgroups(settings.sandbox_cgroup)
        if cgroups is None and settings.sandbox_bounds == "cgroup":
            raise SandboxUnavailable(f"the sandbox cannot be set up with AOTC_SANDBOX_BOUNDS=cgroup: {why}. Delegate "
                                     "a cgroup v2 subtree (AOTC_SANDBOX_CGROUP) or set AOTC_SANDBOX_BOUNDS=auto")
        if cgroups is None:
            log.warning("no cgroup for the sandboxes (%s): memory and processes are bounded by rlimits", why)
    if cgroups is None and settings.sandbox_bounds in ("auto", "uid"):
        if os.geteuid() == 0:
            uids = UidPool(settings.sandbox_uid_pool_start, settings.sandbox_uid_pool_size,
                           settings.sandbox_uid_lock_dir)
            uids.setup()
        elif settings.sandbox_bounds == "uid":
            raise SandboxUnavailable("the sandbox cannot be set up with AOTC_SANDBOX_BOUNDS=uid: only root can run "
                                     "children as uids of their own")
    tmpfs = False
    if settings.child_max_disk_mb:
        settings.work_dir.mkdir(parents=True, exist_ok=True)
        why_not = scratch.can_mount(settings.work_dir.resolve())
        tmpfs = why_not is None
        if tmpfs:
            scratch.sweep()
        else:
            log.warning("children's dirs cannot be a tmpfs (%s): AOTC_CHILD_MAX_DISK_MB does not hold, only "
                        "AOTC_CHILD_MAX_FILE_MB per file", why_not)
    return Bounds(cgroups, uids, tmpfs, seccomp)


def candidates(settings: WorkerSettings, found: Bounds | None = None) -> list[Sandbox]:
    """The sandboxes this worker could use, best first (none probed)."""
    bwrap = shutil.which(settings.sandbox_bwrap)
    if bwrap is None:
        return []
    uid, gid = _ids(settings)
    modes: list[Mode] = ["privileged", "userns"] if os.geteuid() == 0 and _can_sys_admin() else ["userns"]
    files = (settings.work_dir / ".sandbox-files").resolve()
    return [Sandbox(mode, os.path.abspath(bwrap), uid, gid, _hidden(settings), _needed(settings), _pythonpath(),
                    settings.child_ld_preload, found or Bounds(), files) for mode in modes]


def setup(settings: WorkerSettings, device: str) -> Sandbox:
    """The sandbox this worker will use, after running a trivial command in it; SandboxUnavailable says why none
    works. AOTC_SANDBOX=off: unconfined, with a loud warning."""
    if settings.sandbox == "off":
        log.warning("AOTC_SANDBOX=off: compile and check children run UNCONFINED, as %s with this worker's network "
                    "and files. Only compile models you trust.", pwd_name(os.getuid()))
        return unconfined(settings)
    if shutil.which(settings.sandbox_bwrap) is None:
        raise SandboxUnavailable(
            f"the sandbox cannot be set up: no bubblewrap binary at AOTC_SANDBOX_BWRAP={settings.sandbox_bwrap!r}. "
            "Install it (apt-get install bubblewrap), point AOTC_SANDBOX_BWRAP at one, or set AOTC_SANDBOX=off to "
            "run compiles unconfined (only for trusted models).")
    found = candidates(settings, bounds(settings))
    problems = []
    for sandbox in found:
        problem = probe(sandbox, settings.work_dir, device)
        if problem is None:
            if sandbox.uid == os.getuid():
                log.warning("this worker is not root, so its children run as its own uid %d: files it can read "
                            "are hidden from them only where AOTC_SANDBOX_HIDE and the defaults cover them",
                            sandbox.uid)
            log.info("sandbox: bwrap (%s mode), children run as uid %d", sandbox.mode, sandbox.uid)
            for what, how in sandbox.bounds.describe(sandbox.uid, sandbox.mode).items():
                log.info("sandbox bound: %s: %s", what, how)
            return sandbox
        problems.append(f"{sandbox.mode} mode: {problem}")
    raise SandboxUnavailable(
        f"the sandbox cannot be set up with {found[0].bwrap}: " + "; ".join(problems) + ". Fix that, or set "
        "AOTC_SANDBOX=off to run compiles unconfined (only for trusted models).")


def probe(sandbox: Sandbox, work_dir: Path, device: str) -> str | None:
    """Run a trivial Python in the sandbox, as a child would run (its cgroup, tmpfs and seccomp filter too); None
    if it works, else what went wrong."""
    work_dir.mkdir(parents=True, exist_ok=True)
    jobdir = Path(tempfile.mkdtemp(prefix="sandbox-probe-", dir=work_dir.resolve()))
    try:
        os.chmod(jobdir, 0o755)
        childdir = jobdir / "probe"
        childdir.mkdir()
        with sandbox.cell(PROBE_LIMITS, device) as cell:
            cell.scratch(childdir)
            (childdir / "tmp").mkdir()
            cell.sandbox.own(childdir)
            code = "import os, worker; print(os.getuid(), os.getgid())"
            try:
                proc = cell.spawn([sys.executable, "-P", "-c", code], jobdir=jobdir, childdir=childdir, ro_files=(),
                                  hide=(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as e:
                return f"{type(e).__name__}: {e}"
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired as e:
                proc.kill()
                proc.communicate()
                return f"{type(e).__name__}: {e}"
            if proc.returncode != 0:
                text = (err or out).decode("utf-8", "replace").strip()[-1500:]
                blocked = [f"{p} (blocked at {b})" for p in sandbox.needed
                           if (b := first_blocking(p, cell.sandbox.uid, cell.sandbox.gid)) is not None]
                hint = (f"; uid {cell.sandbox.uid} cannot reach " + ", ".join(blocked)) if blocked else ""
                return f"exit status {proc.returncode}: {text}{hint}"
            uid = int(out.split()[0])
            if uid == 0 or uid != cell.sandbox.uid:
                return f"the child ran as uid {uid}, not {cell.sandbox.uid}"
        return None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def pwd_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
