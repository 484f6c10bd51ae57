"""Faults and hostile code for the worker tests, armed by a model's input name, inside the compile and check
children for real.

The upload checks refuse custom operators, so a test model cannot carry code of its own. Instead the tests put
this folder on the worker's PYTHONPATH: its `sitecustomize` calls `arm()` in every Python process started with
it. In a compile or check child (`python -m worker.child JOBDIR KIND`: its command line says so) `arm` reads the
child's task and acts on the names of the model's inputs, which the models below choose:

- `segv` (compile): Inductor's graph lowering dereferences a NULL pointer through ctypes (a real SIGSEGV in
  native code) once the compile reaches Inductor; the load, capture and lowering stages before it run fine;
- `hang` (compile): Inductor's graph lowering never returns;
- `probe` (compile and check): runs what an attacker's code would, as the child starts (the sandbox and the limits
  are in place before any of it runs): connects to each port on 127.0.0.1, writes each "w:PATH", reads each
  "r:PATH", tries to change the precompiled headers that later compiles would include, and records its uid,
  no_new_privs, environment and network interfaces. The plan (ports, paths) is
  probe-plan.json three levels above the job dir (beside the test cluster's data dir: JOBDIR is DATA/work/JOB);
  the report goes to the child's log as `AOTC-PROBE KIND {json}`;
- `early` (check): an early check (worker/earlycheck.py: its task names the word it waits for) fails in its part
  before the package, as a device short of memory for a second copy of the weights would; a check child started
  the usual way runs as ever;
- `poison` (compile): writes timings of shapes Inductor never writes into the compile's max-autotune timings file
  (POISON), which the worker must not publish.

Other processes (the worker, Inductor's compile workers) are left alone, and import no torch for this.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

# (op, inputs, precision, choice) and value: none of the shape Inductor writes.
POISON: list[tuple[tuple[str, str, str, str], Any]] = [
    (("addmm", "[('cpu', 'torch.float32', 16, 64)]", "highest", "addmm; rm -rf /"), 0.001),
    (("../../etc", "[('cpu', 'torch.float32', 16, 64, 64, 1, 0)]", "highest", "mm-alpha=1"), 0.001),
    (("mm", "__import__('os').system('id')", "highest", "mm-alpha=1"), 0.001),
    (("mm", "[('cpu', 'torch.float32', 16, 64, 64, 1, 0)]", "highest", "mm-nan"), float("nan")),
    (("mm", "[('cpu', 'torch.float32', 16, 64, 64, 1, 0)]", "highest", "mm-negative"), -1.0),
    (("mm", "[('cpu', 'torch.float32', 16, 64, 64, 1, 0)]", "highest", "mm-text"), "fast"),
    (("mm", "[('cpu', 'torch.float32', 16, 64, 64, 1, 0)]", "highest", "mm-" + "x" * 300), 0.001),
]


def _child() -> tuple[Path, str] | None:
    """(JOBDIR, KIND) if this process is a worker's compile or check child."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None
    if "worker.child" not in argv:
        return None
    at = argv.index("worker.child")
    return (Path(argv[at + 1]), argv[at + 2]) if len(argv) > at + 2 else None


def arm() -> None:
    child = _child()
    if child is None:
        return
    jobdir, kind = child
    try:
        task = json.loads((jobdir / f"{kind}-task.json").read_text())
    except (OSError, ValueError):
        return
    names = {i.get("name") for i in task.get("spec") or []}
    if "probe" in names:
        print(f"AOTC-PROBE {kind} " + json.dumps(probe(kind, jobdir)), file=sys.stderr, flush=True)
    if kind == "compile" and "poison" in names:
        poison()
    if kind == "compile" and names & {"segv", "hang"}:
        _break_lowering("segv" if "segv" in names else "hang")
    if kind == "check" and "early" in names and task.get("go_path"):
        _fail_before_the_package()


