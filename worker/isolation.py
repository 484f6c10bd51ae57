"""How compile and check children are confined: bubblewrap (bwrap), an unprivileged uid, no network, a private
writable dir, resource limits, and nothing secret in sight. The children run torch, Inductor, g++ and the native
code they generate from a graph an upload shaped: treat them as hostile.

    worker ──spawn──▶ bwrap ──▶ python -I -S worker/shim.py ──exec──▶ python -P -m worker.child JOBDIR KIND
            (root)    namespaces, mounts     rlimits, drop to the uid,         (the sandbox uid, no capabilities,
                      (--die-with-parent)    no_new_privs                       no_new_privs, only `lo`)

Inside, the child sees:

- `/` read-only, a fresh /dev (plus every /dev/nvidia* for CUDA children), its own /proc (its pid namespace);
- its own JOBDIR/KIND/tmp as /tmp; an empty tmpfs over /run (Docker secrets, sockets), the worker's home,
  AOTC_WORK_DIR (other jobs), AOTC_DATA_DIR (the embedded Redis's data, uploads), the headers dir, a file blob
  store and AOTC_SANDBOX_HIDE;
- its job dir read-only (the model, its task) and one writable dir of its own (JOBDIR/KIND: HOME, TMPDIR, the
  Inductor and Triton caches, its outputs), plus the trusted precompiled headers, each file bound read-only;
- only `lo` in its own network namespace: no route to Redis, the API or anything else;
- an environment of PATH, HOME, LANG, USER, PYTHONPATH, TMPDIR, the cache dirs, CUDA_VISIBLE_DEVICES, LD_PRELOAD
  and OMP_NUM_THREADS: no AOTC_* setting, no Redis URL, no key.

Two ways to get there, chosen at start by running a trivial command in each (`setup`):

- `privileged`, when the worker is root with CAP_SYS_ADMIN (a VM, a bare host): bwrap runs as root, so it can bind
  paths that the sandbox uid could not reach (a Python under /root); it drops every capability but SETUID/SETGID,
  and shim.py drops to AOTC_SANDBOX_UID before exec. Paths the child needs (Python, the code, PYTHONPATH) that
  the uid cannot traverse to are bound read-only under a tmpfs over the blocking directory.
- `userns`, otherwise: the worker drops to AOTC_SANDBOX_UID (if root) *before* bwrap, and bwrap makes an
  unprivileged user namespace (--unshare-user --disable-userns). Never bwrap --unshare-user as root: the child
  would be root outside, and root's 0600 files readable. Here bwrap resolves paths as the uid, so Python, the code
  and the work dir must be reachable by it.

Files the child writes are owned by the sandbox uid outside. The trusted parent does all I/O for it: it fetches the
model, seeds and reads caches, and takes the outputs with O_NOFOLLOW once the child is dead (worker.sandbox).
"""

from __future__ import annotations

import glob
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from worker.limits import Limits
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")

