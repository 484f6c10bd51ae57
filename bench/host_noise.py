"""Does eager's figure follow the core it runs on, or the moment? One exported program run eagerly in one process,
timed with its launching thread pinned to each core in turn, over several sweeps, and unpinned at each sweep's
start.

On one H200 (2026-11-29, `results/farm-h200-2026-11-29.json`), eager's figure of one program at its serving batch,
taken in three fresh processes on an idle machine, spread by up to 2.09x (two quiet runs within 10 % of each other
in 13 of 36 pairs), while the CUDA-graph figure of the same artifacts held. Eager at a serving batch is one launch
per op, so the host sets it. This script tells the two causes apart:
- the core: a core's figure holds across sweeps and the cores differ (SMT siblings busy, slower cores): the timing
  pass should then run on the cores that measure fast (AOTC_TIMING_CPUS);
- the moment: one core's figure moves between sweeps (clocks, a neighbour on the host): then no placement helps,
  and a figure needs several runs apart in time.

    python bench/host_noise.py --model hf_bert_base --device cuda:0 --sweeps 3 --out host-noise.json
    python bench/host_noise.py --model convnet --device cpu --sweeps 2 --out /tmp/host-noise.json  # a smoke test

On a CPU the model runs on one thread (`torch.set_num_threads(1)`), so that every core's figure is one core's work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.farmkit import export, host_cpus, table, time_call  # noqa: E402


def spread(xs: list[float]) -> float | None:
    return round(max(xs) / min(xs), 3) if xs and min(xs) > 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf_bert_base", help="a zoo model (or bench/farmkit.py's small CPU models)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument("--cores", default=None, help="comma-separated cores (default: every core of this process)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import torch

    if not a.device.startswith("cuda"):
        torch.set_num_threads(1)
    everywhere = sorted(os.sched_getaffinity(0))
    cores = [int(c) for c in a.cores.split(",")] if a.cores else everywhere
    with tempfile.TemporaryDirectory(prefix="aotc-host-noise-") as tmp:
        path = export(a.model, Path(tmp) / f"{a.model}.pt2", a.device, a.seed)
        eager = torch.export.load(str(path)).module()
        inputs = tuple(t.to(a.device) for t in torch.load(str(path) + ".inputs.pt"))
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": a.model, "device": a.device,
                              "torch": torch.__version__, "host": host_cpus(), "sweeps": []}
    with torch.inference_mode():
        time_call(lambda: eager(*inputs), a.device)  # a first sweep of nothing: lazy loading, cuDNN's plans
        for n in range(a.sweeps):
            os.sched_setaffinity(0, everywhere)
            sweep: dict[str, Any] = {"sweep": n, "unpinned_ms": round(time_call(lambda: eager(*inputs), a.device), 4),
                                     "cores": {}}
            for core in cores:
                os.sched_setaffinity(0, {core})
                sweep["cores"][core] = round(time_call(lambda: eager(*inputs), a.device), 4)
            result["sweeps"].append(sweep)
            print(f"sweep {n}: unpinned {sweep['unpinned_ms']} ms, per core {sweep['cores']}", flush=True)
    os.sched_setaffinity(0, everywhere)

    per_core = {c: [s["cores"][c] for s in result["sweeps"]] for c in cores}
    rows = [{"core": c, "siblings": result["host"].get(c, {}).get("siblings"),
             **{f"sweep{i}_ms": x for i, x in enumerate(xs)}, "median_ms": round(statistics.median(xs), 4),
             "over_time": spread(xs)} for c, xs in per_core.items()]
    medians = [r["median_ms"] for r in rows]
    result["rows"] = rows
    result["summary"] = {
        "between_cores": spread(medians),  # the slowest core's median over the fastest's
        "over_time_median": round(statistics.median(r["over_time"] for r in rows), 3),  # one core, sweep to sweep
        "over_time_worst": max(r["over_time"] for r in rows),
        "unpinned": [s["unpinned_ms"] for s in result["sweeps"]],
    }
    print(table(rows, list(rows[0])))
    print(json.dumps(result["summary"]))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
