"""Can one key's event streams starve other tenants? Other tenants' deploy-time lookups, measured alone and then
beside `--streams` open event streams that one key holds on its own queued job. Prints a table and writes JSON.

For each `--tree` (a checkout: this one, and e.g. /work/main to compare), it starts that tree's `aotc-server
--workers 0` (an embedded Redis, `--api-workers` API processes, default 2 as shipped) on free loopback ports, with
auth on and AOTC_MAX_STREAMS_PER_KEY raised past `--streams` (a tree without the cap ignores it). A made-up
target has a registry record and no worker, so key A's compile request stays queued; key B (another namespace)
holds a model with an artifact. Then:

1. B's lookups alone: `--concurrency` keep-alive connections for `--seconds` (bench/api_load.py's client);
2. A opens `--streams` event streams on its job (raw sockets, one asyncio loop) and waits for their first event;
3. B's lookups again, while the streams stay open; then the streams' fate (still open, `unavailable`, refused).

Also recorded: Redis's blocked clients (connections parked in XREAD BLOCK) in each phase: on a tree where each
stream holds a pooled connection it counts the streams, with one reader per API process it counts the processes.

    python bench/tenancy_streams.py --tree . --tree /work/main --out bench/results/tenancy-streams-2cores.json

The server runs each tree's own code (its `service` package, with this interpreter). On a shared machine the
load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_load import run_cell, wait_up  # noqa: E402

TARGET = "cpu-bench-nobody"
ART_TARGET = "cpu-x86_64-avx2"
INPUTS = [{"name": "x", "dtype": "float32", "shape": [{"symbol": "s0", "min": 1, "max": 64}, 4]}]


class Stream:
    """One event stream on a raw socket: its status, whether its first event came, and how it ended."""

    def __init__(self) -> None:
        self.status = 0
        self.opened = asyncio.Event()
        self.events: list[str] = []
        self.closed = False

    async def run(self, port: int, key: str, job_id: str) -> None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n"
                         f"Authorization: Bearer {key}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            self.status = int(head[9:12])
            if self.status != 200:
                return
            while line := await reader.readline():
                if line.startswith(b"event: "):
                    self.events.append(line[7:].strip().decode())
                    self.opened.set()
            self.closed = True
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self.closed = True
        finally:
            self.opened.set()


def _redis_clients(redis_url: str) -> dict[str, int]:
    """Redis's connected clients, and those blocked in a read (XREAD BLOCK): a stream that holds a connection."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        info = r.info("clients")
        return {"connected": int(info["connected_clients"]), "blocked": int(info["blocked_clients"])}
    finally:
        r.close()


