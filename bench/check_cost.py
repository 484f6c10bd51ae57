"""Where an artifact check's time goes, and what more lanes of adversarial probes buy: one compile per model, then the
same check run again in a fresh process per setting, in one run.

    python bench/check_cost.py --device cuda:0 --models hf_distilbert,resnet18 --lanes 3,6 \
        --out bench/results/check-cost-h200.json

Per model: the zoo's program at its serving batch is exported once and compiled once by `compile_model` (as the
worker's compile child runs it, without the sandbox), then checked by `check_artifact` as the worker's check child
runs it (`untimed`: the timing pass is apart), once per `--lanes` value (compiler.adversarial.CUDA_LANES), each in a
new process. A row gives the check's phases (its record's `phases`: eager's run, the package's load and weights,
the plain run, the weights' perturbation, the CUDA graphs, the adversarial cases), the adversarial probes' count and
the median probe's parts (`probe_cost`: its CUDA context, its package load, its program load, its wall time to
exit). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.farmkit import export, median, table  # noqa: E402

COMPILE = """
import json, sys
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
model, spec, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
result = compile_model(model, spec, spec, CompileOptions(), sys.argv[4], out)
print(json.dumps({"package": result["package"], "timings": result.get("timings")}))
"""

CHECK = """
import json, sys, time
t0 = time.perf_counter()
from compiler import adversarial
from compiler.check import check_artifact, untimed
model, package, spec, device, lanes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], int(sys.argv[5])
adversarial.CUDA_LANES = lanes
t1 = time.perf_counter()
with untimed():
    summary = check_artifact(model, package, spec, device)
adv = summary.get("adversarial") or {}
print(json.dumps({"import_s": t1 - t0, "check_s": time.perf_counter() - t1, "phases": summary.get("phases"),
                  "adversarial": {k: adv.get(k) for k in ("cases", "outcomes", "probes", "forked", "probe_lanes",
                                                         "probe_seconds", "probe_cost", "seconds", "run_again")}}))
"""


def child(code: str, *argv: str, timeout: float = 1800, tree: Path = ROOT) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-P", "-c", code, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:1]} failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default="hf_distilbert")
    ap.add_argument("--lanes", default="3,6", help="CUDA_LANES values, one check each (comma-separated)")
    ap.add_argument("--baseline-tree", type=Path, default=None, help="another checkout (an earlier commit): each "
                    "check runs again with its compiler, on the same package, in the same run")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    import torch

    from bench.zoo import spec_of

    lanes = [int(x) for x in a.lanes.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aotc-check-cost-") as tmp_s:
        tmp = Path(tmp_s)
        for name in a.models.split(","):
            path = export(name, tmp / f"{name}.pt2", a.device)
            inputs = torch.load(str(path) + ".inputs.pt")
            spec = spec_of(torch.export.load(str(path)), inputs)
            t0 = time.perf_counter()
            built = child(COMPILE, str(path), json.dumps(spec), str(tmp / f"{name}-pkg.pt2"), a.device)
            compile_s = round(time.perf_counter() - t0, 3)
            print(f"{name}: compiled in {compile_s} s", flush=True)
            trees = [("this", ROOT)] + ([("baseline", a.baseline_tree)] if a.baseline_tree else [])
            for n, (label, tree) in [(n, t) for n in lanes for t in trees]:
                got = child(CHECK, str(path), built["package"], json.dumps(spec), a.device, str(n), tree=tree)
                adv, cost = got["adversarial"], got["adversarial"].get("probe_cost") or {}
                row = {"model": name, "tree": label, "lanes": n, "compile_s": compile_s,
                       "check_s": round(got["check_s"], 3),
                       **{f"{k}_s": v for k, v in (got["phases"] or {}).items()},
                       "probes": adv.get("probes"), "ran_lanes": adv.get("probe_lanes"),
                       "probe_s": cost.get("median_s"), "probe_context_s": cost.get("context_s"),
                       "probe_package_s": cost.get("package_s"), "probe_program_s": cost.get("program_s"),
                       "lanes_s": cost.get("lanes_s"), "cases_s": cost.get("cases_s"),
                       "outcomes": adv.get("outcomes"), "raw": got}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "raw"}), flush=True)
    header = ["model", "tree", "lanes", "check_s", "program_s", "eager_s", "load_s", "plain_s", "follows_s", "graphs_s",
              "adversarial_s", "probes", "ran_lanes", "probe_s", "probe_context_s", "probe_package_s",
              "probe_program_s", "lanes_s", "cases_s"]
    print(table(rows, header))
    for name in a.models.split(","):
        mine = {(r["tree"], r["lanes"]): r for r in rows if r["model"] == name}
        if len(mine) > 1:
            base = mine[("this", lanes[0])]["check_s"]
            print(name, {f"{t} {n}": round(r["check_s"] / base, 2) for (t, n), r in mine.items()},
                  "check time against this tree's at", lanes[0], "lanes")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None, "cpus": os.cpu_count(),
        "baseline_tree": str(a.baseline_tree) if a.baseline_tree else None,
        "median_check_s": {f"{t} {n}": median([r["check_s"] for r in rows if r["lanes"] == n and r["tree"] == t])
                           for n in lanes for t in ("this", "baseline")},
        "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
