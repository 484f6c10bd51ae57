"""Run one compile or check in a fresh child process, confined (worker.isolation), so that a segfault, a hang or an
OOM fails a job and never the worker, and hostile code in it reaches nothing of the worker's. Children are spawned
(fork+exec of a new interpreter), never forked from a process that may hold CUDA state.

A job dir (JOBDIR, the worker's, read-only to children) holds the model, each child's task (KIND-task.json) and
log (KIND.log), and the outputs the worker took (results/). Each child writes only in a fresh JOBDIR/KIND/, a tmpfs
of AOTC_CHILD_MAX_DISK_MB where the worker can mount one, which belongs to the sandbox uid: everything in it is the
child's word. The worker reads from it with O_NOFOLLOW at every step and caps the size (worker.untrusted), and
once the child and everything it started are dead copies out what the caller keeps and drops the tmpfs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.errors import EXCERPT_MAX, MESSAGE_MAX, Failure
from worker import limits as limits_mod
from worker.isolation import Cell, Sandbox
from worker.limits import Limits
from worker.untrusted import open_beneath, read_untrusted, take

__all__ = ["Outcome", "excerpt", "open_beneath", "read_untrusted", "run_child", "take"]

RESULT_MAX_BYTES = 16 * 2**20
EVENTS_MAX_BYTES = 2**20
LAYOUT = ("home", "tmp", "cache", "triton")  # a child's HOME, TMPDIR, Inductor and Triton caches


@dataclass
class Outcome:
    """What a child did: its result, or why it failed (`failure` is set exactly when `ok` is false)."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    failure: Failure | None = None
    cancelled: bool = False
    seconds: float = 0.0
    peaks: dict[str, int | None] = field(default_factory=dict)  # the most memory and processes it held at once
    cpus: list[int] | None = None  # the cores the child said it ran on (worker.cpus), where it said
    paused_s: float = 0.0  # how long it was stopped while another worker's timing pass ran (run's `pause`): not in
    # `seconds`, which is the time it ran