async def _with_streams(port: int, a_key: str, job_id: str, n: int, b_key: str, paths: list[str],
                        concurrency: int, seconds: float, redis_url: str) -> dict[str, Any]:
    streams = [Stream() for _ in range(n)]
    tasks = [asyncio.create_task(s.run(port, a_key, job_id)) for s in streams]
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(s.opened.wait() for s in streams)), 60)
    except TimeoutError:
        pass
    opened_s = time.perf_counter() - t0
    await asyncio.sleep(2.0)  # past their history: waiting live
    clients = await asyncio.to_thread(_redis_clients, redis_url)
    cell = await run_cell("127.0.0.1", port, b_key, paths, concurrency, seconds, 1.0, 1_000_000)
    fate = {"open_200": sum(s.status == 200 and not s.closed for s in streams),
            "refused": sum(s.status not in (0, 200) for s in streams),
            "ended_unavailable": sum("unavailable" in s.events for s in streams),
            "closed": sum(s.closed for s in streams), "first_event_s": round(opened_s, 2)}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {**cell, "streams": fate, "redis_clients": clients}


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from service.store import Store
    from service.store.embedded import free_port
    from service.store.redis_url import with_password_file

    out: dict[str, Any] = {"tree": str(tree), "commit": subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
    with tempfile.TemporaryDirectory(prefix="aotc-tenancy-bench-") as tmp_s:
        tmp = Path(tmp_s)
        port, redis_port = free_port(), free_port()
        admin = secrets.token_urlsafe(24)
        env = {**{k: v for k, v in os.environ.items() if k != "AOTC_REDIS_URL"},
               "AOTC_DATA_DIR": str(tmp / "data"), "AOTC_ADMIN_KEY": admin, "PYTHONPATH": str(tree),
               "AOTC_MAX_STREAMS_PER_KEY": str(args.streams + 100)}
        log = tmp / "server.log"
        server = subprocess.Popen(
            [sys.executable, "-m", "service", "--workers", "0", "--api-workers", str(args.api_workers),
             "--port", str(port), "--redis-port", str(redis_port), "--log-level", "warning"],
            env=env, cwd=tree, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_up(url, server, log)
            redis_url = with_password_file(f"redis://127.0.0.1:{redis_port}/0", tmp / "data" / "redis" / "password")
            store = Store(redis_url)
            store.workers.heartbeat({"id": "bench-nobody", "target": TARGET, "toolchain": {"torch": "fake"},
                                     "device_name": "none", "started": time.time()}, ttl_s=3600)
            http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
            a_key = http.post("/v1/keys", json={"scope": "compile", "namespace": "streamer"}).json()["key"]
            b_key = http.post("/v1/keys", json={"scope": "pull", "namespace": "tenant-b"}).json()["key"]
            a_model, b_model = (f"{secrets.randbits(256):064x}" for _ in range(2))
            for model_id, ns in ((a_model, "streamer"), (b_model, "tenant-b")):
                store.models.put({"id": model_id, "name": ns, "size": 1, "created": time.time(), "inputs": INPUTS})
                store.namespaces.add_model(ns, model_id, ns)
            r = httpx.post(f"{url}/v1/compilations", headers={"Authorization": f"Bearer {a_key}"}, timeout=30,
                           json={"model_id": a_model, "shapes": {"x": [2, 4]}, "target": TARGET})
            assert r.status_code == 202, r.text
            job_id = r.json()["job"]["id"]
            _artifact(store, b_model, tmp)
            paths = [f"/v1/artifacts/lookup?model_id={b_model}&target=cpu&shape=x=2x4"]
            assert httpx.get(url + paths[0], headers={"Authorization": f"Bearer {b_key}"}).status_code == 200

            alone = asyncio.run(run_cell("127.0.0.1", port, b_key, paths, args.concurrency, args.seconds, 1.0,
                                         1_000_000))
            out["alone"] = {**alone, "redis_clients": _redis_clients(redis_url)}
            out["with_streams"] = asyncio.run(_with_streams(port, a_key, job_id, args.streams, b_key, paths,
                                                            args.concurrency, args.seconds, redis_url))
            store.close()
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    return out


def _artifact(store: Any, model_id: str, tmp: Path) -> None:
    from compiler import cachekey

    spec = [{"name": "x", "dtype": "float32", "shape": [2, 4]}]
    options = {"mode": "default", "precision": "keep", "freezing": False}
    factors = cachekey.factors(model_id, spec, ART_TARGET, {"torch": "bench"}, options)
    key = cachekey.cache_key(factors)
    package = tmp / "package.pt2"
    package.write_bytes(os.urandom(4096))
    store.artifacts.put({"key": key, "factors": factors, "model_id": model_id, "target": ART_TARGET, "spec": spec,
                         "options": options, "dynamic_dims": [], "timings": {}, "job_id": "0" * 32,
                         "check": {"passed": True}, "worker": {"id": "bench", "device_name": "cpu", "host": "bench"}},
                        package)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", type=Path, help="a checkout to run the server from (repeatable)")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=8, help="tenant B's keep-alive connections")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time of each lookup phase")
    ap.add_argument("--api-workers", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                               "loadavg_before": os.getloadavg(), "streams": args.streams,
                               "concurrency": args.concurrency, "seconds": args.seconds,
                               "api_workers": args.api_workers, "runs": []}
    for tree in trees:
        print(f"tree {tree} ...", flush=True)
        results["runs"].append(run_tree(tree, args))
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nother tenant's lookups ({args.concurrency} connections, {args.seconds:g} s), alone and beside "
          f"{args.streams} event streams of one key; {args.api_workers} API processes, {os.cpu_count()} CPUs")
    print(f"{'tree':28s} {'phase':14s} {'requests':>8s} {'req/s':>8s} {'p50 ms':>9s} {'p99 ms':>9s} {'5xx':>5s} "
          f"{'blocked conns':>13s} {'streams open':>12s}")
    for run in results["runs"]:
        name = f"{Path(run['tree']).name}@{run['commit']}"
        for phase in ("alone", "with_streams"):
            c = run[phase]
            fivexx = sum(n for st, n in c["statuses"].items() if st.startswith("5"))
            open_ = c["streams"]["open_200"] if phase == "with_streams" else "-"
            print(f"{name:28s} {phase:14s} {c['requests']:>8d} {c['rps']:>8.1f} {c['p50_ms']:>9.2f} "
                  f"{c['p99_ms']:>9.2f} {fivexx:>5d} {c['redis_clients']['blocked']:>13d} {open_!s:>12s}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
