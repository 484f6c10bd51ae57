"""Lookup by tag against lookup by id, under wrk, in the same run (issue 20's figure). Prints a table, writes JSON.

It seeds a redis-server (no persistence) with bench/api_load.py's models (each with a static and a dynamic
artifact, and a version `model-N` tagged `prod`), starts `aotc-server --workers 0` on a free loopback port with
auth on (a pull key of the models' namespace), and runs `wrk` with `--connections` keep-alive connections on each
route in turn, alternating the routes `--rounds` times so that both see the same machine; every request goes to a
random model. The routes:

    id        GET /v1/artifacts/lookup?model_id=FULL_ID&target=cpu&shape=x=8x3x64x64   what Client.lookup sends
    tag       GET /v1/refs/model-N:prod/pick?host=cpu-x86_64-v3&shape=x=8x3x64x64&torch=2.13.0
                                                                  what `aotc pull model-N:prod` / Client.load send
    resolve   GET /v1/refs/model-N:prod                            the tag alone, no artifact

    python bench/tag_wrk.py --out bench/results/tag-wrk-2cores.json          # 2,000 models, 3 rounds of 10 s
    python bench/tag_wrk.py --quick --out /tmp/tag-wrk.json                   # a dry run
    python bench/tag_wrk.py --baseline /tmp/main --out ...   # also a server of another tree (`git archive main`),
                                                            # on the same Redis, its rounds alternating with this one's

wrk (`apt-get install wrk`) runs on the same cores as the server: on a small machine it takes its share, as the
load average in the JSON shows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_load import NAMESPACE, TARGET, seed, wait_up  # noqa: E402

ROUTES = ("id", "tag", "resolve")
# Each wrk thread reads the paths, sends each request to a random one, and prints its figures as one JSON line.
SCRIPT = r"""
local paths = {}
local counter = 0
function setup(thread)
  counter = counter + 1
  thread:set("seed", counter)