ROOT = Path(__file__).resolve().parent.parent  # this checkout: `python -m worker.child` imports it
SHIM = ROOT / "worker" / "shim.py"
USER = "aotc"  # USER/LOGNAME in children: Inductor names its per-user temp dirs after it (torchinductor_aotc)
CAP_SYS_ADMIN = 21
Mode = Literal["privileged", "userns", "off"]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here; the message says why and what to do."""


@dataclass(frozen=True)
class Sandbox:
    """How this worker confines its children (`setup` picks the mode). `uid`/`gid`: who the children run as."""

    mode: Mode
    bwrap: str | None = None
    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    hidden: tuple[Path, ...] = ()  # an empty tmpfs over each
    needed: tuple[Path, ...] = ()  # what children must read: Python, this checkout, PYTHONPATH
    pythonpath: tuple[str, ...] = ()
    ld_preload: str = ""

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def describe(self) -> dict[str, Any]:
        """For the worker's registry record (GET /v1/workers)."""
        if not self.on:
            return {"sandbox": "off"}
        return {"sandbox": "on", "sandbox_mechanism": "bwrap", "sandbox_mode": self.mode, "sandbox_uid": self.uid}

    # -- one child ----------------------------------------------------------------------------------------------

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
        for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
            if os.environ.get(name):
                env[name] = os.environ[name]
        if self.ld_preload:
            env["LD_PRELOAD"] = self.ld_preload
        return env

    def command(self, cmd: Sequence[str], *, jobdir: Path, childdir: Path, device: str, limits: Limits | None,
                ro_files: Iterable[tuple[Path, Path]] = (),
                hide: Iterable[Path] = ()) -> tuple[list[str], dict[str, Any]]:
        """(argv, extra Popen arguments) to run `cmd` confined: `jobdir` read-only, `childdir` writable, each
        (source, dest) of `ro_files` bound read-only, `hide` hidden besides the sandbox's own list."""
        env = self.env(childdir)
        shim = [sys.executable, "-I", "-S", str(SHIM)]
        if self.mode == "privileged":
            shim += ["--uid", str(self.uid), "--gid", str(self.gid)]
        shim += [*(["--no-new-privs"] if not self.on else []), *(limits.argv() if limits else []), "--", *cmd]
        if not self.on:  # unconfined: the shim still sets the limits and no_new_privs (bwrap sets it otherwise)
            return shim, {"env": env, "cwd": str(childdir)}
        assert self.bwrap is not None
        made: set[Path] = set()
        argv = [self.bwrap, *self._namespaces(), *self._mounts(device, [*self.hidden, *hide], jobdir, childdir, made),
                *_bind("--ro-bind", jobdir, jobdir, made), *_bind("--bind", childdir, childdir, made)]
        for src, dest in ro_files:
            argv += _bind("--ro-bind", src, dest, made)
        argv += ["--chdir", str(childdir), "--clearenv"]
        for k, v in env.items():
            argv += ["--setenv", k, v]
        argv += ["--", *shim]
        return argv, self._popen_kwargs()

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

    def _popen_kwargs(self) -> dict[str, Any]:
        # Dropped by Popen itself (in C, between fork and exec: no preexec_fn in a threaded worker).
        if self.mode == "userns" and os.geteuid() == 0:
            return {"user": self.uid, "group": self.gid, "extra_groups": [], "env": _bwrap_env()}
        return {"env": _bwrap_env()}

    def _mounts(self, device: str, hidden: Iterable[Path], jobdir: Path, childdir: Path,
                made: set[Path]) -> list[str]:
        """`/` read-only, a new /dev and /proc, the child's own tmp dir as /tmp (some torch code ignores TMPDIR:
        the AOTInductor loader of torch 2.11 extracts packages into /tmp/XXXXXX), tmpfs over what else is hidden,
        what children need bound back: the ops ordered by depth so that a bind inside a hidden dir comes after the
        tmpfs over it, and a hidden dir inside a bound one after the bind."""
        out = ["--ro-bind", "/", "/", "--dev", "/dev"]
        if device.startswith("cuda"):
            for dev in sorted(glob.glob("/dev/nvidia*")):
                out += ["--dev-bind", dev, dev]
        out += ["--proc", "/proc"]
        hidden = {Path(os.path.realpath(p)) for p in hidden if os.path.lexists(p)}
        ops: list[tuple[int, int, Path, str]] = []
        blocked: set[Path] = set()
        if self.mode == "privileged":  # make what children need reachable: a tmpfs over what blocks it
            for p in [*self.needed, jobdir]:
                if (a := first_blocking(p, self.uid, self.gid)) is not None:
                    blocked.add(a)
        for h in sorted(hidden | blocked):
            if self.mode != "privileged" and first_blocking(h, self.uid, self.gid) is not None:
                continue  # bwrap works as the uid here and cannot reach it; nor can the child
            ops.append((len(h.parts), 0, h, "--tmpfs"))
        for p in sorted(set(self.needed)):
            if p in hidden or any(h in p.parents for h in hidden | blocked):
                ops.append((len(p.parts), 1, p, "--ro-bind"))
        for _, _, path, op in sorted(ops, key=lambda o: (o[0], o[1])):
            if op == "--tmpfs":
                out += ["--bind", str(childdir / "tmp"), "/tmp"] if path == Path("/tmp") else ["--tmpfs", str(path)]
            else:
                out += _bind(op, path, path, made)
        return out


