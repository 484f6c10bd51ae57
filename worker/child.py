"""Entry point of the child process that runs one compile, one artifact check, the warm-up compile or the health
probe: `python -m worker.child JOBDIR KIND`, inside the sandbox (worker.isolation), with the limits already set.

The handshake: once the child has imported torch and what its kind runs, and touched its device, it appends the
stage READY to its events, before it reads anything of the model. The worker (worker.health) relays it live; a child
that fails without it failed because of the worker's environment (a broken torch, CUDA, the sandbox, the
interpreter), never because of the model, and the job goes back without spending an attempt.

JOBDIR/KIND-task.json (the worker's, read-only here) says what to do and names the one dir this child may write
(task["dir"]). An early check's task (worker.earlycheck) names no package but a word, task["go_path"], which the
worker writes into JOBDIR when the compile has made the package: the child prepares what needs none, then waits
for it. The child appends stage events to DIR/events.jsonl and writes DIR/result.json: {"ok": true,
"result": ...} or {"ok": false, "error": ...}. A crash leaves no result; the parent reads that from the exit status.
Compiler output goes to the parent's log file through stdout/stderr. The child has no Redis URL and no network:
whatever it shares with other compiles (max-autotune timings), the worker reads from DIR and checks (worker.tuning).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from worker.cpus import pin, repin

READY = "child-ready"  # the handshake's stage name (worker.health takes it out of the job's stages)
KINDS = ("compile", "check", "time", "warmup", "probe")
TOOLCHAIN = {"compile": ("compiler.pipeline", "compiler.compat.caches"), "check": ("compiler.check",),
             "time": ("compiler.timing",),
             "warmup": ("compiler.pipeline", "compiler.archive.inspect")}


def _die_with_parent(parent: int | None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (kill -9 included), so a lost worker leaves no
    compile running on. In a sandbox the parent is bwrap's, which itself dies with the worker (--die-with-parent);
    unconfined, the parent is the worker, and `parent` lets us check it did not die before the request took effect."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:
        os._exit(1)


class Tiny:
    """The warm-up's built-in model: a Linear and a ReLU, enough for AOTInductor to build its headers."""

    @staticmethod
    def export(path: Path) -> None:
        import torch

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return torch.relu(self.lin(x))

        torch.manual_seed(0)
        torch.export.save(torch.export.export(Model().eval(), (torch.randn(2, 8),)), str(path))


def _warm_up(task: dict[str, Any], d: Path) -> dict[str, Any]:
    """Compile the built-in model with the default options, so AOTInductor builds its precompiled headers in this
    child's TMPDIR, where the worker takes them from (worker.headers). A header is only used by compiles of the
    same flags, so it is built for the worker's own target (the one a plain 'cpu' request gets)."""
    from compiler.archive.inspect import inspect_archive
    from compiler.options import CompileOptions
    from compiler.pipeline import compile_model
    from compiler.shapes import canonical_spec

    model = d / "warmup.pt2"
    Tiny.export(model)
    inputs = inspect_archive(str(model))["inputs"]
    spec = canonical_spec(inputs, {inputs[0]["name"]: [2, 8]})
    t0 = time.perf_counter()
    compile_model(str(model), spec, inputs, CompileOptions(), task["device"], str(d / "warmup-package.pt2"),
                  target=task.get("target"))
    return {"seconds": round(time.perf_counter() - t0, 3)}


GO_POLL_S = 0.02