end
function init(args)
  for line in io.lines(os.getenv("WRK_PATHS")) do paths[#paths + 1] = line end
  math.randomseed(os.time() + (seed or 0) * 7919)
  wrk.headers["Authorization"] = "Bearer " .. os.getenv("WRK_KEY")
end
function request()
  return wrk.format("GET", paths[math.random(#paths)])
end
function done(summary, latency, requests)
  io.write(string.format('JSON {"requests": %d, "duration_us": %d, "non_2xx": %d, "connect_errors": %d, ' ..
    '"read_errors": %d, "write_errors": %d, "timeouts": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"mean_us": %.1f}\n', summary.requests, summary.duration, summary.errors.status, summary.errors.connect,
    summary.errors.read, summary.errors.write, summary.errors.timeout, latency:percentile(50),
    latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


def run_wrk(port: int, key: str, paths: Path, script: Path, connections: int, threads: int,
            seconds: float) -> dict[str, Any]:
    done = subprocess.run(
        ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--latency",
         "-s", str(script), f"http://127.0.0.1:{port}"],
        env={**os.environ, "WRK_PATHS": str(paths), "WRK_KEY": key}, capture_output=True, text=True,
        timeout=seconds + 60, check=True)
    found = re.search(r"^JSON (\{.*\})$", done.stdout, re.M)
    if found is None:
        raise RuntimeError(f"wrk printed no figures:\n{done.stdout}\n{done.stderr}")
    figures = json.loads(found.group(1))
    rps = figures["requests"] / (figures["duration_us"] / 1e6)
    errors = sum(figures[k] for k in ("non_2xx", "connect_errors", "read_errors", "write_errors", "timeouts"))
    return {"rps": round(rps, 1), "p50_ms": figures["p50_us"] / 1000, "p90_ms": figures["p90_us"] / 1000,
            "p99_ms": figures["p99_us"] / 1000, "mean_ms": round(figures["mean_us"] / 1000, 3),
            "requests": figures["requests"], "errors": errors, "wrk": figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=2000)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="wrk's threads")
    ap.add_argument("--seconds", type=float, default=10.0, help="per route and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--baseline", type=Path, default=None, help="another tree's root: its aotc-server runs beside "
                    "this tree's, on the same Redis, and every round measures both")
    ap.add_argument("--quick", action="store_true", help="200 models, 1 round of 3 s")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.quick:
        args.models, args.rounds, args.seconds = min(args.models, 200), 1, 3.0
    if shutil.which("wrk") is None:
        raise SystemExit("tag_wrk.py: needs wrk on PATH (apt-get install wrk)")

    from service.store import Store
    from service.store.embedded import EmbeddedRedis, free_port

    routes = [r for r in args.routes.split(",") if r]
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
        "models": args.models, "connections": args.connections, "wrk_threads": args.threads,
        "seconds_per_cell": args.seconds, "api_workers": args.api_workers,
        "wrk": subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
        "cells": []}
    with tempfile.TemporaryDirectory(prefix="aotc-tag-wrk-") as tmp_s:
        tmp = Path(tmp_s)
        script = tmp / "random.lua"
        script.write_text(SCRIPT)
        with EmbeddedRedis(tmp / "redis", appendonly=False) as redis_srv:
            store = Store(redis_srv.url)
            ids, _ = seed(store, args.models, tmp)
            key = store.apikeys.create("pull", NAMESPACE, "tag-wrk")[1]
            shape = "shape=x=8x3x64x64"
            paths = {
                "id": [f"/v1/artifacts/lookup?model_id={m}&target=cpu&{shape}" for m in ids],
                "tag": [f"/v1/refs/model-{i}:prod/pick?host={TARGET}&{shape}&torch=2.13.0" for i in range(len(ids))],
                "resolve": [f"/v1/refs/model-{i}:prod" for i in range(len(ids))],
            }
            files = {}
            for route, listed in paths.items():
                files[route] = tmp / f"{route}.paths"
                files[route].write_text("\n".join(listed) + "\n")
            trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
            results["trees"] = {name: str(path) for name, path in trees.items()}
            servers: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
            try:
                for name, tree in trees.items():
                    port = free_port()
                    log = tmp / f"server-{name}.log"
                    env = {**os.environ, "AOTC_REDIS_URL": redis_srv.url, "AOTC_DATA_DIR": str(tmp / f"data-{name}"),
                           "AOTC_ADMIN_KEY": secrets.token_urlsafe(24),
                           "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", ""))
                                                         if p)}
                    servers[name] = port, subprocess.Popen(
                        [sys.executable, "-m", "service", "--workers", "0", "--api-workers", str(args.api_workers),
                         "--port", str(port), "--log-level", "warning"],
                        env=env, cwd=tree, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
                    wait_up(f"http://127.0.0.1:{port}", servers[name][1], log)
                    for route in routes:  # a first pass fills each process's memos, as a running service has them
                        run_wrk(port, key, files[route], script, args.connections, args.threads, 2.0)
                for rnd in range(args.rounds):
                    for name, (port, _) in servers.items():
                        for route in routes:
                            cell = {"round": rnd + 1, "tree": name, "route": route, **run_wrk(
                                port, key, files[route], script, args.connections, args.threads, args.seconds)}
                            results["cells"].append(cell)
                            print(f"round {rnd + 1}  {name:8s} {route:8s} {cell['rps']:9.1f} req/s  "
                                  f"p50 {cell['p50_ms']:7.2f} ms  p99 {cell['p99_ms']:7.2f} ms  "
                                  f"errors {cell['errors']}", flush=True)
            finally:
                for _, server in servers.values():
                    server.terminate()
                    try:
                        server.wait(30)
                    except subprocess.TimeoutExpired:
                        server.kill()
            store.close()
    results["loadavg_after"] = os.getloadavg()
    results["medians"] = []
    print(f"\n{'tree':8s} {'route':8s} {'req/s':>9s} {'p50 ms':>8s} {'p99 ms':>8s} {'errors':>6s} {'vs id':>6s}   "
          f"(medians of {args.rounds} round(s), {args.connections} connections)")
    for name in results["trees"]:
        base = None
        for route in routes:
            cells = [c for c in results["cells"] if c["tree"] == name and c["route"] == route]
            m: dict[str, Any] = {"tree": name, "route": route,
                                 **{k: statistics.median(c[k] for c in cells) for k in ("rps", "p50_ms", "p99_ms")},
                                 "errors": sum(c["errors"] for c in cells)}
            base = m["rps"] if route == "id" else base
            m["rps_vs_id"] = round(m["rps"] / base, 3) if base else None
            results["medians"].append(m)
            ratio = f"{m['rps_vs_id']:.2f}" if m["rps_vs_id"] is not None else "-"
            print(f"{name:8s} {route:8s} {m['rps']:>9.1f} {m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['errors']:>6d} "
                  f"{ratio:>6s}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
