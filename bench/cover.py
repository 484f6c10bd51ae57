"""Which of the zoo's models compile and check at their serving batch, and the exact reason for each that does not
(issue 24's wider corpus: the goal is >= 98 %). Resumable across device calls.

    # a GPU host, detached (it outlasts one call), then polled; a later call resumes with --append
    mkdir -p /tmp/cover-inf && LD_PRELOAD=... setsid nohup python3 bench/cover.py --device cuda:0 --workers 8 \
        --work /tmp/cover-inf/work --out /tmp/cover-inf/cover.json --append \
        > /tmp/cover-inf/cover.log 2>&1 < /dev/null &
    # a CPU smoke test
    python3 bench/cover.py --device cpu --models inplace_reduce,convnet --workers 2 --out /tmp/cover-cpu.json

A service of `--workers` workers starts first (fresh workers: they build their headers in the background); then each
model is exported at its serving batch (the zoo's dtype) and submitted as soon as it is exported, so the workers
compile while the later models export. Each job's row is written as it ends: its state, the compile child's and
the check's seconds, the check's worst error against eager and the tolerance it met, and for a failure the job's
error (type, stage, message). A model whose export fails gets a row with stage "export". With `--append` the rows
already in `--out` are kept and their models not run again (a row whose error matches a `--retry` text is run
again); a model cut off by the end of a device call has no row, so the next call runs it. A device that stops
working ends the run the same way: an export that fails where a fresh process cannot use the device either, or
no healthy worker for NO_WORKER_S (the workers' jobs go back as DeviceLost), leaves the models not yet ended
without a row, and `stopped` in the JSON says why.
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

from bench.farmkit import export, job_error, start_service, timeline  # noqa: E402

ENDED = ("succeeded", "failed", "cancelled")
NO_WORKER_S = 120.0  # how long the run waits with no healthy worker before it stops


def device_lost(device: str) -> str | None:
    """None if a fresh process can still use `device` (always, for a CPU), else its error."""
    if not device.startswith("cuda"):
        return None
    probe = subprocess.run([sys.executable, "-c", f"import torch; torch.zeros(1, device={device!r}).sum().item()"],
                           capture_output=True, text=True, timeout=300)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["exit status"])[-1][:300]


def row_of(name: str, store: Any, job_id: str) -> dict[str, Any]:
    line = timeline(store, job_id)
    job = line["job"]
    t, check = job.get("timings") or {}, job.get("check") or {}
    row: dict[str, Any] = {"model": name, "state": job["state"], "job": job_id, "key": job.get("artifact"),
                           "job_s": line["run_s"], "compile_s": t.get("compile_total"), "check_s": t.get("check"),
                           "max_rel_err": check.get("max_rel_err"),
                           # per point in the check's record; the row keeps the largest (the looser dtype's)
                           "tolerance": max((p["tolerance"] for p in check.get("points") or []
                                             if isinstance(p.get("tolerance"), (int, float))), default=None),
                           "speedup": check.get("speedup"), "spans": line["spans"],
                           "adversarial": {k: (check.get("adversarial") or {}).get(k)
                                           for k in ("cases", "probes", "probe_seconds", "probe_lanes", "run_again",
                                                     "outcomes")}}
    if (error := job_error(job, 8000)) is not None:  # the excerpt: every failed case (DeBERTa-v3's 14 were lost)
        row["error"] = error
    return row


def summary(rows: list[dict[str, Any]], zoo: list[str]) -> dict[str, Any]:
    tried = [r for r in rows if r["model"] in zoo]
    ok = [r for r in tried if r["state"] == "succeeded"]
    return {"zoo": len(zoo), "tried": len(tried), "compiled_and_checked": len(ok),
            "share": round(len(ok) / len(tried), 4) if tried else None,
            "not_tried": [m for m in zoo if m not in {r["model"] for r in tried}],
            "failed": {r["model"]: f"{(r.get('error') or {}).get('stage')}: {(r.get('error') or {}).get('type')}: "
                                   f"{str((r.get('error') or {}).get('message'))[:300]}"
                       for r in tried if r["state"] != "succeeded"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default=None, help="comma-separated (default: the zoo's, in its order)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--env", action="append", default=[], help="AOTC_X=value for the workers (repeatable)")
    ap.add_argument("--work", type=Path, default=None, help="the service's data and the exports (default: temp)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--append", action="store_true", help="keep --out's rows and skip their models")
    ap.add_argument("--retry", action="append", default=[], help="with --append: run again a failed row whose "
                    "error (type: message) contains this text (repeatable)")
    a = ap.parse_args()
    from bench.zoo import MODELS

    names = a.models.split(",") if a.models else list(MODELS)
    old = json.loads(a.out.read_text())["rows"] if a.append and a.out.exists() else []

    def again(r: dict[str, Any]) -> bool:
        text = f"{(r.get('error') or {}).get('type')}: {(r.get('error') or {}).get('message')}"
        return r["state"] != "succeeded" and any(x in text for x in a.retry)

    rows = [r for r in old if not (again(r) and r["model"] in names)]  # a row of a model not asked for stays
    todo = [n for n in names if n not in {r["model"] for r in rows}]
    work = a.work or Path(f"/tmp/aotc-cover-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": a.device, "workers": a.workers, "cpus": os.cpu_count(), "rows": rows}

    def save() -> None:
        result["summary"] = summary(rows, names)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.out)

    print(f"{len(rows)} rows kept, {len(todo)} models to run on {a.workers} workers", flush=True)
    if not todo:
        save()
        print(json.dumps(result["summary"], indent=1))
        return 0
    extra = {"AOTC_COMPILE_TIMEOUT_S": "3600", **dict(e.split("=", 1) for e in a.env)}
    svc = start_service(work / f"data-{int(time.time())}", a.device, a.workers,
                        {**extra, "AOTC_HEADERS_DIR": str(work / "headers")})
    try:
        import torch

        from client import Client

        result["torch"] = torch.__version__
        store = svc.store()
        pending: dict[str, str] = {}  # job id -> model
        target = "cuda" if a.device.startswith("cuda") else "cpu"

        def collect() -> None:
            for jid, name in list(pending.items()):
                if (store.jobs.get(jid) or {}).get("state") in ENDED:
                    rows.append(row_of(name, store, jid))
                    del pending[jid]
                    r = rows[-1]
                    print(json.dumps({k: r.get(k) for k in ("model", "state", "compile_s", "check_s", "max_rel_err",
                                                            "error")})[:600], flush=True)
                    save()

        with Client(svc.url, timeout=600) as c:
            for name in todo:
                path = work / f"{name}.pt2"
                try:
                    export(name, path, a.device)
                    rec = c.upload(path)
                    shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
                    answer = c.submit(rec["id"], shapes, target, priority="batch")
                except Exception as e:  # noqa: BLE001 - a model that does not export or upload is a row too
                    if (lost := device_lost(a.device)) is not None:  # the device's failure, not the model's: no row
                        print(f"{name}: {type(e).__name__}: {str(e)[:300]}; and {a.device} no longer works in a "
                              f"fresh process ({lost}): stopping, {name} and the rest without a row", flush=True)
                        result["stopped"] = {"why": f"{a.device} lost: {lost}", "at": name}
                        break
                    stage = "upload" if path.exists() else "export"
                    rows.append({"model": name, "state": "failed",
                                 "error": {"type": type(e).__name__, "stage": stage, "message": str(e)[:2000]}})
                    print(f"{name}: {stage}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    save()
                    continue
                if answer.get("status") == "cached":
                    rows.append({"model": name, "state": "succeeded", "key": answer["artifact"]["key"],
                                 "cached": True})
                    save()
                else:
                    pending[answer["job"]["id"]] = name
                    print(f"queued {name}", flush=True)
                collect()
            none_since: float | None = None
            while pending:
                time.sleep(2)
                collect()
                # Every worker unhealthy (a GPU that fell off the bus: the jobs go back, DeviceLost, and wait): end
                # the run with the rows it has, so that a device call ends in time and `--append` runs the rest.
                healthy = [w for w in store.workers.live() if w.get("healthy", True)]
                none_since = None if healthy else (none_since or time.monotonic())
                if none_since is not None and time.monotonic() - none_since > NO_WORKER_S:
                    why = {w["id"]: str(w.get("unhealthy_reason"))[:300] for w in store.workers.live()}
                    print(f"no healthy worker for {NO_WORKER_S:.0f} s; {len(pending)} model(s) left without a row "
                          f"({', '.join(sorted(pending.values()))}): {json.dumps(why)}", flush=True)
                    result["stopped"] = {"why": "no healthy worker", "workers": why,
                                         "left": sorted(pending.values())}
                    break
    finally:
        svc.stop()
    save()
    s = result["summary"]
    print(f"{s['compiled_and_checked']} of {s['tried']} tried compiled and checked ({s['share']}); "
          f"{len(s['not_tried'])} of the {s['zoo']} not tried")
    for model, why in s["failed"].items():
        print(f"  {model}: {why}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
