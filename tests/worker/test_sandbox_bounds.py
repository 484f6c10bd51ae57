"""The sandbox as a whole, against a hostile child: real bwrap, real cgroups, real tmpfs, real seccomp.

Each test runs worker.sandbox.run_child as the worker does, in a sandbox that worker.isolation.setup built, with
tests/worker/hostile on the child's PYTHONPATH: its sitecustomize runs the plan the test wrote into the job dir
(hostile.py) in place of the child, before any of worker.child, and prints what it reached to the child's log. So
what is asserted is what code in the sandbox could do, read from outside: several processes together stay within
the memory bound, several files together within the disk bound, a fork bomb stops at the sandbox's own process
bound while a second sandbox still starts its processes, no user or mount namespace can be made, and the host's
/home, NICs, load and memory are not in sight.

Needs root (cgroups, the tmpfs, privileged bwrap), as on this project's machines and CI; skipped, with the reason,
where the sandbox has no cgroup or tmpfs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from worker.isolation import Sandbox, setup
from worker.limits import MIB, Limits
from worker.sandbox import Outcome, run_child
from worker.settings import WorkerSettings

HOSTILE = Path(__file__).resolve().parent / "hostile"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("needs root and bubblewrap: cgroups, a tmpfs and privileged bwrap")
    base = tmp_path_factory.mktemp("bounds")
    sb = setup(WorkerSettings(work_dir=base / "work", data_dir=base / "data"), "cpu")
    bounds = sb.describe().get("sandbox_bounds", {})
    if "cgroup" not in bounds.get("memory", "") or "tmpfs" not in bounds.get("disk", ""):
        pytest.skip(f"this machine gives the sandbox no cgroup or no tmpfs: {bounds}")
    return replace(sb, pythonpath=(*sb.pythonpath, str(HOSTILE)))


def _run(sandbox: Sandbox, jobdir: Path, plan: str, limits: Limits, params: dict[str, Any] | None = None,
         timeout_s: float = 120) -> tuple[Outcome, list[dict[str, Any]]]:
    """Run `plan` as hostile code in a sandboxed child; its outcome and the HOSTILE lines it printed."""
    jobdir.mkdir(parents=True)
    (jobdir / "hostile.py").write_text(f"PARAMS = {json.dumps(params or {})}\n{plan}")
    os.chmod(jobdir / "hostile.py", 0o644)
    outcome = run_child({"kind": "probe", "device": "cpu"}, jobdir, sandbox=sandbox, timeout_s=timeout_s,
                        limits=limits)
    return outcome, _said(jobdir / "probe.log")


def _said(log: Path) -> list[dict[str, Any]]:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [json.loads(ln.split("HOSTILE ", 1)[1]) for ln in lines if ln.startswith("HOSTILE ")]


MEMORY = """
import json, os, time
pids = []
for i in range(PARAMS["procs"]):
    pid = os.fork()
    if pid == 0:
        try:
            b = bytearray(PARAMS["mb"] << 20)
            for j in range(0, len(b), 4096):
                b[j] = 1
        except MemoryError:
            print("HOSTILE " + json.dumps({"memory_error": i}), flush=True)
            os._exit(1)
        time.sleep(3)  # all hold their memory at once; only the survivors say so
        print("HOSTILE " + json.dumps({"holding_mb": PARAMS["mb"]}), flush=True)
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
"""


def test_processes_together_stay_within_the_sandboxs_memory_bound(sandbox, tmp_path):
    bound = 256 * MIB
    outcome, said = _run(sandbox, tmp_path / "job", MEMORY, Limits(memory_bytes=bound), {"procs": 3, "mb": 160})
    held = sum(s.get("holding_mb", 0) for s in said)
    print(f"\nmemory: 3 processes of 160 MiB under a {bound // MIB} MiB bound held {held} MiB together")
    assert 0 < held <= bound // MIB, said  # some got their 160 MiB, never all three together
    print(f"the cgroup's peak: {outcome.peaks}")
    assert outcome.peaks["memory_bytes"] is not None and outcome.peaks["memory_bytes"] <= bound
    assert outcome.failure is not None and outcome.failure.type == "LimitExceeded", outcome
    assert outcome.failure.extra["limit"] == "AOTC_COMPILE_MAX_MEMORY_GB", outcome.failure
    assert outcome.failure.message == "the probe used more than 0.25 GiB of memory; the limit is " \
                                      "AOTC_COMPILE_MAX_MEMORY_GB"


DISK = """
import json, os
written, error = 0, None
try:
    for i in range(PARAMS["files"]):
        with open(os.path.join(os.environ["TMPDIR"], f"fill-{i}"), "wb") as f:
            for _ in range(PARAMS["mb"]):
                f.write(b"x" * (1 << 20))
                f.flush()
                written += 1 << 20
except OSError as e:
    error = str(e)
