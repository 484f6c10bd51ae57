"""max-autotune and shared compile caches on a GPU, through the service: does max-autotune pay, model by model,
and how much faster is a compile when another worker compiled something related before?

Run on a CUDA machine, from the repo root, one lane per GPU (lanes are independent, so run them side by side):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python3 bench/tuning.py \\
        --gpu 0 --plan caches:hf_bert_base --out bench/results/tuning-bert.json
    python3 bench/tuning.py --gpu 1 --plan pays:hf_gpt2,hf_llama_small --out .../tuning-lm.json
    python3 bench/tuning.py --report bench/results/tuning-*.json       # the tables and one JSON summary

A lane runs its own service (embedded Redis and the API) and a sequence of steps. Every step starts a fresh
worker on the lane's GPU with an empty disk (a new AOTC_WORK_DIR, so no local Inductor or Triton cache) as if it
ran on a new machine, compiles one job, and stops. What a step finds warm can therefore only have come through
the service's Redis: Triton autotune results (Inductor's remote cache, `pt2:*` keys) and max-autotune's matmul
and convolution timings (worker/tuning.py). Plans:

- `pays:M1,M2`   per model: mode=default, then mode=max-autotune, both cold; then both artifacts' latency.
- `caches:M`     max-autotune cold; default cold (latencies of the two); then, each on a fresh worker with Redis
                 warm: max-autotune of new weights (same architecture), default of new weights, max-autotune at
                 twice the batch; last, max-autotune of other new weights with both shared caches off (cold again).

Each step records the service's compile time, the stage times, what the worker shared (gemm_timings: shared,
measured, published) and how many Inductor remote-cache entries it wrote. The JSON is rewritten after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def plan_steps(plan: str) -> list[dict[str, Any]]:
    kind, _, models = plan.partition(":")
    names = [m for m in models.split(",") if m]
    if kind == "pays":
        return [{"label": f"{m} {mode}", "model": m, "seed": 0, "batch_mult": 1, "mode": mode, "shared": True}
                for m in names for mode in ("default", "max-autotune")]
    if kind == "caches" and len(names) == 1:
        m = names[0]
        step = lambda label, seed, mode, mult=1, shared=True: {  # noqa: E731
            "label": label, "model": m, "seed": seed, "batch_mult": mult, "mode": mode, "shared": shared}
        return [
            step("max-autotune cold", 0, "max-autotune"),
            step("default cold", 0, "default"),
            step("max-autotune, new weights, warm", 1, "max-autotune"),
            step("default, new weights, warm", 1, "default"),
            step("max-autotune, 2x batch, warm", 0, "max-autotune", mult=2),
            step("max-autotune, new weights, shared caches off", 2, "max-autotune", shared=False),
        ]
    raise SystemExit(f"unknown plan {plan!r}: pays:M1,M2,... or caches:M")


class Lane:
    def __init__(self, device: str, state: Path, port: int) -> None:
        from service.store import Store
        from service.store.embedded import EmbeddedRedis

        self.device, self.state, self.port = device, state, port
        self.redis = EmbeddedRedis(state / "redis", port=port + 1).start()
        self.store = Store(self.redis.url)
        self.env = {**os.environ, "AOTC_REDIS_URL": self.redis.url, "AOTC_DATA_DIR": str(state),
                    "AOTC_DEVICE": device, "AOTC_COMPILE_TIMEOUT_S": "1500",
                    "AOTC_CHILD_LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.log = open(state / "lane.log", "ab")
        self.api = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory",
                                     "--port", str(port), "--log-level", "warning"], env=self.env, stdout=self.log,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"

    def pt2_entries(self) -> int:
        return sum(1 for _ in self.store.r.scan_iter(match="pt2:*", count=1000))

    def compile(self, n: int, step: dict[str, Any], path: Path) -> dict[str, Any]:
        """One step: a fresh worker with an empty disk compiles the job, then stops."""
        import httpx

        from client import Client

        flag = "1" if step["shared"] else "0"
        env = {**self.env, "AOTC_WORK_DIR": str(self.state / f"work-{n}"), "AOTC_INDUCTOR_REMOTE_CACHE": flag,
               "AOTC_SHARE_GEMM_TIMINGS": flag}
        worker = subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                  cwd=ROOT)
        try:
            deadline = time.monotonic() + 180
            while not any(w["pid"] == worker.pid for w in self.store.workers.live()):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("worker did not register")
                time.sleep(0.5)
            before = self.pt2_entries()
            with Client(self.url, cache_dir=self.state / "client-cache", timeout=300) as c:
                rec = c.upload(path)
                shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
                ans = c.submit(rec["id"], shapes, self.device.split(":")[0], mode=step["mode"])
                if ans["status"] == "cached":
                    raise RuntimeError("the artifact was cached already: this step compiled nothing")
                job_id = ans["job"]["id"]
                while (job := c.job(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
                    time.sleep(1)
            if job["state"] != "succeeded":
                err = job.get("error") or {}
                return {"ok": False, "stage": err.get("stage"), "error": (err.get("message") or "")[:1500]}
            meta = httpx.get(f"{self.url}/v1/artifacts/{job['artifact']}/meta", timeout=60).json()
            return {"ok": True, "key": meta["key"], "compile_s": meta["timings"]["compile_total"],
                    "stage_s": meta["timings"], "caches": meta.get("caches"), "artifact_bytes": meta["size"],
                    "check_max_rel_err": (meta.get("check") or {}).get("max_rel_err"),
                    "pt2_entries_written": self.pt2_entries() - before}
        finally:
            worker.terminate()
            worker.wait(120)

    def close(self) -> None:
        self.api.terminate()
        self.api.wait(30)
        self.store.close()
        self.redis.stop()


def _bench_ms(fn: Any, device: str) -> float:
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def latency(url: str, keys: dict[str, str], inputs: tuple[Any, ...], device: str, rounds: int = 3) -> dict[str, float]:
    """Median latency of each artifact, measured in turns (a round of each, `rounds` times) in this process."""
    import torch

    from client import Client

    with tempfile.TemporaryDirectory() as cache, Client(url, cache_dir=cache, timeout=300) as c:
        fns = {label: c.load(key, device=device) for label, key in keys.items()}
    samples: dict[str, list[float]] = {label: [] for label in fns}
    with torch.inference_mode():
        for _ in range(rounds):
            for label, fn in fns.items():
                samples[label].append(_bench_ms(lambda: fn(*inputs), device))
    return {label: statistics.median(v) for label, v in samples.items()}


def run_lane(a: argparse.Namespace) -> int:
    import torch

    from bench.zoo import build

    device = "cpu" if a.gpu < 0 else f"cuda:{a.gpu}"
    if a.gpu >= 0:
        torch.cuda.set_device(a.gpu)
    out = Path(a.out)
    result: dict[str, Any] = {"plan": a.plan, "gpu": a.gpu,
                              "device": torch.cuda.get_device_name(a.gpu) if a.gpu >= 0 else "cpu",
                              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "steps": [],
                              "latency": {}}
    state = Path(a.state).resolve()
    state.mkdir(parents=True, exist_ok=True)
    lane = Lane(device, state, a.port)
    keys: dict[str, dict[str, str]] = {}
    try:
        for n, step in enumerate(plan_steps(a.plan)):
            model, inputs = build(step["model"], step["seed"], step["batch_mult"], device=device)
            path = state / f"{step['model']}-s{step['seed']}-x{step['batch_mult']}.pt2"
            if not path.exists():
                torch.export.save(torch.export.export(model, inputs), str(path))
            row = {**step, **lane.compile(n, step, path)}
            result["steps"].append(row)
            out.write_text(json.dumps(result, indent=1))
            print(f"[gpu {a.gpu}] {step['label']}: ok={row['ok']} compile={row.get('compile_s')} "
                  f"gemm={(row.get('caches') or {}).get('gemm_timings')} pt2+={row.get('pt2_entries_written')}",
                  flush=True)
            if row["ok"] and step["seed"] == 0 and step["batch_mult"] == 1:
                keys.setdefault(step["model"], {})[step["mode"]] = row["key"]
                if len(keys[step["model"]]) == 2:  # default and max-autotune of the same model: race them
                    ms = latency(lane.url, keys[step["model"]], inputs, device)
                    result["latency"][step["model"]] = {**ms,
                                                        "max_autotune_speedup": ms["default"] / ms["max-autotune"]}
                    out.write_text(json.dumps(result, indent=1))
                    print(f"[gpu {a.gpu}] {step['model']} latency ms: {ms}", flush=True)
            del model, inputs
            if a.gpu >= 0:
                torch.cuda.empty_cache()
    finally:
        lane.close()
    return 0


# -- the report ----------------------------------------------------------------------------------------------


def report(paths: list[str]) -> dict[str, Any]:
    lanes = [json.loads(Path(p).read_text()) for p in paths]
    pays, caches = [], []
    for lane in lanes:
        steps = {(s["model"], s["label"]): s for s in lane["steps"]}
        for model, lat in lane["latency"].items():
            d = next(s for s in lane["steps"] if s["model"] == model and s["mode"] == "default" and s["seed"] == 0)
            m = next(s for s in lane["steps"] if s["model"] == model and s["mode"] == "max-autotune" and s["seed"] == 0)
            pays.append({"model": model, "default_ms": lat["default"], "max_autotune_ms": lat["max-autotune"],
                         "speedup": lat["max_autotune_speedup"], "default_compile_s": d["compile_s"],
                         "max_autotune_compile_s": m["compile_s"]})
        if lane["plan"].startswith("caches:"):
            model = lane["plan"].split(":", 1)[1]
            cold = steps.get((model, "max-autotune cold"), {})
            dcold = steps.get((model, "default cold"), {})
            for s in lane["steps"]:
                base = dcold if s["mode"] == "default" else cold
                g = (s.get("caches") or {}).get("gemm_timings") or {}
                caches.append({"model": model, "step": s["label"], "ok": s.get("ok"), "compile_s": s.get("compile_s"),
                               "vs_cold": ((base["compile_s"] / s["compile_s"])
                                           if s.get("ok") and base.get("ok") else None),
                               "gemm_shared": g.get("shared"), "gemm_measured": g.get("measured"),
                               "pt2_entries_written": s.get("pt2_entries_written")})
    print("max-autotune against default (artifact latency, medians of 3 alternating rounds; compile seconds)")
    print(f"{'model':30} {'default ms':>11} {'max-at ms':>10} {'speedup':>8} {'default s':>10} {'max-at s':>9}")
    for r in pays:
        print(f"{r['model']:30} {r['default_ms']:11.3f} {r['max_autotune_ms']:10.3f} {r['speedup']:8.3f} "
              f"{r['default_compile_s']:10.1f} {r['max_autotune_compile_s']:9.1f}")
    print("\ncompile time cold and warm (each step on a fresh worker with an empty disk)")
    print(f"{'model':16} {'step':48} {'compile s':>10} {'cold/this':>10} {'gemm shared':>12} {'gemm timed':>11} "
          f"{'pt2 new':>8}")
    for r in caches:
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "-".rjust(int(f[:-1].split(".")[0]))  # noqa: E731
        print(f"{r['model']:16} {r['step']:48} {fmt(r['compile_s'], '10.1f')} {fmt(r['vs_cold'], '10.2f')} "
              f"{fmt(r['gemm_shared'], '12d')} {fmt(r['gemm_measured'], '11d')} {fmt(r['pt2_entries_written'], '8d')}")
    return {"lanes": [{"plan": lane["plan"], "device": lane["device"], "torch": lane["torch"], "date": lane["date"]}
                      for lane in lanes], "max_autotune": pays, "caches": caches}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", help="pays:M1,M2,... or caches:M")
    ap.add_argument("--gpu", type=int, default=0, help="the lane's GPU; -1: the CPU (a smoke test)")
    ap.add_argument("--port", type=int, default=0, help="the lane's API port (default 8300 + 10 * gpu)")
    ap.add_argument("--out", help="the lane's JSON")
    ap.add_argument("--state", default="", help="service data and exports (default .bench-state/tuning-gpuN)")
    ap.add_argument("--report", nargs="+", help="lane JSON files: print the tables, write --summary")
    ap.add_argument("--summary", default="", help="where --report writes its JSON")
    a = ap.parse_args()
    if a.report:
        s = report(a.report)
        if a.summary:
            Path(a.summary).write_text(json.dumps(s, indent=1))
        return 0
    if not a.plan or not a.out:
        ap.error("--plan and --out are required for a lane")
    a.port = a.port or 8300 + 10 * (a.gpu + 1)
    a.state = a.state or f".bench-state/tuning-gpu{a.gpu}"
    return run_lane(a)


if __name__ == "__main__":
    sys.exit(main())
