"""One model's adversarial check, again and again under different conditions, to tell a package that faults from a
device or a load that makes it look so (issue 24: GPT-2's and Llama-small's packages were refused on an H200 at an
int64-max token id with `unspecified launch failure`, though GPT-2's passed the same case on another H200 a day
before, and the GPU fell off the bus minutes later).

    # a GPU host (device_env.sh sets up the wheels and LD_PRELOAD), alone on the machine:
    python3 bench/fault_case.py --model hf_gpt2 --device cuda:0 --lanes 1,3 --blocking --out $OUT/fault.json
    # a CPU smoke test
    python3 bench/fault_case.py --model hf_distilbert --batch 2 --device cpu --lanes 1 --out /tmp/fault.json

The model is exported at its serving batch (or `--batch`) and compiled once, as a worker's compile child compiles
(compiler.pipeline.compile_model: the forced index asserts included). Then the whole check (compiler.check:
eager against the package, then the adversarial cases in probe lanes) runs in a fresh process per condition:
each `--lanes` count (compiler.adversarial.CUDA_LANES and CPU_LANES), and with `--blocking` each again under
CUDA_LAUNCH_BLOCKING=1, which makes a kernel's fault surface at its own launch. Each row: passed or the check's
message, the adversarial part's outcomes and failures, and the seconds. The table goes to stdout, the rows to
`--out` as they finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys
from compiler import adversarial
from compiler.check import check_artifact
from compiler.errors import CheckFailed
a = json.loads(sys.argv[1])
adversarial.CUDA_LANES = adversarial.CPU_LANES = a["lanes"]
try:
    s = check_artifact(a["model"], a["package"], a["spec"], a["device"])
    out = {"passed": True, "adversarial": s.get("adversarial"), "max_rel_err": s.get("max_rel_err")}
except CheckFailed as e:
    out = {"passed": False, "error": str(e)[:2000], "excerpt": e.excerpt[:6000]}
print("FAULT-CASE " + json.dumps(out, default=str))
"""


def build(name: str, batch: int | None, device: str, work: Path) -> tuple[Path, Path, list[dict[str, Any]]]:
    """Export `name` and compile it as a worker does; returns the program, the package and the spec."""
    from bench.farmkit import export
    from compiler.archive.inspect import inspect_archive
    from compiler.options import CompileOptions
    from compiler.pipeline import compile_model
    from compiler.shapes import canonical_spec

    model_path, package_path = work / f"{name}.pt2", work / f"{name}-package.pt2"
    export(name, model_path, device, batch=batch)
    program_inputs = inspect_archive(str(model_path))["inputs"]
    spec = canonical_spec(program_inputs, {i["name"]: i["shape"] for i in program_inputs})
    t0 = time.perf_counter()
    compile_model(str(model_path), spec, program_inputs, CompileOptions(), device, str(package_path))
    print(f"compiled {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return model_path, package_path, spec


def run_check(model: Path, package: Path, spec: list[dict[str, Any]], device: str, lanes: int,
              blocking: bool) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    arg = json.dumps({"model": str(model), "package": str(package), "spec": spec, "device": device, "lanes": lanes})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FAULT-CASE ")), None)
    row: dict[str, Any] = {"lanes": lanes, "blocking": blocking, "seconds": round(time.perf_counter() - t0, 1)}
    if line is None:  # the check's own process died: what it said last
        row.update(passed=False, error=f"the check process exited with status {proc.returncode}",
                   stderr=proc.stderr[-4000:])
    else:
        row.update(json.loads(line[len("FAULT-CASE "):]))
    adv = row.get("adversarial") or {}
    row["outcomes"] = adv.get("outcomes")
    row["probe_lanes"] = adv.get("probe_lanes")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf_gpt2")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=None, help="default: the zoo's serving batch")
    ap.add_argument("--lanes", default="1,3", help="comma-separated probe lane counts, each a run of the check")
    ap.add_argument("--blocking", action="store_true", help="each lane count again under CUDA_LAUNCH_BLOCKING=1")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    work = a.work or Path(f"/tmp/aotc-fault-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    model, package, spec = build(a.model, a.batch, a.device, work)
    result: dict[str, Any] = {"model": a.model, "device": a.device, "spec": spec, "rows": []}
    for lanes in (int(x) for x in a.lanes.split(",")):
        for blocking in ((False, True) if a.blocking else (False,)):
            row = run_check(model, package, spec, a.device, lanes, blocking)
            result["rows"].append(row)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1, default=str))
            print(f"lanes {lanes} blocking {blocking!s:5} {row['seconds']:7.1f} s  "
                  f"{'passed' if row['passed'] else 'REFUSED: ' + str(row.get('error'))[:300]}  "
                  f"outcomes {row.get('outcomes')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
