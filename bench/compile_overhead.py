"""aotc's compile time against a plain AOTInductor compile of the same exported program, on the same machine, in
one run; and where aotc's extra time goes.

    python bench/compile_overhead.py --device cpu --out bench/results/compile-overhead-cpu.json
    python bench/compile_overhead.py --device cuda:0 --models resnet18 --state /tmp/co-state \
        --out bench/results/compile-overhead-h100-resnet18.json      # a model per call, headers kept in --state

Each model is exported once at a static shape (the zoo's serving batch on a GPU; bench/report_overhead.py's small
models on a CPU). Per model and run, alternating:

- `plain`: a fresh process imports torch, loads the .pt2 and calls `torch._inductor.aoti_compile_and_package(ep)`
  with its defaults and an empty Inductor cache dir (precompiled headers already built in its TMPDIR, as a user's
  second compile would find them: aotc's workers have theirs too). `plain_process_s` is the process's wall time,
  `plain_compile_s` the call alone;
- `aotc`: the same file uploaded to a service with one worker (sandbox as configured, private caches per job),
  compiled for `--device`; `job_s` is the job's wall time from submit to its end (queue -> sandboxed compile child
  -> check -> timing pass -> sign -> publish), `compile_child_s` the compile child's wall time, `inductor_s` the
  Inductor call inside it. Each run uploads new weights (another seed), so no run finds an earlier one's artifact.

The breakdown comes from the job's own stage events (the worker records a stage as it enters it) and the compile's
timings. The service's workers are started before the first run and wait until their headers are built, so no job
pays for them. Prints a table and writes JSON.
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

from bench.farmkit import SMALL, Service, export, median, table, timeline  # noqa: E402

PLAIN = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
ep = torch.export.load(sys.argv[1])
t2 = time.perf_counter()
torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[2])
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "compile_s": t3 - t2}))
"""


def plain(model: Path, out: Path, tmpdir: Path, device: str) -> dict[str, Any]:
    """A plain compile in a fresh process with an empty Inductor cache (TMPDIR shared: its precompiled headers)."""
    cache = Path(tempfile.mkdtemp(prefix="inductor-", dir=tmpdir))
    env = {**os.environ, "TMPDIR": str(tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if device.startswith("cuda"):
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PLAIN, str(model), str(out)], env=env, capture_output=True,
                          text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"plain compile of {model.name} failed: {done.stderr[-2000:]}")
    inner = json.loads(done.stdout.strip().splitlines()[-1])
    return {"plain_process_s": round(wall, 3), "plain_compile_s": round(inner["compile_s"], 3),
            "plain_import_s": round(inner["import_s"], 3)}


