"""Run one compile or check in a fresh child process, so that a segfault, a hang or an OOM fails a job and
never the worker. Children are spawned (fork+exec of a new interpreter), never forked from a process that may
hold CUDA state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.errors import Failure

_ROOT = str(Path(__file__).resolve().parent.parent)  # so `python -m worker.child` imports this checkout


@dataclass
class Outcome:
    """What a child did: its result, or why it failed (`failure` is set exactly when `ok` is false)."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    failure: Failure | None = None
    cancelled: bool = False
    seconds: float = 0.0


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


def run_child(
    task: dict[str, Any],
    workdir: Path,
    *,
    timeout_s: float,
    on_stage: Callable[[str], None] = lambda s: None,
    should_cancel: Callable[[], bool] = lambda: False,
    env: dict[str, str] | None = None,
    poll_s: float = 0.25,
) -> Outcome:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("result.json", "events.jsonl"):
        (workdir / name).unlink(missing_ok=True)
    (workdir / "task.json").write_text(json.dumps(task))
    log_path = workdir / f"{task['kind']}.log"
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, child_env.get("PYTHONPATH", "")) if p)
    child_env["AOTC_PARENT_PID"] = str(os.getpid())  # the child dies with its parent (see worker.child)
    kind = task["kind"]
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.child", str(workdir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env, start_new_session=True,
        )
        seen = 0
        try:
            while True:
                rc = proc.poll()
                seen = _relay_events(workdir / "events.jsonl", seen, on_stage)
                if rc is not None:
                    break
                now = time.monotonic()
                if now - t0 > timeout_s:
                    _kill(proc)
                    return Outcome(False, failure=Failure.timeout(kind, timeout_s, excerpt(log_path)),
                                   seconds=now - t0)
                if should_cancel():  # cheap to call each poll: the caller rate-limits what costs a round trip
                    _kill(proc)
                    return Outcome(False, failure=Failure.cancelled(f"cancelled while running ({kind})", kind),
                                   cancelled=True, seconds=now - t0)
                time.sleep(poll_s)
        except BaseException:
            _kill(proc)  # the worker is going down (SIGTERM, Ctrl-C): never leave an orphan compile behind
            raise
    seconds = time.monotonic() - t0
    result_path = workdir / "result.json"
    if rc == 0 and result_path.exists():
        out = json.loads(result_path.read_text())
        if out["ok"]:
            return Outcome(True, out.get("result") or {}, seconds=seconds)
        return Outcome(False, failure=Failure.from_json(out.get("error") or {}), seconds=seconds)
    died_of = -rc if rc is not None and rc < 0 else None
    if died_of is not None:
        why = " (out of memory? the kernel's OOM killer sends SIGKILL)" if died_of == signal.SIGKILL else ""
        message = f"{kind} crashed: the child process died of {_signal_name(died_of)} (signal {died_of}){why}"
    else:
        message = f"{kind} child exited with status {rc} without a result"
    return Outcome(False, failure=Failure.crashed(kind, message, crash_excerpt(log_path), died_of), seconds=seconds)


def _relay_events(path: Path, seen: int, on_stage: Callable[[str], None]) -> int:
    try:
        with open(path) as f:
            lines = f.read().split("\n")[:-1]  # a last line without its newline is still being written
    except FileNotFoundError:
        return seen
    for line in lines[seen:]:
        try:
            on_stage(json.loads(line)["stage"])
        except (ValueError, KeyError):
            continue
    return len(lines)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