def excerpt(log: Path, limit: int = 4000) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def crash_excerpt(log: Path, limit: int = 4000) -> str:
    """For a crash, faulthandler's report from its start (innermost frames first) rather than the log's tail."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4 * 2**20))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    at = text.rfind("Fatal Python error:")
    return text[at:at + limit] if at >= 0 else text[-limit:]


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# -- running one child ------------------------------------------------------------------------------------------


def run_child(
    task: dict[str, Any],
    jobdir: Path,
    *,
    sandbox: Sandbox,
    timeout_s: float,
    device: str = "cpu",
    limits: Limits | None = None,
    prepare: Callable[[Path], Iterable[tuple[Path, Path]]] | None = None,
    keep: Callable[[], Iterable[str]] = lambda: (),
    hide: Iterable[Path] = (),
    on_stage: Callable[[str], None] = lambda s: None,
    should_cancel: Callable[[], bool] = lambda: False,
    pause: Callable[[], bool] | None = None,
    pause_max_s: float = 300.0,
    waiting: Callable[[], bool] | None = None,
    poll_s: float = 0.25,
) -> Outcome:
    """Run `task` (its "kind": compile, check, warmup) in a fresh JOBDIR/KIND. `prepare(childdir)` may seed the
    fresh dir before the child owns it, and returns (trusted file, path in childdir) pairs to bind read-only.
    `keep()`, called once the child is dead, names the files (relative to childdir; "dir/" for a dir's files) the
    caller reads afterwards: where childdir is a tmpfs (the disk bound) only those are copied out before it goes.
    While `pause()` is true, the child and everything under it are stopped (SIGSTOP) and the time limit stands
    still, for at most `pause_max_s` in all: a compile on a CPU device waits out another worker's timing pass on
    the same cores (AOTC_TIMING_PAUSE). While `waiting()` is true the time limit stands still too, the child
    running: an early check waits for its package (worker.earlycheck), its time limit counted from then on; the
    caller ends the wait (or cancels the child) when its compile ends, which has a limit of its own."""
    kind = task["kind"]
    jobdir.mkdir(parents=True, exist_ok=True)
    os.chmod(jobdir, 0o755)
    childdir = jobdir / kind
    if childdir.exists():
        shutil.rmtree(childdir)  # an earlier child's dir: rmtree never follows its symlinks
    childdir.mkdir(mode=0o755)
    with sandbox.cell(limits, device) as cell:
        cell.scratch(childdir)
        for sub in LAYOUT:
            (childdir / sub).mkdir(mode=0o755)
        ro_files = list(prepare(childdir)) if prepare else []
        cell.sandbox.own(childdir)
        outcome = _run(task, jobdir, childdir, cell, timeout_s, ro_files, hide, on_stage, should_cancel, pause,
                       pause_max_s, waiting, poll_s)
        cell.keep = list(keep())
        return outcome


def _run(task: dict[str, Any], jobdir: Path, childdir: Path, cell: Cell, timeout_s: float,
         ro_files: list[tuple[Path, Path]], hide: Iterable[Path], on_stage: Callable[[str], None],
         should_cancel: Callable[[], bool], pause: Callable[[], bool] | None, pause_max_s: float,
         waiting: Callable[[], bool] | None, poll_s: float) -> Outcome:
    kind, sandbox, limits = task["kind"], cell.sandbox, cell.limits
    task = {**task, "dir": str(childdir)}
    if not sandbox.on:
        task["parent_pid"] = os.getpid()  # the child dies with its parent (see worker.child)
    task_path = jobdir / f"{kind}-task.json"
    tmp = task_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(task))
    os.chmod(tmp, 0o644)
    tmp.rename(task_path)
    log_path = jobdir / f"{kind}.log"
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        os.chmod(log_path, 0o644)
        proc = cell.spawn([sys.executable, "-P", "-m", "worker.child", str(jobdir), kind], jobdir=jobdir,
                          childdir=childdir, ro_files=ro_files, hide=hide, stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, start_new_session=True)
        events = _Events(childdir, on_stage)
        stopped = _Stopped(proc, pause, pause_max_s)
        clock = _Clock(t0, stopped, waiting)
        try:
            while True:
                rc = proc.poll()
                events.relay()
                if rc is not None:
                    break
                now = time.monotonic()
                stopped.update(now)
                if clock.ran(now) > timeout_s:
                    _kill(proc)
                    return Outcome(False, failure=Failure.timeout(kind, timeout_s, excerpt(log_path)),
                                   seconds=clock.ran(now), paused_s=stopped.total(now))
                if should_cancel():  # cheap to call each poll: the caller rate-limits what costs a round trip
                    _kill(proc)
                    return Outcome(False, failure=Failure.cancelled(f"cancelled while running ({kind})", kind),
                                   cancelled=True, seconds=clock.ran(now), paused_s=stopped.total(now))
                time.sleep(poll_s)
        except BaseException:
            _kill(proc)  # the worker is going down (SIGTERM, Ctrl-C): never leave an orphan compile behind
            raise
    now = time.monotonic()
    paused_s = round(stopped.total(now), 3)
    seconds = clock.ran(now)
    peaks = cell.peaks()
    # bwrap reports a child killed by signal N as exit status 128+N; a plain child as -N. A sandbox is gone with
    # its first process (pid namespace), so nothing the child started can still touch its dir.
    assert rc is not None
    died_of = -rc if rc < 0 else rc - 128 if sandbox.on and 128 < rc < 128 + 65 else None
    raw = read_untrusted(childdir, "result.json", RESULT_MAX_BYTES + 1)
    failure: Failure
    if died_of is None and rc == 0 and raw is not None and len(raw) <= RESULT_MAX_BYTES:
        try:
            out = json.loads(raw)
            if out.get("ok") is True and isinstance(out.get("result") or {}, dict):
                return Outcome(True, out.get("result") or {}, seconds=seconds, peaks=peaks,
                               cpus=_cores(out.get("cpus")), paused_s=paused_s)
            failure = _reported(out.get("error"), kind)
        except (ValueError, AttributeError, RecursionError):
            failure = Failure.crashed(kind, f"{kind} child wrote an unreadable result", excerpt(log_path))
    elif died_of is not None:
        why = " (out of memory? the kernel's OOM killer sends SIGKILL)" if died_of == signal.SIGKILL else ""
        message = f"{kind} crashed: the child process died of {_signal_name(died_of)} (signal {died_of}){why}"
        failure = Failure.crashed(kind, message, crash_excerpt(log_path), died_of)
    else:
        failure = Failure.crashed(kind, f"{kind} child exited with status {rc} without a result",
                                  crash_excerpt(log_path), None)
    text = "\n".join((failure.message, failure.excerpt, excerpt(log_path, 64 * 1024)))
    if (hit := limits_mod.breach(limits, died_of, text, cell.counted())) is not None:
        failure = Failure.limit_exceeded(kind, hit.what, hit.setting, failure.excerpt or excerpt(log_path))
    return Outcome(False, failure=failure, seconds=seconds, peaks=peaks, paused_s=paused_s)


def _cores(value: Any) -> list[int] | None:
    """The child's cores as it reported them, where they read as a short list of core numbers (it is untrusted)."""
    if isinstance(value, list) and len(value) <= 4096 and all(type(c) is int and 0 <= c < 1 << 16 for c in value):
        return value
    return None


def _reported(error: Any, kind: str) -> Failure:
    """The failure a child reported, as far as the worker believes it: a type name, a message, a stage and an
    excerpt, each capped; nothing else it put there reaches the job record."""
    e = error if isinstance(error, dict) else {}
    kind_name = str(e.get("type") or "Error")
    return Failure.from_json({
        "type": kind_name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", kind_name) else "Error",
        "message": str(e.get("message") or "")[:MESSAGE_MAX],
        "stage": str(e.get("stage") or kind)[:64],
        "excerpt": str(e.get("excerpt") or "")[:EXCERPT_MAX],
    })


class _Events:
    """Relays the stages a child appends to its events.jsonl, reading only what is new and at most a MiB."""

    def __init__(self, childdir: Path, on_stage: Callable[[str], None]) -> None:
        self.childdir = childdir
        self.on_stage = on_stage
        self.offset = 0
        self.partial = b""

    def relay(self) -> None:
        if self.offset >= EVENTS_MAX_BYTES:
            return
        data = read_untrusted(self.childdir, "events.jsonl", EVENTS_MAX_BYTES - self.offset, self.offset)
        if not data:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")  # a last line without its newline is unfinished
        for line in lines:
            try:
                stage = json.loads(line)["stage"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(stage, str) and len(stage) <= 64:
                self.on_stage(stage)


class _Clock:
    """The seconds a child has run against its time limit: not while it was stopped (`_Stopped`), nor before
    `waiting()` first turned false (an early check waiting for its package: its limit starts when the package
    comes)."""

    def __init__(self, t0: float, stopped: _Stopped, waiting: Callable[[], bool] | None) -> None:
        self.t0, self.stopped, self.waiting = t0, stopped, waiting
        self.base = 0.0  # the time stopped before the wait ended, which `t0` already leaves out

    def ran(self, now: float) -> float:
        if self.waiting is not None and self.waiting():
            self.t0, self.base = now, self.stopped.total(now)
            return 0.0
        self.waiting = None  # the wait ends once: a limit that started does not stop again
        return now - self.t0 - (self.stopped.total(now) - self.base)


class _Stopped:
    """A child stopped while `pause()` says so (see run): SIGSTOP to it and everything under it, SIGCONT after, and
    the time it spent stopped. Past `max_s` in all it is not stopped again: a timing pass that hangs holding the
    lock must not hold a compile with it."""

    def __init__(self, proc: subprocess.Popen[bytes], pause: Callable[[], bool] | None, max_s: float) -> None:
        self.proc, self.pause, self.max_s = proc, pause, max_s
        self.since: float | None = None
        self.done = 0.0

    def total(self, now: float) -> float:
        return self.done + (now - self.since if self.since is not None else 0.0)

    def update(self, now: float) -> None:
        if self.pause is None:
            return
        want = self.total(now) < self.max_s and self.pause()
        if want and self.since is None:
            _signal_tree(self.proc.pid, signal.SIGSTOP)
            self.since = now
        elif want:
            # Again at every poll while stopped: SIGSTOP takes effect only when its target next leaves the kernel, so
            # a process can still fork after the sweep that stopped it (a sandbox's init starting the child was seen
            # left running, 'S', for 30 s beside its stopped parent). Stopping a stopped process changes nothing.
            _signal_tree(self.proc.pid, signal.SIGSTOP)
        elif not want and self.since is not None:
            _signal_tree(self.proc.pid, signal.SIGCONT)
            self.done += now - self.since
            self.since = None


def _signal_tree(pid: int, sig: int) -> None:
    """`sig` to `pid` and its descendants. For SIGSTOP, again until no new descendant shows up: one that forked just
    before its parent stopped is stopped too (a stopped process forks no more)."""
    seen: set[int] = set()
    for _ in range(4):
        new = [p for p in [pid, *_descendants(pid)] if p not in seen]
        if not new:
            return
        for p in new:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        seen.update(new)
        if sig != signal.SIGSTOP:
            return


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child and everything under it: its process group, and the sandbox's own processes (bwrap puts
    them in a session and a pid namespace of their own; the namespace dies with its first process)."""
    victims = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    deadline = time.monotonic() + 2.0
    while victims and time.monotonic() < deadline:  # they are not ours to wait for: watch them go
        victims = [p for p in victims if _alive(p)]
        if victims:
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