def _prepare_early(task: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """An early check (worker.earlycheck): the part before the package (compiler.check.prepare_check, the
    adversarial verdicts included), then a wait for the worker's word, task["go_path"] in the job's dir (the
    worker's, read-only here), which names the package and how to run: {"package_path", "untimed", "cpus"}. The
    worker kills this child instead where the compile fails. Returns (the prepared part, the word)."""
    from compiler.check import prepare_check

    t0 = time.perf_counter()
    prepared = prepare_check(task["model_path"], task["spec"], task["device"], oracle=True)
    ready = time.perf_counter()
    go = Path(task["go_path"])
    while not go.exists():
        time.sleep(GO_POLL_S)
    word = json.loads(go.read_text())
    word["early"] = {"prepared_s": round(ready - t0, 3), "waited_s": round(time.perf_counter() - ready, 3)}
    return prepared, word


def _import_toolchain(kind: str, device: str) -> None:
    """What must work before any of the job is touched: torch, the compiler modules this kind runs, the device."""
    import torch

    for module in TOOLCHAIN.get(kind, ()):
        importlib.import_module(module)
    if device.startswith("cuda"):
        torch.empty(1, device=device)  # a CUDA context: a driver or device that does not work fails here


def main(jobdir: str, kind: str) -> int:
    task: dict[str, Any] = json.loads((Path(jobdir) / f"{kind}-task.json").read_text())
    _die_with_parent(task.get("parent_pid"))
    # Before torch starts a thread: what this child starts inherits the cores (worker.cpus, AOTC_TIMING_CPUS).
    everywhere = sorted(os.sched_getaffinity(0))
    cpus = pin(task.get("cpus"))
    faulthandler.enable()  # a segfault leaves the Python stack in the log, hence in the job's error excerpt
    d = Path(task["dir"])
    events = open(d / "events.jsonl", "a", buffering=1)

    def on_stage(stage: str) -> None:
        events.write(json.dumps({"stage": stage, "ts": time.time()}) + "\n")

    from compiler.errors import Failure

    try:
        if kind not in KINDS:
            raise ValueError(f"unknown task kind {kind!r}")
        _import_toolchain(kind, str(task.get("device") or "cpu"))
        on_stage(READY)
        if kind == "compile":
            from compiler.compat.caches import inductor_cache_settings, without_precompiled_headers
            from compiler.options import CompileOptions
            from compiler.pipeline import compile_model

            options = CompileOptions(**task["options"])
            # No trusted header set bound yet (worker.headers): parse the headers rather than build a private set.
            trusted = task.get("precompiled_headers", True)
            with contextlib.nullcontext() if trusted else without_precompiled_headers():
                result = compile_model(
                    task["model_path"], task["spec"], task["program_inputs"], options, task["device"],
                    task["out_path"], on_stage, target=task.get("target"),
                    isa_scan_timeout_s=float(task.get("isa_scan_timeout_s", 120)),
                )
            result["caches"] = {**inductor_cache_settings(), "precompiled_headers": "trusted" if trusted else "none"}
        elif kind == "check":
            from compiler.check import check_artifact, untimed

            prepared = _prepare_early(task) if task.get("go_path") else None
            if prepared is not None:  # an early check: its package has come
                task = {**task, **prepared[1]}
                cpus = repin(task.get("cpus"), everywhere)
            on_stage("check")
            asked = task.get("options") or {}
            # `untimed`: a timing pass of its own follows (compiler/timing.py), so the check takes no figures.
            if asked.get("mode") == "training":  # a train-step package: checked over optimizer steps
                from compiler.traincheck import check_training

                with untimed() if task.get("untimed") else contextlib.nullcontext():
                    result = check_training(task["model_path"], task["package_path"], task["spec"], task["device"],
                                            loss_output=int(asked.get("loss_output", 0)),
                                            precision=str(asked.get("precision", "keep")))
            else:
                with untimed() if task.get("untimed") else contextlib.nullcontext():
                    result = check_artifact(task["model_path"], task["package_path"], task["spec"], task["device"],
                                            precision=asked.get("precision", "keep"),
                                            allow_nonfinite=bool(asked.get("allow_nonfinite", False)),
                                            prepared=prepared[0] if prepared is not None else None)
                if prepared is not None:
                    result["early"] = {**task["early"], **result.get("early", {})}
        elif kind == "time":  # the timing pass, under the device lock (compiler/timing.py)
            from compiler.timing import time_artifact

            # No on_stage here: the worker set "timing" before it waited for the lock.
            asked = task.get("options") or {}
            result = time_artifact(task["model_path"], task["package_path"], task["spec"], task["device"],
                                   precision=asked.get("precision", "keep"),
                                   allow_nonfinite=bool(asked.get("allow_nonfinite", False)),
                                   windows=int(task.get("windows", 1)))
        elif kind == "warmup":
            result = _warm_up(task, d)
        else:  # probe: the handshake is all it does
            import torch

            result = {"torch": torch.__version__}
        out: dict[str, Any] = {"ok": True, "result": result, "cpus": cpus}
    except Exception as e:
        out = {"ok": False, "error": Failure.from_exception(e, kind, traceback.format_exc()[-4000:]).to_json()}
    sys.stdout.flush()
    sys.stderr.flush()
    tmp = d / "result.json.tmp"
    tmp.write_text(json.dumps(out))
    tmp.rename(d / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