def _bind(op: str, src: Path, dest: Path, made: set[Path]) -> list[str]:
    """A bind, after `--dir` for each of dest's parents: where bwrap has to create them (inside a tmpfs) it would
    make them 0700 and root's in privileged mode, which the uid could not pass; existing ones stay as they are."""
    out = []
    for parent in reversed(dest.parents):
        if parent != Path("/") and parent not in made:
            made.add(parent)
            out += ["--perms", "0755", "--dir", str(parent)]
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


def _needed() -> tuple[Path, ...]:
    paths = {ROOT, Path(os.path.realpath(sys.executable)).parent}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        paths.add(Path(os.path.realpath(p)))
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
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


def candidates(settings: WorkerSettings) -> list[Sandbox]:
    """The sandboxes this worker could use, best first (none probed)."""
    bwrap = shutil.which(settings.sandbox_bwrap)
    if bwrap is None:
        return []
    uid, gid = _ids(settings)
    modes: list[Mode] = ["privileged", "userns"] if os.geteuid() == 0 and _can_sys_admin() else ["userns"]
    return [Sandbox(mode, os.path.abspath(bwrap), uid, gid, _hidden(settings), _needed(), _pythonpath(),
                    settings.child_ld_preload) for mode in modes]


def setup(settings: WorkerSettings, device: str) -> Sandbox:
    """The sandbox this worker will use, after running a trivial command in it; SandboxUnavailable says why none
    works. AOTC_SANDBOX=off: unconfined, with a loud warning."""
    if settings.sandbox == "off":
        log.warning("AOTC_SANDBOX=off: compile and check children run UNCONFINED, as %s with this worker's network "
                    "and files. Only compile models you trust.", pwd_name(os.getuid()))
        return unconfined(settings)
    found = candidates(settings)
    if not found:
        raise SandboxUnavailable(
            f"the sandbox cannot be set up: no bubblewrap binary at AOTC_SANDBOX_BWRAP={settings.sandbox_bwrap!r}. "
            "Install it (apt-get install bubblewrap), point AOTC_SANDBOX_BWRAP at one, or set AOTC_SANDBOX=off to "
            "run compiles unconfined (only for trusted models).")
    problems = []
    for sandbox in found:
        problem = probe(sandbox, settings.work_dir, device)
        if problem is None:
            if sandbox.uid == os.getuid():
                log.warning("this worker is not root, so its children run as its own uid %d: files it can read "
                            "are hidden from them only where AOTC_SANDBOX_HIDE and the defaults cover them",
                            sandbox.uid)
            log.info("sandbox: bwrap (%s mode), children run as uid %d", sandbox.mode, sandbox.uid)
            return sandbox
        problems.append(f"{sandbox.mode} mode: {problem}")
    raise SandboxUnavailable(
        f"the sandbox cannot be set up with {found[0].bwrap}: " + "; ".join(problems) + ". Fix that, or set "
        "AOTC_SANDBOX=off to run compiles unconfined (only for trusted models).")


def probe(sandbox: Sandbox, work_dir: Path, device: str) -> str | None:
    """Run a trivial Python in the sandbox, as a child would run; None if it works, else what went wrong."""
    import tempfile

    work_dir.mkdir(parents=True, exist_ok=True)
    jobdir = Path(tempfile.mkdtemp(prefix="sandbox-probe-", dir=work_dir.resolve()))
    try:
        os.chmod(jobdir, 0o755)
        childdir = jobdir / "probe"
        (childdir / "tmp").mkdir(parents=True)
        sandbox.own(childdir)
        code = "import os, worker; print(os.getuid(), os.getgid())"
        argv, kw = sandbox.command([sys.executable, "-P", "-c", code], jobdir=jobdir, childdir=childdir,
                                   device=device, limits=None)
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, **kw)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{type(e).__name__}: {e}"
        if r.returncode != 0:
            out = (r.stderr or r.stdout).strip()[-1500:]
            blocked = [f"{p} (blocked at {b})" for p in sandbox.needed
                       if (b := first_blocking(p, sandbox.uid, sandbox.gid)) is not None]
            hint = (f"; uid {sandbox.uid} cannot reach " + ", ".join(blocked)) if blocked else ""
            return f"exit status {r.returncode}: {out}{hint}"
        uid = int(r.stdout.split()[0])
        if uid == 0 or uid != sandbox.uid:
            return f"the child ran as uid {uid}, not {sandbox.uid}"
        return None
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def pwd_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