print("HOSTILE " + json.dumps({"written": written, "error": error}), flush=True)
"""


def test_files_together_stay_within_the_sandboxs_disk_bound(sandbox, tmp_path):
    bound = 64 * MIB
    outcome, said = _run(sandbox, tmp_path / "job", DISK, Limits(file_bytes=bound, disk_bytes=bound),
                         {"files": 6, "mb": 24})
    [r] = said
    print(f"\ndisk: 6 files of 24 MiB (each under the {bound // MIB} MiB file bound) wrote {r['written'] // MIB} MiB "
          f"in all: {r['error']}")
    assert r["written"] <= bound and "No space left on device" in str(r["error"]), r
    assert outcome.failure is not None and outcome.failure.extra.get("limit") == "AOTC_CHILD_MAX_DISK_MB", outcome
    assert outcome.failure.message == "the probe wrote more than 64 MiB in its dir; the limit is " \
                                      "AOTC_CHILD_MAX_DISK_MB"
    assert not (tmp_path / "job" / "probe" / "tmp").exists()  # the tmpfs went with the child


def test_a_child_that_fills_its_own_tmpfs_is_the_jobs_fault_not_a_full_host_disk(sandbox, tmp_path):
    """What the worker makes of it (worker.health judges every child that got through its handshake): the child's
    output says "No space left on device", as a full host disk would, but the host's disks have room: the job went
    past its own bound, final, not refunded as DiskFull."""
    from worker.disk import DiskWatch
    from worker.health import Health

    outcome, said = _run(sandbox, tmp_path / "job", DISK, Limits(file_bytes=32 * MIB, disk_bytes=32 * MIB),
                         {"files": 3, "mb": 24})
    assert "No space left on device" in str(said[0]["error"])
    health = Health(3, DiskWatch(lambda: [tmp_path], 1))
    judged = health.judge("probe", outcome, True, tmp_path / "job" / "probe.log", tmp_path / "job" / "probe")
    assert judged.failure is not None and judged.failure.type == "LimitExceeded", judged
    assert judged.failure.extra.get("limit") == "AOTC_CHILD_MAX_DISK_MB"
    assert health.describe()["healthy"] is True


FORK_BOMB = """
import json, os, time
n, error = 0, None
try:
    while n < 10000:
        if os.fork() == 0:
            time.sleep(120)
            os._exit(0)
        n += 1
except OSError as e:
    error = str(e)
print("HOSTILE " + json.dumps({"forked": n, "error": error}), flush=True)
deadline = time.time() + 120
while not os.path.exists(os.path.join(JOBDIR, "release")) and time.time() < deadline:
    time.sleep(0.1)  # hold them all while the second sandbox starts
"""

START = """
import json, os, time
n, error = 0, None
try:
    for _ in range(PARAMS["procs"]):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        n += 1
except OSError as e:
    error = str(e)
print("HOSTILE " + json.dumps({"started": n, "error": error}), flush=True)
"""


def _fork_bomb_beside_a_second_sandbox(sandbox: Sandbox, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any],
                                                                                Outcome]:
    """A fork bomb in one sandbox, holding all it got while a second sandbox starts 20 processes: what each said,
    and the bomb's outcome."""
    limits = Limits(procs=40)
    bomb_dir = tmp_path / "bomb"
    bomb: dict[str, Outcome] = {}
    t = threading.Thread(target=lambda: bomb.update(out=_run(sandbox, bomb_dir, FORK_BOMB, limits)[0]))
    t.start()
    try:
        deadline = time.monotonic() + 120
        while not (said := _said(bomb_dir / "probe.log")) and t.is_alive():
            assert time.monotonic() < deadline, "the fork bomb never said how far it got"
            time.sleep(0.2)
        [held] = said
        _, [second] = _run(sandbox, tmp_path / "second", START, limits, {"procs": 20})
    finally:
        (bomb_dir / "release").touch()
        t.join(180)
    print(f"\nprocesses: a fork bomb under a bound of {limits.procs} forked {held['forked']} ({held['error']}); "
          f"a second sandbox meanwhile started {second['started']} of 20 ({second['error']})")
    assert held["forked"] < limits.procs and "Resource temporarily unavailable" in str(held["error"]), held
    return held, second, bomb["out"]


def test_a_fork_bomb_stops_at_its_sandboxs_bound_and_the_next_sandbox_still_starts(sandbox, tmp_path):
    _, second, bomb = _fork_bomb_beside_a_second_sandbox(sandbox, tmp_path)
    assert second == {"started": 20, "error": None}, second
    assert bomb.failure is not None and bomb.failure.extra["limit"] == "AOTC_CHILD_MAX_PROCS", bomb


