"""Entry point of the child process that runs one compile or one artifact check: `python -m worker.child DIR`.

DIR/task.json says what to do. The child appends stage events to DIR/events.jsonl and writes DIR/result.json:
{"ok": true, "result": ...} or {"ok": false, "error": ...}. A crash leaves no result; the parent reads that
from the exit status. Compiler output goes to the parent's log file through stdout/stderr.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def main(workdir: str) -> int:
    d = Path(workdir)
    task: dict[str, Any] = json.loads((d / "task.json").read_text())
    events = open(d / "events.jsonl", "a", buffering=1)

    def on_stage(stage: str) -> None:
        events.write(json.dumps({"stage": stage, "ts": time.time()}) + "\n")

    from compiler.errors import CompileError

    try:
        if task["kind"] == "compile":
            from compiler.options import CompileOptions
            from compiler.pipeline import compile_model

            result = compile_model(
                task["model_path"], task["spec"], task["program_inputs"], CompileOptions(**task["options"]),
                task["device"], task["out_path"], on_stage,
            )
        elif task["kind"] == "check":
            from compiler.check import check_artifact

            on_stage("check")
            precision = (task.get("options") or {}).get("precision", "keep")
            result = check_artifact(task["model_path"], task["package_path"], task["spec"], task["device"],
                                    precision=precision)
        else:
            raise ValueError(f"unknown task kind {task['kind']!r}")
        out: dict[str, Any] = {"ok": True, "result": result}
    except CompileError as e:
        out = {"ok": False, "error": e.to_json()}
    except Exception as e:
        out = {"ok": False, "error": {"type": type(e).__name__, "message": str(e), "stage": task["kind"],
                                      "excerpt": traceback.format_exc()[-4000:], "retryable": False}}
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = d / "result.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(d / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
