"""Downloads per blob store: how fast a package comes down (one stream, and 16 at once), what the API's memory does
meanwhile, and how long a restart takes with the package stored. On loopback, on this machine.

    .venv/bin/python bench/download.py                                  # 200 MB package, redis, file and s3
    .venv/bin/python bench/download.py --size-mb 130 --backends file --pulls 9 \
        --out bench/results/download-pull-2cores.json                   # the verified pull, main against now
    .venv/bin/python bench/download.py --size-mb 16 --backends redis,file --out /tmp/dl.json   # a dry run

Each backend gets its own embedded redis-server (AOF on, as `aotc-server` runs it) and its own API process
(uvicorn, as the tests start it); `s3` also gets moto's S3 server, and its downloads are 307 redirects followed to
moto, so its MB/s measure moto's Python server, not what a real object store serves. Columns:

- `1 stream MB/s`: one GET of the whole package, read into a reused 1 MB buffer (http.client, no hashing); the
  best of --repeat runs.
- `16 streams MB/s`: 16 such GETs at once, in threads: 16 x size / wall time; the best of --repeat runs.
- `plain MB/s`, `sha256 MB/s`, `pull main MB/s`, `pull MB/s`, `x`: medians of --pulls rounds, each taking in turn one
  plain GET (as `1 stream`), a sha256 of the pulled file (page cache warm), `Client.pull` into an empty cache as
  git revision --before had it (default main: its client/sdk.py, loaded from git) and as it is now (signature and
  sha256 verified, written to disk); `x` is the speed-up, from the medians.
- `CPU s/GB main`, `CPU s/GB`: the pulling process's CPU time (all its threads) per 10^9 bytes pulled, medians: what
  a pull costs whatever else the machine runs, where MB/s on a shared box measure the share it got.
- `cached main s`, `cached s`: a second pull of the same artifact, which the local cache answers: the manifest's
  signature is checked again; main hashed the whole file again, now its verified record is checked.
- `API RSS +MB`: the API process's peak RSS during all those downloads, less its RSS before them.
- `redis MB`: Redis's used_memory with the package stored.
- `restart s`: stop Redis and the API, start them again: until Redis serves reads (its AOF loaded) and /readyz answers.

Targets (issue 12): >= 1 GB/s for one stream and for 16 together, API growth < 64 MB.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from compiler.digests import file_digests  # noqa: E402
from compiler.signing import Signer, key_record, statement  # noqa: E402
from service.store import StorageOptions, Store  # noqa: E402
from service.store.embedded import EmbeddedRedis, free_port  # noqa: E402

S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUF = 1 << 20
SIGNER = Signer.generate()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer in {timeout} s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str) -> int:
    """GET into a reused buffer, following one redirect (S3); returns the bytes read."""
    buf = bytearray(BUF)
    view = memoryview(buf)
    for _ in range(2):
        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        conn.request("GET", u.path + (f"?{u.query}" if u.query else ""))
        resp = conn.getresponse()
        if resp.status in (301, 302, 307, 308):
            url = resp.getheader("location") or ""
            resp.read()
            conn.close()
            continue
        if resp.status != 200:
            raise RuntimeError(f"GET {url}: {resp.status} {resp.read()[:300]!r}")
        n = 0
        while got := resp.readinto(view):
            n += got
        conn.close()
        return n
    raise RuntimeError(f"GET {url}: too many redirects")


def _sdk_at(rev: str) -> Any:
    """client/sdk.py as it is at git revision `rev` (its Client), to time the pull it had beside today's."""
    import importlib.util

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:client/sdk.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="aotc-sdk-")) / f"sdk_{rev.replace('/', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Client


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_pulls(url: str, key: str, size: int, base: Path, rounds: int, before: str,
                  api_pid: int, streamed: tuple[str, int] | None = None) -> dict[str, Any]:
    """`rounds` rounds, each in turn: plain HTTP (no hash, no disk), sha256 of the pulled file (warm page cache),
    `Client.pull` at `before` and now (each into an empty cache: the whole download, signature and sha256
    verified), then a pull the cache answers, at `before` and now (the manifest's signature checked again; the
    file's bytes hashed again before, its verified record checked now). With `streamed` (the URL and pid of a
    second API process with uvicorn's own httptools protocol, which has no sendfile: every blob streamed in pieces,
    as before), each round also takes a plain GET and today's pull from it. Medians in MB/s (10^6 bytes) and
    seconds."""
    from client import Client

    Before = _sdk_at(before)
    times: dict[str, list[float]] = {k: [] for k in ("plain", "sha256", "pull_before", "pull_now",
                                                     "cached_before", "cached_now", "cpu_before", "cpu_now",
                                                     "api_cpu_plain", "api_cpu_now", "plain_streamed",
                                                     "pull_streamed", "cpu_streamed", "api_cpu_plain_streamed",
                                                     "api_cpu_pull_streamed")}
    for _ in range(rounds):
        if streamed is not None:
            s_url, s_pid = streamed
            t0, a0 = time.perf_counter(), _proc_cpu(s_pid)
            assert _get(f"{s_url}/v1/artifacts/{key}") == size
            times["plain_streamed"].append(time.perf_counter() - t0)
            times["api_cpu_plain_streamed"].append(_proc_cpu(s_pid) - a0)
            shutil.rmtree(base / "client-streamed", ignore_errors=True)
            with Client(s_url, cache_dir=base / "client-streamed", timeout=120) as c:
                t0, c0, a0 = time.perf_counter(), time.process_time(), _proc_cpu(s_pid)
                assert c.pull(key).stat().st_size == size
                times["pull_streamed"].append(time.perf_counter() - t0)
                times["cpu_streamed"].append(time.process_time() - c0)
                times["api_cpu_pull_streamed"].append(_proc_cpu(s_pid) - a0)
        t0, a0 = time.perf_counter(), _proc_cpu(api_pid)
        assert _get(f"{url}/v1/artifacts/{key}") == size
        times["plain"].append(time.perf_counter() - t0)
        times["api_cpu_plain"].append(_proc_cpu(api_pid) - a0)  # what serving the bytes costs the API
        for name, cls in (("before", Before), ("now", Client)):
            cache = base / f"client-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            with cls(url, cache_dir=cache, timeout=120) as c:
                t0, c0, a0 = time.perf_counter(), time.process_time(), _proc_cpu(api_pid)
                path = c.pull(key)
                times[f"pull_{name}"].append(time.perf_counter() - t0)
                times[f"cpu_{name}"].append(time.process_time() - c0)  # this process's CPU, all its threads
                if name == "now":
                    times["api_cpu_now"].append(_proc_cpu(api_pid) - a0)
                assert path.stat().st_size == size
                t0 = time.perf_counter()
                c.pull(key)
                times[f"cached_{name}"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            hashlib.file_digest(f, "sha256")
        times["sha256"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    extra = {} if streamed is None else {
        "streamed_plain_mb_s": round(size / med["plain_streamed"] / 1e6, 1),
        "streamed_pull_mb_s": round(size / med["pull_streamed"] / 1e6, 1),
        "streamed_client_cpu_s_per_gb": round(med["cpu_streamed"] / size * 1e9, 3),
        "streamed_api_cpu_plain_s_per_gb": round(med["api_cpu_plain_streamed"] / size * 1e9, 3),
        "streamed_api_cpu_pull_s_per_gb": round(med["api_cpu_pull_streamed"] / size * 1e9, 3),
        "streamed_ceiling_two_idle_cores_mb_s": round(
            2 * size / (med["cpu_streamed"] + med["api_cpu_pull_streamed"]) / 1e6, 1)}
    return {**extra, "pull_rounds": rounds, "before": before,
            "times_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "plain_mb_s": round(size / med["plain"] / 1e6, 1), "sha256_mb_s": round(size / med["sha256"] / 1e6, 1),
            "pull_before_mb_s": round(size / med["pull_before"] / 1e6, 1),
            "pull_mb_s": round(size / med["pull_now"] / 1e6, 1),
            "pull_speedup": round(med["pull_before"] / med["pull_now"], 2),
            "cached_before_s": round(med["cached_before"], 4), "cached_now_s": round(med["cached_now"], 4),
            "client_cpu_before_s_per_gb": round(med["cpu_before"] / size * 1e9, 3),
            "client_cpu_now_s_per_gb": round(med["cpu_now"] / size * 1e9, 3),
            # The API process's CPU per GB served (clock ticks: 10 ms grain), plain GET and the pull: with the
            # client's, what one verified GB costs the machine, so the rate two idle cores would allow.
            "api_cpu_plain_s_per_gb": round(med["api_cpu_plain"] / size * 1e9, 3),
            "api_cpu_pull_s_per_gb": round(med["api_cpu_now"] / size * 1e9, 3),
            "ceiling_two_idle_cores_mb_s": round(2 * size / (med["cpu_now"] + med["api_cpu_now"]) / 1e6, 1)}


class Peak:
    """The peak RSS of a process while it runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


class Lane:
    """One backend's service: Redis, (moto,) the API."""

    def __init__(self, backend: str, base: Path) -> None:
        self.backend, self.base = backend, base
        self.redis = EmbeddedRedis(base / "redis").start()
        self.moto: subprocess.Popen[bytes] | None = None
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # a GPU host's wheels
        self.env = {**os.environ, "PYTHONPATH": path, "AOTC_REDIS_URL": self.redis.url,
                    "AOTC_DATA_DIR": str(base), "AOTC_REAPER": "false"}
        if backend == "redis":
            self.env["AOTC_BLOB_STORE"] = "redis"
        elif backend == "file":
            self.env["AOTC_BLOB_STORE"] = f"file://{base}/blobs"
        elif backend == "s3":
            port = free_port()
            self.moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_http(f"http://127.0.0.1:{port}", self.moto)
            self.env.update(S3_ENV, AOTC_BLOB_STORE="s3://bench/blobs",
                            AOTC_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        else:
            raise SystemExit(f"unknown backend {backend!r}: redis, file or s3")
        self.api: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.streamed: subprocess.Popen[bytes] | None = None  # --compare-streamed: a second API process

    def start_api(self, http: str = "service.api.http:HttpToolsProtocol") -> float:
        """The API as aotc-server runs it (its HTTP protocol, which sends file blobs with sendfile), or with
        `http="httptools"` uvicorn's own protocol, which streams every blob in pieces."""
        port = free_port()
        t0 = time.monotonic()
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", "--http", http],
            env=self.env, cwd=ROOT, stdout=open(self.base / "api.log", "ab"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.api.poll() is not None:
                raise RuntimeError(f"the API exited: {(self.base / 'api.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError("the API did not become ready")

    def store(self) -> Store:
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("AWS_")})
        return Store(self.redis.url, storage=StorageOptions(
            blob_store=self.env["AOTC_BLOB_STORE"], s3_endpoint_url=self.env.get("AOTC_S3_ENDPOINT_URL")))

    def publish(self, size: int) -> tuple[str, str]:
        path = self.base / "package.pt2"
        with open(path, "wb") as f:
            left = size
            while left:
                piece = os.urandom(min(left, 8 << 20))
                f.write(piece)
                left -= len(piece)
        digests = file_digests(path)
        key = os.urandom(16).hex()
        factors = {"format": 1, "model": "b" * 64, "options": {}, "spec": [], "target": "cpu-bench",
                   "toolchain": {"torch": "bench"}}
        store = self.store()
        # Signed as a worker signs what it publishes (sha256 and BLAKE3): the SDK's pull verifies the manifest
        # before it writes, and the package by its BLAKE3 (unless AOTC_PULL_DIGEST=sha256).
        manifest = SIGNER.sign(statement(
            artifact_key=key, package_sha256=digests["sha256"], package_blake3=digests.get("blake3"),
            package_size=size, model_sha256="b" * 64,
            factors=factors, toolchain=factors["toolchain"], target="cpu-bench", check={}, worker={"id": "bench"}))
        store.signing.publish(key_record(SIGNER.public))
        store.artifacts.put({"key": key, "factors": factors, "model_id": "b" * 64, "target": "cpu-bench",
                             "spec": [], "options": {}, "manifest": manifest}, path)
        store.close()
        path.unlink()
        return key, digests["sha256"]

    def restart(self) -> float:
        """Stop Redis and the API, start both; seconds until Redis serves reads and the API is ready."""
        _stop(self.api)
        self.redis.stop()
        t0 = time.monotonic()
        self.redis.start(timeout_s=600)
        r = redis.Redis.from_url(self.redis.url)
        while True:  # a Redis loading its AOF answers PING but refuses reads with LOADING
            try:
                r.exists("aotc:probe")
                break
            except redis.exceptions.BusyLoadingError:
                time.sleep(0.01)
        r.close()
        self.start_api()
        return time.monotonic() - t0

    def close(self) -> None:
        _stop(self.api)
        _stop(self.streamed)
        self.redis.stop()
        _stop(self.moto)


def run_lane(backend: str, size: int, streams: int, repeat: int, args_pulls: int, before: str,
             compare_streamed: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"aotc-dl-{backend}-") as d:
        lane = Lane(backend, Path(d))
        try:
            lane.start_api()
            key, sha = lane.publish(size)
            url = f"{lane.url}/v1/artifacts/{key}"
            _get(url)  # warm: connections, page cache, the API's first request

            one = many = float("inf")
            assert lane.api is not None
            with Peak(lane.api.pid) as rss:
                for _ in range(repeat):  # the best of `repeat`: the machine may be busy with other work
                    t0 = time.perf_counter()
                    assert _get(url) == size
                    one = min(one, time.perf_counter() - t0)
                for _ in range(repeat):
                    done: list[int] = []
                    threads = [threading.Thread(target=lambda: done.append(_get(url))) for _ in range(streams)]
                    t0 = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    many = min(many, time.perf_counter() - t0)
                    assert done == [size] * streams, "a stream came up short"

            other = None
            if compare_streamed:
                main_api, main_url = lane.api, lane.url
                lane.start_api("httptools")
                assert lane.api is not None
                other, lane.streamed = (lane.url, lane.api.pid), lane.api
                lane.api, lane.url = main_api, main_url
            pulls = measure_pulls(lane.url, key, size, Path(d), args_pulls, before, lane.api.pid, other)
            redis_mb = int(redis.Redis.from_url(lane.redis.url).info("memory")["used_memory"]) / 2**20
            restart = lane.restart()
            return {"backend": backend, "size_bytes": size, "streams": streams, "repeat": repeat, "sha256": sha,
                    "one_stream_mb_s": round(size / one / 1e6, 1),
                    "many_streams_mb_s": round(size * streams / many / 1e6, 1),
                    **pulls,
                    "api_rss_before_mb": round(rss.base / 2**20, 1),
                    "api_rss_growth_mb": round((rss.peak - rss.base) / 2**20, 1),
                    "redis_used_mb": round(redis_mb, 1), "restart_s": round(restart, 2)}
        finally:
            lane.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=200)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="Report the best of this many runs of each measure.")
    ap.add_argument("--backends", default="redis,file,s3")
    ap.add_argument("--pulls", type=int, default=7, help="Rounds of the pull comparison (medians reported).")
    ap.add_argument("--before", default="main", help="The git revision whose client/sdk.py is 'before'.")
    ap.add_argument("--compare-streamed", action="store_true", help="Also pull from a second API process with "
                    "uvicorn's own httptools protocol (every blob streamed in pieces, no sendfile), alternately.")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "download.json")
    args = ap.parse_args()
    size = int(args.size_mb * 2**20)
    rows = []
    for backend in args.backends.split(","):
        print(f"{backend}: {size / 2**20:.0f} MB ...", file=sys.stderr, flush=True)
        rows.append(run_lane(backend, size, args.streams, args.repeat, args.pulls, args.before,
                             args.compare_streamed))
    head: tuple[str, ...] = ("backend", "1 stream MB/s", f"{args.streams} streams MB/s", "plain MB/s", "sha256 MB/s",
            f"pull {args.before} MB/s", "pull MB/s", "x", f"CPU s/GB {args.before}", "CPU s/GB",
            "API CPU s/GB plain", "API CPU s/GB pull", "2-core ceiling MB/s", f"cached {args.before} s", "cached s",
            "API RSS +MB", "redis MB", "restart s")
    table: list[tuple[Any, ...]] = [head] + [
                      (r["backend"], r["one_stream_mb_s"], r["many_streams_mb_s"], r["plain_mb_s"], r["sha256_mb_s"],
                       r["pull_before_mb_s"], r["pull_mb_s"], r["pull_speedup"], r["client_cpu_before_s_per_gb"],
                       r["client_cpu_now_s_per_gb"], r["api_cpu_plain_s_per_gb"], r["api_cpu_pull_s_per_gb"],
                       r["ceiling_two_idle_cores_mb_s"], r["cached_before_s"],
                       r["cached_now_s"], r["api_rss_growth_mb"], r["redis_used_mb"], r["restart_s"])
                      for r in rows]
    if args.compare_streamed:
        head = (*head, "streamed: plain MB/s", "pull MB/s", "client CPU s/GB", "API CPU s/GB plain",
                "API CPU s/GB pull", "2-core ceiling MB/s")
        table = [head] + [(*row, r["streamed_plain_mb_s"], r["streamed_pull_mb_s"],
                           r["streamed_client_cpu_s_per_gb"],
                           r["streamed_api_cpu_plain_s_per_gb"], r["streamed_api_cpu_pull_s_per_gb"],
                           r["streamed_ceiling_two_idle_cores_mb_s"]) for row, r in zip(table[1:], rows)]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg": os.getloadavg()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "size_mb": args.size_mb, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
