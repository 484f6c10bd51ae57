"""Deploy-time read load on the API: lookup by full id, lookup by short id, artifact meta, and by registry name
(resolve a tag; pick the artifact of a tag for a host), at several concurrencies. Prints a table and writes JSON.

It starts its own redis-server (no persistence) and `aotc-server --workers 0 --api-workers N` on free loopback
ports, stores `--models` models with two artifacts each (a static and a dynamic one, so lookup has to rank)
directly through `Store`, then, for each route and concurrency, runs that many keep-alive connections for
`--seconds`, each sending one request after another for a random model. The client is a minimal asyncio HTTP/1.1
client, so that it takes as little of the machine's CPU as possible from the server it measures (httpx costs
several times more per request). Auth is on (a pull key of the namespace that holds the models; --no-auth runs
the API open). Loopback only; bounded in count (`--max-requests` per cell) and time.

    python bench/api_load.py --out bench/results/api-load.json              # 10,000 models, ~2 minutes of load
    python bench/api_load.py --quick --out /tmp/api-load.json               # a dry run: 500 models, ~20 s
    python bench/api_load.py --api-workers 1,2 --out ...                    # compare API process counts
    python bench/api_load.py --stacks h11/asyncio,httptools/uvloop --rounds 3 --routes lookup_full_id \
        --concurrency 32 --out bench/results/api-load-stacks-2cores.json   # HTTP parser and loop (AOTC_HTTP/LOOP)
    python bench/api_load.py --client wrk --tree /work/main --tree . --rounds 3 --routes lookup_full_id \
        --concurrency 32 --out ...   # another checkout's server against this one's, load from wrk

`--client wrk` drives the load with wrk (the Debian package; one thread, a Lua script that picks a random path per
request and prints its own JSON): a C client that leaves more of a small machine to the server than the asyncio
client does. wrk has no warm-up of its own, so each cell runs it twice: `--warmup-s` unmeasured, then measured.

On a shared machine, what other processes take shows in the numbers: the JSON records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROUTES = ("lookup_full_id", "lookup_short_id", "meta", "resolve_tag", "pick_tag")
NAMESPACE = "bench"
X = {"symbol": "s0", "min": 1, "max": 64}
TARGET = "cpu-x86_64-v3"  # a level, as today's workers label CPU packages: lookup serves no old label's


def seed(store: Any, n: int, tmp: Path) -> tuple[list[str], list[str]]:
    """`n` models, each with a static (batch 8) and a dynamic (batch 1..32) artifact. Returns (model ids, keys)."""
    from compiler import cachekey

    package = tmp / "package.pt2"
    package.write_bytes(os.urandom(4096))
    rng = random.Random(0)
    ids, art_keys = [], []
    for i in range(n):
        model_id = f"{rng.getrandbits(256):064x}"
        store.models.put({"id": model_id, "name": f"model-{i}", "size": 4096, "created": time.time(),
                          "inputs": [{"name": "x", "dtype": "float32", "shape": [X, 3, 64, 64]}]})
        store.namespaces.add_model(NAMESPACE, model_id, f"model-{i}")
        for dims in ([8, 3, 64, 64], [{"min": 1, "max": 32}, 3, 64, 64]):
            spec = [{"name": "x", "dtype": "float32", "shape": dims}]
            options = {"mode": "default", "precision": "keep", "freezing": False}
            factors = cachekey.factors(model_id, spec, TARGET, {"torch": "2.13.0"}, options)
            key = cachekey.cache_key(factors)
            store.artifacts.put({
                "key": key, "factors": factors, "model_id": model_id, "target": TARGET, "spec": spec,
                "options": options, "dynamic_dims": [], "timings": {"compile_total": 12.5, "check": 1.5},
                "check": {"passed": True, "max_error": 1e-6, "eager_ms": 1.2, "compiled_ms": 0.8},
                "worker": {"id": "bench", "device_name": "Bench CPU", "host": "bench"}, "job_id": "0" * 32,
            }, package)
            art_keys.append(key)
        ids.append(model_id)
        store.names.add_version(NAMESPACE, f"model-{i}", model_id, "bench", tags=["prod"])  # model-{i}:prod
    return ids, art_keys


class Conn:
    """One keep-alive HTTP/1.1 connection: GET, read the status and a Content-Length body."""

    def __init__(self, host: str, port: int, key: str) -> None:
        self.host, self.port = host, port
        self.auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.auth}\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_cell(host: str, port: int, key: str, paths: list[str], concurrency: int, seconds: float,
                   warmup_s: float, max_requests: int, meter: Callable[[], tuple[float, float]]) -> dict[str, Any]:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    measuring = False
    stop_at = 0.0

    async def user(seed_: int) -> None:
        rng = random.Random(seed_)
        conn = Conn(host, port, key)
        try:
            while True:
                now = time.perf_counter()
                if measuring and (now >= stop_at or len(latencies) >= max_requests):
                    return
                t0 = time.perf_counter()
                status = await conn.get(rng.choice(paths))
                if measuring:
                    latencies.append(time.perf_counter() - t0)
                    statuses[status] = statuses.get(status, 0) + 1
        finally:
            conn.close()

    tasks = [asyncio.create_task(user(i)) for i in range(concurrency)]
    await asyncio.sleep(warmup_s)
    cpu0, t0, server0 = os.times(), time.perf_counter(), meter()
    stop_at = t0 + seconds
    measuring = True
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    cpu1, server1 = os.times(), meter()
    latencies.sort()

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else float("nan")

    errors = sum(n for st, n in statuses.items() if st != 200)
    return {"concurrency": concurrency, "requests": len(latencies), "errors": errors,
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "seconds": round(elapsed, 3), "rps": round(len(latencies) / elapsed, 1),
            "p50_ms": round(pct(0.50), 3), "p99_ms": round(pct(0.99), 3),
            "mean_ms": round(statistics.fmean(latencies) * 1000, 3) if latencies else None,
            "client_cpu_s": round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), 2),
            **_server_cpu(server0, server1, len(latencies))}


def _server_cpu(before: tuple[float, float], after: tuple[float, float], requests: int) -> dict[str, float]:
    """CPU per measured request of the API processes and of Redis: what a request costs, whatever else the shared
    machine runs (the rates move with that; this moves less)."""
    n = max(1, requests)
    return {"api_cpu_us_per_req": round((after[0] - before[0]) * 1e6 / n, 1),
            "redis_cpu_us_per_req": round((after[1] - before[1]) * 1e6 / n, 1)}


_WRK_SCRIPT = """
local paths = {%s}
local auth = %s
math.randomseed(os.time())
if auth ~= "" then wrk.headers["Authorization"] = "Bearer " .. auth end
request = function()
  return wrk.format("GET", paths[math.random(#paths)])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\\"requests\\": %%d, \\"duration_us\\": %%d, \\"p50_us\\": %%d, \\"p99_us\\": %%d, "
    .. "\\"mean_us\\": %%f, \\"non2xx\\": %%d, \\"socket_errors\\": %%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    e.status, e.connect + e.read + e.write + e.timeout))
end
"""


def run_wrk(url: str, key: str, paths: list[str], concurrency: int, seconds: float, warmup_s: float,
            tmp: Path, meter: Callable[[], tuple[float, float]], api_pids: list[int]) -> dict[str, Any]:
    """One cell with wrk: a warm-up run, then the measured one. Latency percentiles are wrk's own (HdrHistogram)."""
    import resource

    script = tmp / "paths.lua"
    script.write_text(_WRK_SCRIPT % (",".join(json.dumps(p) for p in paths), json.dumps(key)))

    def wrk(duration: float) -> tuple[dict[str, Any], list[int]]:
        proc = subprocess.Popen(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s", "--timeout",
                                 "10s", "-s", str(script), url], stdout=subprocess.PIPE, text=True)
        time.sleep(min(1.0, duration / 2))
        spread = connections(api_pids, int(url.rsplit(":", 1)[1]))  # wrk's connections, each API process's share
        out, _ = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, out)
        return dict(json.loads(next(ln for ln in out.splitlines() if ln.startswith("WRKJSON "))[8:])), spread

    if warmup_s > 0:
        wrk(warmup_s)
    r0, server0 = resource.getrusage(resource.RUSAGE_CHILDREN), meter()
    m, spread = wrk(seconds)
    r1, server1 = resource.getrusage(resource.RUSAGE_CHILDREN), meter()
    elapsed = m["duration_us"] / 1e6
    errors = m["non2xx"] + m["socket_errors"]
    return {"concurrency": concurrency, "requests": m["requests"], "errors": errors,
            "statuses": {"non2xx": m["non2xx"], "socket_errors": m["socket_errors"]},
            "seconds": round(elapsed, 3), "rps": round(m["requests"] / elapsed, 1),
            "p50_ms": round(m["p50_us"] / 1000, 3), "p99_ms": round(m["p99_us"] / 1000, 3),
            "mean_ms": round(m["mean_us"] / 1000, 3),
            "client_cpu_s": round((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), 2),
            "connections_per_api": spread, **_server_cpu(server0, server1, m["requests"])}


def connections(pids: list[int], port: int) -> list[int]:
    """How many established connections to `port` each of `pids` holds (Linux /proc): how the kernel spread a
    closed-loop client's keep-alive connections over API processes that accept on one socket."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED, our side
                    inodes.add(fields[9])
    counts = []
    for pid in pids:
        n = 0
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    n += link.startswith("socket:[") and link[8:-1] in inodes
        counts.append(n)
    return counts


def _family(pid: int) -> list[int]:
    """`pid` and its children (Linux /proc): aotc-server and its API processes."""
    pids = [pid]
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                pids.append(int(d))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> list[float]:
    """Resident memory of aotc-server and its API processes (Linux /proc), after the load: what the memos hold."""
    pids = _family(pid)
    out = []
    for p in pids:
        try:
            line = next(ln for ln in Path(f"/proc/{p}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
            out.append(round(int(line.split()[1]) / 1024, 1))
        except (OSError, StopIteration):
            continue
    return out


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"aotc-server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"aotc-server did not answer in {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=10_000)
    ap.add_argument("--concurrency", default="1,8,32,128", help="comma-separated")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured time per route and concurrency")
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--max-requests", type=int, default=200_000, help="per route and concurrency")
    ap.add_argument("--api-workers", default="2", help="aotc-server --api-workers; comma-separated to compare")
    ap.add_argument("--routes", default=",".join(ROUTES))
    ap.add_argument("--stacks", default="auto/auto", help="HTTP parser/event loop pairs (AOTC_HTTP/AOTC_LOOP), "
                    "comma-separated to compare, e.g. h11/asyncio,httptools/uvloop")
    ap.add_argument("--rounds", type=int, default=1, help="Run every stack this many times, alternately.")
    ap.add_argument("--quick", action="store_true", help="a dry run: 500 models, 1.5 s per cell")
    ap.add_argument("--client", choices=("asyncio", "wrk"), default="asyncio", help="the load generator")
    ap.add_argument("--tree", action="append", type=Path, help="run the server of this checkout (repeat to "
                    "compare, alternating rounds); default: this one")
    ap.add_argument("--no-auth", dest="auth", action="store_false", help="run the API open (no keys)")
    ap.add_argument("--out", type=Path, required=True, help="JSON results")
    args = ap.parse_args()
    if args.quick:
        args.models, args.seconds, args.warmup_s = min(args.models, 500), 1.5, 0.5

    from service.store import Store
    from service.store.embedded import EmbeddedRedis, free_port

    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(),
        "models": args.models, "artifacts_per_model": 2, "seconds_per_cell": args.seconds, "client": args.client,
        "cells": []}
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    results["trees"] = [str(t) for t in trees]
    routes = [r for r in args.routes.split(",") if r]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="aotc-api-load-") as tmp_s:
        tmp = Path(tmp_s)
        with EmbeddedRedis(tmp / "redis", appendonly=False) as redis_srv:
            store = Store(redis_srv.url)
            t0 = time.perf_counter()
            ids, art_keys = seed(store, args.models, tmp)
            results["seed_s"] = round(time.perf_counter() - t0, 1)
            # Auth on, as deployed: the load sends a pull key of the namespace that holds the models, so every
            # request also pays for checking the key and that its namespace holds the model.
            key = store.apikeys.create("pull", NAMESPACE, "api-load")[1] if args.auth else ""
            results["auth"] = args.auth
            print(f"stored {len(ids)} models and {len(art_keys)} artifacts in {results['seed_s']} s", flush=True)
            paths = {
                "lookup_full_id": [f"/v1/artifacts/lookup?model_id={m}&target=cpu&shape=x=8x3x64x64" for m in ids],
                "lookup_short_id": [f"/v1/artifacts/lookup?model_id={m[:12]}&target=cpu&shape=x=8x3x64x64"
                                    for m in ids],
                "meta": [f"/v1/artifacts/{k}/meta" for k in art_keys],
                "resolve_tag": [f"/v1/refs/model-{i}:prod" for i in range(len(ids))],
                "pick_tag": [f"/v1/refs/model-{i}:prod/pick?host={TARGET}&shape=x=8x3x64x64&torch=2.13.0"
                             for i in range(len(ids))],
            }
            runs = [(r, tree, stack, int(w)) for r in range(args.rounds) for tree in trees
                    for stack in args.stacks.split(",") for w in args.api_workers.split(",")]
            for rnd, tree, stack, n_api in runs:
                http_impl, loop = stack.split("/")
                port = free_port()
                log = tmp / f"server-{n_api}.log"
                env = {**os.environ, "AOTC_REDIS_URL": redis_srv.url, "AOTC_DATA_DIR": str(tmp / "data"),
                       "AOTC_HTTP": http_impl, "AOTC_LOOP": loop,
                       **({"AOTC_ADMIN_KEY": secrets.token_urlsafe(24)} if args.auth else {}),
                       "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
                server = subprocess.Popen(
                    [sys.executable, "-m", "service", "--workers", "0", "--api-workers", str(n_api),
                     "--port", str(port), "--log-level", "warning"],
                    env=env, cwd=tree, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
                try:
                    wait_up(f"http://127.0.0.1:{port}", server, log)
                    for route in routes:
                        for c in concurrencies:
                            api_pids = _family(server.pid)
                            redis_pids = [redis_srv.proc.pid] if redis_srv.proc else []

                            def meter() -> tuple[float, float]:
                                return cpu_s(api_pids), cpu_s(redis_pids)  # noqa: B023 - called within the cell

                            if args.client == "wrk":
                                cell = run_wrk(f"http://127.0.0.1:{port}", key, paths[route], c, args.seconds,
                                               args.warmup_s, tmp, meter, api_pids[1:] or api_pids)
                            else:
                                cell = asyncio.run(run_cell("127.0.0.1", port, key, paths[route], c, args.seconds,
                                                            args.warmup_s, args.max_requests, meter))
                            cell = {"tree": str(tree), "stack": stack, "round": rnd + 1, "api_workers": n_api,
                                    "route": route, **cell}
                            results["cells"].append(cell)
                            print(f"{tree.name:12s} {stack:18s} round {rnd + 1} api-workers {n_api}  {route:16s} "
                                  f"c={c:<4d} "
                                  f"{cell['rps']:9.1f} req/s  "
                                  f"p50 {cell['p50_ms']:8.2f} ms  p99 {cell['p99_ms']:8.2f} ms  "
                                  f"API {cell['api_cpu_us_per_req']:6.0f} us/req  "
                                  f"errors {cell['errors']}", flush=True)
                    results.setdefault("api_rss_mb", {})[f"{tree} {stack} {n_api}"] = _rss_mb(server.pid)
                finally:
                    server.terminate()
                    try:
                        server.wait(30)
                    except subprocess.TimeoutExpired:
                        server.kill()
            store.close()
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n{'tree':12s} {'stack':18s} {'api':>3s}  {'route':16s} {'conc':>5s} {'req/s':>9s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'errors':>6s} {'API us/req':>10s} {'Redis us/req':>12s}   "
          f"(medians over {args.rounds} round(s))")
    groups: dict[tuple[str, str, int, str, int], list[dict[str, Any]]] = {}
    for c in results["cells"]:
        groups.setdefault((c["tree"], c["stack"], c["api_workers"], c["route"], c["concurrency"]), []).append(c)
    results["medians"] = []
    for (tree_s, stack, n_api, route, conc), cells in groups.items():
        m = {"tree": tree_s, "stack": stack, "api_workers": n_api, "route": route, "concurrency": conc,
             **{k: statistics.median(c[k] for c in cells)
                for k in ("rps", "p50_ms", "p99_ms", "api_cpu_us_per_req", "redis_cpu_us_per_req")},
             "errors": sum(c["errors"] for c in cells)}
        results["medians"].append(m)
        print(f"{Path(tree_s).name:12s} {stack:18s} {n_api:>3d}  {route:16s} {conc:>5d} {m['rps']:>9.1f} "
              f"{m['p50_ms']:>8.2f} {m['p99_ms']:>8.2f} {m['errors']:>6d} {m['api_cpu_us_per_req']:>10.0f} "
              f"{m['redis_cpu_us_per_req']:>12.0f}")
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
