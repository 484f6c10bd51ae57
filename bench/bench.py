"""GPU benchmark: real models (random weights, bf16) through the service, against eager and torch.compile.

Run on a machine with a CUDA GPU, from the repo root:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python3 bench/bench.py --out bench/results/h100.json

It starts `aotc serve` (embedded Redis, API, one worker on cuda:0) unless --url points at a running service, and
is resumable: models already in --out are skipped, so a long run can be split over several invocations
(--budget-s stops it before a model that would not finish in time). For each model it records:

- through the service: compile success (or the stage and reason of the failure), compile time, artifact size;
- latency (median of triton.testing.do_bench) of eager, torch.compile (default) and the artifact;
- torch.compile's cold compile time, in a fresh process with empty Inductor and Triton caches;
- time to first inference in a fresh process: (a) torch.compile from cold, (b) pull the artifact from the
  service, load it and call it.

`python3 bench/report.py FILE.json` prints the table and draws the chart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


def _bench_ms(fn: Any) -> float:
    import torch
    from triton.testing import do_bench

    with torch.inference_mode():
        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


# -- fresh-process measurements ------------------------------------------------------------------------------


def child_torch_compile(name: str) -> dict[str, Any]:
    import torch

    from bench.zoo import build

    t_import = time.perf_counter() - T_START
    model, inputs = build(name)
    torch.cuda.synchronize()
    t_build = time.perf_counter() - T_START
    compiled = torch.compile(model)
    with torch.inference_mode():
        compiled(*inputs)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - T_START
    return {"import_s": t_import, "build_s": t_build - t_import, "compile_and_first_call_s": t_first - t_build,
            "ttfi_s": t_first, "latency_ms": _bench_ms(lambda: compiled(*inputs))}


def child_artifact(name: str, key: str, url: str) -> dict[str, Any]:
    import torch

    from bench.zoo import MODELS
    from client import Client
    from compiler.compat.aoti import aoti_load_package

    t_import = time.perf_counter() - T_START
    inputs = MODELS[name][1]()
    with tempfile.TemporaryDirectory() as cache, Client(url, cache_dir=cache) as c:
        t0 = time.perf_counter()
        path = c.pull(key)
        t_pull = time.perf_counter() - t0
        fn = aoti_load_package(str(path), "cuda:0")
        t_load = time.perf_counter() - t0 - t_pull
        with torch.inference_mode():
            fn(*inputs)
        torch.cuda.synchronize()
        t_first = time.perf_counter() - t0 - t_pull - t_load
    return {"import_s": t_import, "pull_s": t_pull, "load_s": t_load, "first_call_s": t_first,
            "ttfi_after_import_s": t_pull + t_load + t_first, "ttfi_s": time.perf_counter() - T_START}


def _fresh(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:], "returncode": p.returncode}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


# -- the driver ----------------------------------------------------------------------------------------------


def start_service(port: int, data_dir: Path, workers: int) -> list[subprocess.Popen[bytes]]:
    """Embedded Redis (AOF, so artifacts survive a restart), the API, and `workers` worker processes on cuda:0.
    Several workers share the GPU to overlap compiles, which are mostly CPU work; compile times then include
    that contention (recorded as parallel_compiles)."""
    from service.store.embedded import EmbeddedRedis

    redis_srv = EmbeddedRedis(data_dir / "redis", port=port + 1).start()
    env = {**os.environ, "AOTC_REDIS_URL": redis_srv.url, "AOTC_DATA_DIR": str(data_dir), "AOTC_DEVICE": "cuda:0",
           "AOTC_WORK_DIR": str(data_dir / "work"), "AOTC_CHILD_LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
           "AOTC_COMPILE_TIMEOUT_S": "900",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(data_dir / "serve.log", "ab")
    procs = [subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--port",
                               str(port), "--log-level", "warning"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)]
    procs += [subprocess.Popen([sys.executable, "-m", "worker"],
                               env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
              for _ in range(workers)]
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=2)
            if r.status_code == 200 and len(r.json()["workers"]) >= workers:
                procs.append(redis_srv.proc)  # type: ignore[arg-type]
                return procs
        except httpx.TransportError:
            pass
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"service exited: {(data_dir / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError("the service did not come up with its cuda workers")


def prefetch(names: list[str], url: str, work: Path, budget_s: float) -> dict[str, str]:
    """Export and submit every model first, so the workers compile them side by side; then wait for the jobs."""
    import torch

    from bench.zoo import build
    from client import Client

    jobs: dict[str, str] = {}
    with Client(url, cache_dir=work / "client-cache", timeout=300) as c:
        for name in names:
            path = work / f"{name}.pt2"
            try:
                if not path.exists():
                    model, inputs = build(name)
                    torch.export.save(torch.export.export(model, inputs), str(path))
                    del model
                    torch.cuda.empty_cache()
                rec = c.upload(path)
                shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
                ans = c.submit(rec["id"], shapes, "cuda")
                if ans["status"] != "cached":
                    jobs[name] = ans["job"]["id"]
                print(f"prefetch {name}: {ans['status']}", flush=True)
            except Exception as e:
                print(f"prefetch {name} failed: {type(e).__name__}: {e}"[:500], flush=True)
        while jobs and time.perf_counter() - T_START < budget_s:
            states = {n: c.job(j)["state"] for n, j in jobs.items()}
            if all(s in ("succeeded", "failed", "cancelled") for s in states.values()):
                break
            time.sleep(2)
    return jobs


def bench_model(name: str, url: str, work: Path, *, warm_timeout: float) -> dict[str, Any]:
    import torch

    from bench.zoo import MODELS, build
    from client import Client, JobFailed
    from compiler.check import compare

    row: dict[str, Any] = {"family": MODELS[name][2]}
    model, inputs = build(name)
    row["inputs"] = [list(t.shape) for t in inputs]
    with torch.inference_mode():
        expected = model(*inputs)
    row["eager_ms"] = _bench_ms(lambda m=model: m(*inputs))

    path = work / f"{name}.pt2"
    if not path.exists():  # --prefetch exported it already
        t0 = time.perf_counter()
        torch.export.save(torch.export.export(model, inputs), str(path))
        row["export_s"] = time.perf_counter() - t0

    with Client(url, cache_dir=work / "client-cache", timeout=300) as c:
        t0 = time.perf_counter()
        try:
            art = c.compile(path, list(inputs), target="cuda", timeout=warm_timeout)
        except JobFailed as e:
            err = e.job.get("error") or {}
            row.update(ok=False, stage=err.get("stage"), error=err.get("message"),
                       excerpt=(err.get("excerpt") or "")[-800:])
            return row
        row["service_wall_s"] = time.perf_counter() - t0
        row.update(ok=True, key=art.key, artifact_bytes=art.meta["size"],
                   compile_s=art.meta["timings"]["compile_total"],
                   stage_s=art.meta["timings"], worker_check=art.meta["check"])
        fn = c.load(art, device="cuda:0")
        with torch.inference_mode():
            row["max_rel_err"] = compare(expected, fn(*inputs)).get("max_rel_err")
        row["aoti_ms"] = _bench_ms(lambda f=fn: f(*inputs))
        del fn
    del model
    torch.cuda.empty_cache()

    with tempfile.TemporaryDirectory() as cold:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cold}/inductor", "TRITON_CACHE_DIR": f"{cold}/triton"}
        row["torch_compile"] = _fresh(["--child", "torch-compile", name], env, warm_timeout)
    row["artifact_fresh"] = _fresh(["--child", "artifact", name, row["key"], url], dict(os.environ), 300)
    tc = row["torch_compile"]
    if "latency_ms" in tc:
        row["torch_compile_ms"] = tc["latency_ms"]
        row["torch_compile_cold_s"] = tc["compile_and_first_call_s"]
    return row


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    v: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for dist in ("triton", "torchvision", "timm", "transformers"):
        try:
            v[dist] = md.version(dist)
        except md.PackageNotFoundError:
            v[dist] = None
    return v


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/latest.json")
    ap.add_argument("--models", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--url", default=None, help="a running service; default: start `aotc serve` here")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--state", default=".bench-state", help="service data and exported models (kept for resuming)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop before starting a model after this long")
    ap.add_argument("--workers", type=int, default=1, help="GPU worker processes (compiles overlap when > 1)")
    ap.add_argument("--prefetch", action="store_true", help="submit every model's compile before measuring any")
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        kind, *rest = a.child
        res = child_torch_compile(*rest) if kind == "torch-compile" else child_artifact(*rest)
        print(json.dumps(res))
        return 0

    import torch

    from bench.zoo import MODELS

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("models", {})
    results.update(device=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d"), versions=versions())
    state = Path(a.state).resolve()
    (state / "aotc").mkdir(parents=True, exist_ok=True)
    names = [n for n in (a.models.split(",") if a.models else MODELS) if n not in results["models"]]
    service = [] if a.url else start_service(a.port, state / "aotc", a.workers)
    url = a.url or f"http://127.0.0.1:{a.port}"
    try:
        if a.prefetch:
            prefetch(names, url, state, a.budget_s)
        for name in names:
            if time.perf_counter() - T_START > a.budget_s:
                print(f"budget reached; {len(names) - names.index(name)} models left", flush=True)
                break
            t0 = time.perf_counter()
            try:
                row = bench_model(name, url, state, warm_timeout=900)
            except Exception as e:  # a model we cannot even build or export is a result too
                row = {"ok": False, "stage": "bench", "error": f"{type(e).__name__}: {e}"[:2000]}
            row["bench_s"] = time.perf_counter() - t0
            row["parallel_compiles"] = a.workers
            results["models"][name] = row
            out.write_text(json.dumps(results, indent=1, default=str))
            print(f"{name}: ok={row.get('ok')} eager={row.get('eager_ms')} aoti={row.get('aoti_ms')} "
                  f"tc={row.get('torch_compile_ms')} ({row['bench_s']:.0f} s)", flush=True)
    finally:  # the API and workers first (a worker hands its job back through Redis), Redis (the last) after
        for p in service[:-1]:
            p.terminate()
        for p in service:
            if p is service[-1]:
                p.terminate()
            p.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
