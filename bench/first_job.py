"""A fresh worker's time to its first job done: the worker starts with an empty precompiled-headers dir, a job is
submitted as soon as it has registered, and the clock runs from the worker's start to the job's end. Once with
AOTC_HEADERS_WARMUP=before (the warm-up builds the headers, then the worker takes jobs) and once with background
(the worker takes the job at once; its compile runs without precompiled headers while the warm-up builds them),
alternating for `--runs`.

    python bench/first_job.py --out bench/results/first-job-cpu.json
    python bench/first_job.py --device cuda:0 --model resnet18 --modes before \
        --out bench/results/first-job-h100-before.json               # a mode per call on a GPU host
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.farmkit import Service, export, median, table, timeline  # noqa: E402

MODES = ("before", "background")


def once(mode: str, model: Path, tmp: Path, device: str) -> dict[str, Any]:
    from client import Client

    svc = Service(tmp / "data", device, 0, {"AOTC_HEADERS_WARMUP": mode, "AOTC_HEADERS_DIR": str(tmp / "headers")})
    try:
        with Client(svc.url, timeout=600) as c:
            rec = c.upload(model)
            shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
            started = svc.add_worker()
            svc.wait_registered(1)
            job = c.submit(rec["id"], shapes, "cuda" if device.startswith("cuda") else "cpu")["job"]["id"]
            c.wait(job, timeout=3600)
        line = timeline(svc.store(), job)
        built = svc.logged("precompiled headers: built")
        svc.wait_headers(1)  # the background build's end, for the record (after the clock stopped)
        art = svc.store().artifacts.get(line["job"]["artifact"]) or {}
        return {"mode": mode, "first_job_done_s": round(float(line["job"]["finished"]) - started, 1),
                "job_claimed_s": round(float(line["job"]["started"]) - started, 1),
                "compile_s": (line["job"].get("timings") or {}).get("compile_total"),
                "precompiled_headers": (art.get("caches") or {}).get("precompiled_headers"),
                "headers_built_before_job_end": bool(built), "spans": line["spans"],
                "headers_log": svc.logged("precompiled headers: built")}
    finally:
        svc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="convnet")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES), help="before,background (one per call on a GPU host)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    modes = a.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="aotc-first-") as tmp_s:
        tmp = Path(tmp_s)
        for run in range(a.runs):
            for mode in modes:
                model = export(a.model, tmp / f"{a.model}-{run}-{mode}.pt2", a.device, seed=run)
                d = tmp / f"{mode}-{run}"
                row = once(mode, model, d, a.device)
                row["run"] = run
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = [{"mode": m, **{k: median([r[k] for r in rows if r["mode"] == m])
                              for k in ("first_job_done_s", "job_claimed_s", "compile_s")}} for m in modes]
    print(table(summary, ["mode", "first_job_done_s", "job_claimed_s", "compile_s"]))
    done = {s["mode"]: s["first_job_done_s"] for s in summary}
    before, after = done.get("before"), done.get("background")
    ratio = round(after / before, 2) if before and after else None
    print("background / before:", ratio)
    import torch

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device,
                                 "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
                                 "model": a.model, "summary": summary, "background_over_before": ratio,
                                 "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