def _fail_before_the_package() -> None:
    import compiler.check

    def short_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory (faultops: the early check's part before the package)")

    compiler.check.prepare_check = short_of_memory  # type: ignore[assignment]


def _break_lowering(how: str) -> None:
    from torch._inductor.graph import GraphLowering

    run = GraphLowering.run

    def broken_run(self: Any, *args: Any) -> Any:
        if how == "segv":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        while how == "hang":
            time.sleep(1.0)
        return run(self, *args)

    GraphLowering.run = broken_run  # type: ignore[method-assign]


def probe(where: str, jobdir: Path) -> dict[str, Any]:
    """Try what an attacker's code would, and say what happened."""
    try:
        plan = json.loads((jobdir.parents[2] / "probe-plan.json").read_text())
    except (OSError, ValueError, IndexError) as e:
        plan = {"ports": [], "paths": [], "error": str(e)}
    status: dict[str, str] = {}
    try:
        with open("/proc/self/status") as f:
            status = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
    except OSError:
        pass
    out: dict[str, Any] = {
        "where": where, "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
        "no_new_privs": status.get("NoNewPrivs", "").strip(), "cap_eff": status.get("CapEff", "").strip(),
        "env": sorted(os.environ), "cwd": os.getcwd(), "plan_error": plan.get("error"),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    }
    try:
        with open("/proc/net/dev") as f:
            out["interfaces"] = sorted(ln.split(":")[0].strip() for ln in f.readlines()[2:])
    except OSError as e:
        out["interfaces"] = str(e)
    tried: dict[str, str] = {}
    for port in plan["ports"]:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"SET aotc:probe:pwned 1\r\n")
                tried[f"tcp:{port}"] = "connected"
        except OSError as e:
            tried[f"tcp:{port}"] = f"{type(e).__name__}: {e}"
    for spec in plan["paths"]:
        kind, path = spec.split(":", 1)
        try:
            if kind == "w":
                with open(f"{path}-{where}", "w") as f:
                    f.write("written by the probe\n")
                tried[spec] = "written"
            else:
                with open(path, "rb") as f:
                    tried[spec] = "read: " + f.read(4096).decode("utf-8", "replace")
        except OSError as e:
            tried[spec] = f"{type(e).__name__}: {e}"
    out["tried"] = tried
    headers: dict[str, str] = {}  # the trusted precompiled headers, bound read-only into a compile's TMPDIR
    pch = Path(os.environ.get("TMPDIR", "/tmp")) / "torchinductor_aotc" / "precompiled_headers"
    for p in sorted(pch.glob("*.h*")):
        try:
            with open(p, "ab") as f:
                f.write(b"\n#error planted by the probe\n")
            headers[p.name] = "written"
        except OSError as e:
            headers[p.name] = f"{type(e).__name__}: {e}"
        try:
            p.unlink()
            headers[p.name] += "; removed"
        except OSError as e:
            headers[p.name] += f"; {type(e).__name__}: {e}"
    out["headers"] = headers
    return out


def poison() -> None:
    """Add POISON to the timings file Inductor will read and rewrite (it keeps what it finds there)."""
    from torch._inductor.codecache import CacheBase

    path = CacheBase.get_local_cache_path()
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {"system": {}, "cache": {}}
    for (op, inputs, precision, choice), value in POISON:
        doc["cache"].setdefault(op, {}).setdefault(inputs, {}).setdefault(precision, {})[choice] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


# -- the models: a Linear whose input's name arms what the children do --------------------------------------------

def model(kind: str, d_in: int = 4, d_out: int = 4) -> Any:
    """A Linear(d_in, d_out) whose input is named `kind` (segv, hang, probe, poison, early)."""
    import torch

    class Armed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(d_in, d_out)

    forwards = {
        "segv": lambda self, segv: self.lin(segv),
        "hang": lambda self, hang: self.lin(hang),
        "probe": lambda self, probe: self.lin(probe),
        "poison": lambda self, poison: self.lin(poison),
        "early": lambda self, early: self.lin(early),
    }
    return type(f"Armed_{kind}", (Armed,), {"forward": forwards[kind]})()
