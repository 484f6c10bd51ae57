"""Entry point of the child process that runs one compile or one artifact check: `python -m worker.child DIR`.

DIR/task.json says what to do. The child appends stage events to DIR/events.jsonl and writes DIR/result.json:
{"ok": true, "result": ...} or {"ok": false, "error": ...}. A crash leaves no result; the parent reads that
from the exit status. Compiler output goes to the parent's log file through stdout/stderr.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the worker dies (kill -9 included), so a lost worker leaves no
    compile running on; then check the worker did not die before the request took effect."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = os.environ.get("AOTC_PARENT_PID")
    if parent and os.getppid() != int(parent):
        os._exit(1)


def main(workdir: str) -> int:
    _die_with_parent()
    faulthandler.enable()  # a segfault leaves the Python stack in the log, hence in the job's error excerpt
    d = Path(workdir)
    task: dict[str, Any] = json.loads((d / "task.json").read_text())
    events = open(d / "events.jsonl", "a", buffering=1)

    def on_stage(stage: str) -> None:
        events.write(json.dumps({"stage": stage, "ts": time.time()}) + "\n")

    from compiler.errors import Failure

    try:
        if task["kind"] == "compile":
            from compiler.compat.caches import inductor_cache_settings
            from compiler.options import CompileOptions
            from compiler.pipeline import compile_model

            options = CompileOptions(**task["options"])
            share = None
            if task.get("share_gemm_timings") and options.mode == "max-autotune":
                from worker.tuning import GemmTimingShare

                share = GemmTimingShare(task["share_gemm_timings"]["redis_url"], task["share_gemm_timings"]["target"])
                share.pull()
            result = compile_model(
                task["model_path"], task["spec"], task["program_inputs"], options, task["device"], task["out_path"],
                on_stage,
            )
            if share is not None:
                share.push()
            result["caches"] = {**inductor_cache_settings(), "gemm_timings": share.stats if share else None}
        elif task["kind"] == "check":
            from compiler.check import check_artifact

            on_stage("check")
            precision = (task.get("options") or {}).get("precision", "keep")
            result = check_artifact(task["model_path"], task["package_path"], task["spec"], task["device"],
                                    precision=precision)
        else:
            raise ValueError(f"unknown task kind {task['kind']!r}")
        out: dict[str, Any] = {"ok": True, "result": result}
    except Exception as e:
        out = {"ok": False, "error": Failure.from_exception(e, task["kind"], traceback.format_exc()[-4000:]).to_json()}
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = d / "result.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(d / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