def test_without_cgroups_each_child_has_a_uid_of_its_own_so_a_fork_bomb_leaves_the_next_sandbox_its_processes(
        sandbox, tmp_path):
    base = tmp_path / "worker"
    sb = setup(WorkerSettings(work_dir=base / "work", data_dir=base / "data", sandbox_bounds="uid",
                              sandbox_uid_lock_dir=base / "uids"), "cpu")
    assert "uid of its own per sandbox" in sb.describe()["sandbox_bounds"]["processes"], sb.describe()
    _, second, bomb = _fork_bomb_beside_a_second_sandbox(replace(sb, pythonpath=sandbox.pythonpath), tmp_path)
    assert second == {"started": 20, "error": None}, second
    assert bomb.failure is not None


NAMESPACES = """
import ctypes, errno, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
SYS_CLONE, SYS_CLONE3 = {"x86_64": (56, 435), "aarch64": (220, 435)}[os.uname().machine]
out = {}

def result(rc):
    return "ok" if rc == 0 else errno.errorcode[ctypes.get_errno()]

pid = libc.syscall(SYS_CLONE, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
out["clone(CLONE_NEWUSER)"] = "ok" if pid > 0 else errno.errorcode[ctypes.get_errno()]
if pid > 0:
    os.waitpid(pid, 0)
out["clone3"] = result(libc.syscall(SYS_CLONE3, 0, 0))
out["mount"] = result(libc.mount(b"none", os.environ["TMPDIR"].encode(), b"tmpfs", 0, None))
out["subprocess"] = subprocess.run(["true"]).returncode  # glibc falls back from clone3 to clone
sleeper = subprocess.Popen(["sleep", "30"])
out["ptrace(ATTACH, own child)"] = result(libc.ptrace(16, sleeper.pid, 0, 0))
sleeper.kill()
out["unshare(CLONE_NEWUSER)"] = result(libc.unshare(CLONE_NEWUSER))
if out["unshare(CLONE_NEWUSER)"] == "ok":
    out["then unshare(CLONE_NEWNS)"] = result(libc.unshare(CLONE_NEWNS))
    out["then mount"] = result(libc.mount(b"none", os.environ["TMPDIR"].encode(), b"tmpfs", 0, None))
print("HOSTILE " + json.dumps(out), flush=True)
"""


def test_no_namespace_and_no_mount_can_be_made_in_the_sandbox(sandbox, tmp_path):
    _, [out] = _run(sandbox, tmp_path / "job", NAMESPACES, Limits(procs=64))
    print(f"\nnamespaces: {out}")
    assert out == {"clone(CLONE_NEWUSER)": "EPERM", "clone3": "ENOSYS", "mount": "EPERM",
                   "ptrace(ATTACH, own child)": "EPERM", "subprocess": 0, "unshare(CLONE_NEWUSER)": "EPERM"}, out


SIGHT = """
import json, os

def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return type(e).__name__

def text(path):
    try:
        return open(path).read()
    except OSError as e:
        return type(e).__name__

print("HOSTILE " + json.dumps({
    "home": listing("/home"), "marker": os.path.exists(PARAMS["marker"]), "net": listing("/sys/class/net"),
    "readable": text(PARAMS["readable"]), "loadavg": text("/proc/loadavg"), "meminfo": text("/proc/meminfo"),
    "etc": listing("/etc"), "passwd": text("/etc/passwd"), "root": listing("/")}), flush=True)
"""


def test_the_hosts_homes_nics_load_and_memory_are_out_of_sight(sandbox, tmp_path):
    token = secrets.token_hex(6)
    marker = Path("/home") / f"aotc-test-{token}"
    readable = Path("/var/tmp") / f"aotc-test-{token}.txt"  # world-readable, outside every hidden path
    marker.mkdir(mode=0o755)
    readable.write_text(f"readable-{token}")
    os.chmod(readable, 0o644)
    host_threads = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    host_nics = os.listdir("/sys/class/net")
    try:
        _, [seen] = _run(sandbox, tmp_path / "job", SIGHT, Limits(memory_bytes=512 * MIB),
                         {"marker": str(marker), "readable": str(readable)})
    finally:
        marker.rmdir()
        readable.unlink()
    print(f"\nin sight: / {seen['root']}, /etc {seen['etc']}, /home {seen['home']}, /sys/class/net {seen['net']}, "
          f"/proc/loadavg {seen['loadavg']!r}, /proc/meminfo {seen['meminfo'].splitlines()[:1]}")
    assert host_threads > 10 and len(host_nics) > 1  # what the host has, and the child must not see
    assert seen["home"] == "FileNotFoundError" and seen["marker"] is False, seen
    assert seen["net"] == "FileNotFoundError", seen
    assert seen["readable"] == "FileNotFoundError", seen
    assert seen["loadavg"] == "0.00 0.00 0.00 1/1 1\n", seen
    assert seen["meminfo"].splitlines()[0].split() == ["MemTotal:", str(512 * 1024), "kB"], seen
    assert "shadow" not in seen["etc"] and "passwd" in seen["etc"], seen
    assert [ln.split(":")[0] for ln in seen["passwd"].splitlines()] == ["root", "nobody"], seen


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