def aotc(svc: Service, model: Path, device: str) -> dict[str, Any]:
    from client import Client

    with Client(svc.url, timeout=600) as c:
        rec = c.upload(model)
        shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
        ans = c.submit(rec["id"], shapes, "cuda" if device.startswith("cuda") else "cpu")
        assert ans["status"] != "cached", "a new seed must make a new model"
        c.wait(ans["job"]["id"], timeout=3600)
    line = timeline(svc.store(), ans["job"]["id"])
    t = line["job"].get("timings") or {}
    if isinstance(t, str):
        t = json.loads(t)
    inner = {k: t.get(k) for k in ("load", "capture", "autograd", "lowering", "fusion", "codegen", "package",
                                   "scan", "isa", "report", "compile")}
    # fusion, codegen and package split `compile` (the Inductor call); the others are apart from it
    staged = sum(t.get(k) or 0 for k in ("load", "capture", "autograd", "lowering", "compile", "scan", "isa",
                                         "report"))
    return {"job_s": line["wall_s"], "compile_child_s": t.get("compile_total"), "inductor_s": t.get("compile"),
            "check_s": t.get("check"), "timing_s": t.get("timing"), "check_wait_s": t.get("check_wait"),
            # the compile child's time outside its named stages: start, import, the report and sources written
            "child_outside_stages_s": round((t.get("compile_total") or 0) - staged, 3),
            "stages": inner, "spans": line["spans"], "job_id": ans["job"]["id"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default=",".join(SMALL))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], help="AOTC_X=value for the service (repeatable)")
    ap.add_argument("--baseline-env", action="append", default=[], help="AOTC_X=value: a second service (one "
                    "worker) with these settings compiles each model too, in the same run (e.g. "
                    "AOTC_TIMING_PASS=separate: the job before the lone worker's check took the figures)")
    ap.add_argument("--state", type=Path, default=None, help="keep the plain side's and the worker's precompiled "
                    "headers here across invocations (one model per call on a GPU host): warmed once")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    names = a.models.split(",")
    extra = dict(e.split("=", 1) for e in a.env)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aotc-overhead-") as tmp_s:
        tmp = Path(tmp_s)
        state = a.state or tmp
        plain_tmp = state / "plain-tmp"
        plain_tmp.mkdir(parents=True, exist_ok=True)
        svc = Service(tmp / "data", a.device, 1, {"AOTC_HEADERS_DIR": str(state / "headers"), **extra})
        base_env = dict(e.split("=", 1) for e in a.baseline_env)
        base = (Service(tmp / "base", a.device, 1, {"AOTC_HEADERS_DIR": str(state / "headers"), **extra, **base_env})
                if base_env else None)
        try:
            # The plain side's precompiled headers, and the worker's (it builds them before it serves).
            if not (state / "warm.done").exists():
                warm = export(names[0], tmp / "warm.pt2", a.device, seed=1000)
                plain(warm, tmp / "warm-plain.pt2", plain_tmp, a.device)
                svc.wait_registered(1)
                svc.wait_headers(1)
                aotc(svc, warm, a.device)
                (state / "warm.done").write_text("")
            svc.wait_registered(1)
            svc.wait_headers(1)
            for run in range(a.runs):
                for name in names:
                    model = export(name, tmp / f"{name}-{run}.pt2", a.device, seed=run)
                    row: dict[str, Any] = {"model": name, "run": run}
                    row.update(plain(model, tmp / f"{name}-{run}-plain.pt2", plain_tmp, a.device))
                    row.update(aotc(svc, model, a.device))
                    row["job_x_plain"] = round(row["job_s"] / row["plain_process_s"], 2)
                    if base is not None:
                        b = aotc(base, export(name, tmp / f"{name}-{run}-base.pt2", a.device, seed=run + 500),
                                 a.device)
                        row["baseline"] = b
                        row["base_job_s"] = b["job_s"]
                        row["base_x_plain"] = round(b["job_s"] / row["plain_process_s"], 2)
                    rows.append(row)
                    print(f"{name} run {run}: plain {row['plain_process_s']} s, aotc job {row['job_s']} s "
                          f"({row['job_x_plain']}x); spans {row['spans']}", flush=True)
        finally:
            svc.stop()
            if base is not None:
                base.stop()
    if not rows:  # --runs 0: only the warm-up (headers and caches into --state), for a later call to use
        print("warmed", a.state)
        return 0
    summary = []
    for name in names:
        mine = [r for r in rows if r["model"] == name]
        s: dict[str, Any] = {"model": name}
        for k in ("plain_process_s", "plain_compile_s", "job_s", "compile_child_s", "inductor_s", "check_s",
                  "timing_s"):
            s[k] = median([r[k] for r in mine])
        s["job_x_plain"] = round(s["job_s"] / s["plain_process_s"], 2)
        if base_env:
            s["base_job_s"] = median([r["base_job_s"] for r in mine])
            s["base_x_plain"] = round(s["base_job_s"] / s["plain_process_s"], 2)
        s["child_x_plain"] = round(s["compile_child_s"] / s["plain_process_s"], 2)
        spans: dict[str, list[float]] = {}
        for r in mine:
            for k, v in r["spans"].items():
                spans.setdefault(k, []).append(v)
        s["spans"] = {k: median(v) for k, v in spans.items()}
        summary.append(s)
    ratios = sorted(s["job_x_plain"] for s in summary)
    print(table(summary, ["model", "plain_process_s", "plain_compile_s", "job_s", "compile_child_s", "inductor_s",
                          "check_s", "timing_s", "job_x_plain", "child_x_plain",
                          *(["base_job_s", "base_x_plain"] if base_env else [])]))
    print("median job / plain:", median(ratios))
    if base_env:
        print(f"median baseline ({base_env}) job / plain:", median([s["base_x_plain"] for s in summary]))
    stages = sorted({k for s in summary for k in s["spans"]})
    print(table([{"model": s["model"], **s["spans"]} for s in summary], ["model", *stages]))
    import torch

    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device, "torch": torch.__version__,
        "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(), "env": extra, "runs": a.runs,
        "baseline_env": base_env, "median_job_x_plain": median(ratios),
        "median_base_x_plain": median([s["base_x_plain"] for s in summary]) if base_env else None,
        "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
