"""Chaos: the whole service under the faults an operator's bad day brings, and what it lost.

For `--duration-s` (600 by default) clients upload small models, compile them, follow each job's events and pull
and verify each artifact, against a real `aotc-server` (embedded Redis, API processes, workers, sandboxed children)
whose data dir sits on a tmpfs of its own. Meanwhile, at random moments, the script

- `kill -9`s the embedded redis-server, an API process, a worker, a compile child and a check child;
- fills the data disk with a ballast file, holds it full for `--disk-full-s`, then frees it.

Then it stops submitting, waits for every job to end (`--drain-s`), pulls and verifies every artifact, and reports:

- jobs submitted, succeeded, failed (with their reasons);
- jobs lost: not terminal at the end, or succeeded with an artifact that cannot be pulled and verified;
- duplicated artifacts: a key listed twice, more than one stored package for one key, or one request (model,
  shapes, target) that produced two keys;
- 5xx answers by route (503 and 507 are expected while a part is down; 500 never is);
- per fault, the time until the next successful request and until the next successful compile.

It prints a table and writes JSON (`--out`). Needs root for the tmpfs (else the disk fault is skipped, and said
so) and torch (to export the models). Run from the repository root:

    .venv/bin/python bench/chaos.py --out bench/results/chaos-cpu-$(date +%F).json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.store.embedded import free_port  # noqa: E402

ADMIN_KEY = "aotc-chaos-admin-key-5b1e0c9d7a3f4e21"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
FAULTS = ("redis", "api", "worker", "compile_child", "check_child", "disk")
TERMINAL = ("succeeded", "failed", "cancelled")
# Routes as templates, so that 5xx counts group by route and not by id.
_ROUTES = [(re.compile(p), t) for p, t in [
    (r"^/v1/jobs/[^/]+/events$", "/v1/jobs/{id}/events"),
    (r"^/v1/jobs/[^/]+$", "/v1/jobs/{id}"),
    (r"^/v1/artifacts/lookup$", "/v1/artifacts/lookup"),
    (r"^/v1/artifacts/[^/]+/(meta|manifest)$", r"/v1/artifacts/{key}/\1"),
    (r"^/v1/artifacts/[^/]+$", "/v1/artifacts/{key}"),
    (r"^/v1/models/[^/]+$", "/v1/models/{id}"),
]]


def route_of(path: str) -> str:
    for pattern, template in _ROUTES:
        if m := pattern.match(path):
            return m.expand(template)
    return path


# -- what happened ---------------------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the start of the run
    pid: int | None = None
    detail: str = ""
    skipped: str = ""
    next_request_s: float | None = None
    next_compile_s: float | None = None
    answers: dict[str, str] = field(default_factory=dict)  # what the service said while the fault lasted


@dataclass
class Job:
    id: str
    model: str
    shapes: dict[str, Any]
    submitted_at: float
    state: str = "queued"
    attempts: int = 0
    error: str = ""
    artifact: str = ""
    ended_at: float | None = None
    pulled: bool | None = None
    pull_error: str = ""


@dataclass
class Record:
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)  # (method, route, status)
    transport_errors: Counter[str] = field(default_factory=Counter)
    ok_times: list[float] = field(default_factory=list)  # every 2xx, seconds since t0
    jobs: dict[str, Job] = field(default_factory=dict)
    compiled_times: list[float] = field(default_factory=list)  # when a job was seen succeeding
    cache_hits: int = 0
    faults: list[Fault] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def saw(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.statuses[(method, route_of(path), status)] += 1
            if 200 <= status < 300:
                self.ok_times.append(self.now())


class Api:
    """httpx with the admin key, counting every answer by route and status (and every transport error)."""

    def __init__(self, url: str, rec: Record) -> None:
        self.rec = rec
        self.http = httpx.Client(base_url=url, headers=AUTH, timeout=httpx.Timeout(30.0, connect=5.0))

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response | None:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as e:
            with self.rec.lock:
                self.rec.transport_errors[f"{method} {route_of(path)}: {type(e).__name__}"] += 1
            return None
        self.rec.saw(method, path, r.status_code)
        return r


def retry_after(r: httpx.Response | None) -> float:
    if r is None:
        return 1.0
    try:
        return min(5.0, max(0.2, float(r.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


# -- the service -----------------------------------------------------------------------------------------------


class Service:
    """A real aotc-server on a data dir of its own (a tmpfs of `disk_mb` when root can mount one)."""

    def __init__(self, base: Path, disk_mb: int, workers: int, api_workers: int) -> None:
        self.base = base
        self.data = base / "data"
        self.data.mkdir(parents=True)
        self.tmpfs = False
        if os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0700", "tmpfs", str(self.data)],
                               capture_output=True, text=True)
            self.tmpfs = r.returncode == 0
            self.mount_error = r.stderr.strip()
        else:
            self.mount_error = "not root: no tmpfs of a fixed size can be mounted"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The precompiled headers (about 280 MB, built once) live outside the small data disk, as the tests keep
        # them; the low-water mark is a small share of it, so that only the fault fills it.
        env = {**os.environ, "AOTC_DATA_DIR": str(self.data), "AOTC_ADMIN_KEY": ADMIN_KEY,
               "PYTHONPATH": str(ROOT), "AOTC_HEADERS_DIR": str(ROOT / ".aotc" / "test-headers"),
               "AOTC_DISK_LOW_WATER_MB": str(max(16, disk_mb // 8))}
        env.pop("AOTC_REDIS_URL", None)
        self.log = open(base / "server.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(self.port), "--workers", str(workers),
             "--api-workers", str(api_workers), "--device", "cpu", "--log-level", "warning"],
            env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(headers=AUTH, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"aotc-server exited with {self.proc.returncode}; see {self.base}/server.log")
                with contextlib.suppress(httpx.TransportError):
                    if http.get(self.url + "/readyz").status_code == 200:
                        workers = http.get(self.url + "/v1/workers").json().get("workers", [])
                        if workers:
                            return
                time.sleep(0.5)
        raise RuntimeError(f"the service was not ready in {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.data)], check=False)

    # Processes of this service, found in /proc by their command lines and their ancestry.
    def descendants(self) -> list[tuple[int, list[str]]]:
        children: dict[int, list[int]] = {}
        cmd: dict[int, list[str]] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            for c in children.get(pid, []):
                out.append((c, cmd.get(c, [])))
                todo.append(c)
        return out

    def find(self, kind: str) -> int | None:
        procs = self.descendants()
        for pid, argv in procs:
            joined = " ".join(argv)
            if kind == "redis" and "redis-server" in joined:
                return pid
            if kind == "api" and "multiprocessing" in joined and "spawn_main" in joined:
                return pid
            if kind == "worker" and argv[-2:] == ["-m", "worker"]:
                return pid
            if kind in ("compile_child", "check_child") and "worker.child" in argv \
                    and argv[-1] == kind.split("_")[0] and "shim.py" not in joined and "bwrap" not in argv[0]:
                return pid
        return None


# -- clients ---------------------------------------------------------------------------------------------------


def export_models(n: int, out: Path) -> list[Path]:
    """`n` small MLPs (16 -> 64 -> 8, a dynamic batch), each with its own weights: each is a compile of its own."""
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    paths = []
    batch = torch.export.Dim("batch", min=1, max=64)
    for i in range(n):
        torch.manual_seed(1000 + i)
        ep = torch.export.export(MLP().eval(), (torch.randn(4, 16),), dynamic_shapes={"x": {0: batch}})
        p = out / f"mlp-{i:03d}.pt2"
        torch.export.save(ep, str(p))
        paths.append(p)
    return paths


class Clients:
    """Each client thread: upload a model, ask for a compile, follow the job's events to its end, pull and verify
    the artifact; now and then ask again for one already built (a cache hit) and pull that. Every failure is
    retried the way a careful client would (Retry-After on 503/507/429, backoff on a dropped connection)."""

    def __init__(self, url: str, rec: Record, models: list[Path], n: int, cache: Path) -> None:
        self.url, self.rec, self.models, self.n, self.cache = url, rec, models, n, cache
        self.stop = threading.Event()
        self.next_model = 0
        self.model_lock = threading.Lock()
        self.built: list[tuple[str, dict[str, Any]]] = []  # (model id, shapes) compiled, for cache hits
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout_s: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def _pick(self, rng: random.Random) -> Path | None:
        with self.model_lock:
            if self.next_model >= len(self.models):
                return None
            self.next_model += 1
            return self.models[self.next_model - 1]

    def _run(self, n: int) -> None:
        rng = random.Random(n)
        api = Api(self.url, self.rec)
        while not self.stop.is_set():
            if self.built and rng.random() < 0.25:
                held, shapes = rng.choice(self.built)
                self._compile(api, held, shapes)
                continue
            path = self._pick(rng)
            if path is None:
                self.stop.wait(1.0)
                continue
            model_id = self._upload(api, path)
            if model_id is not None:
                self._compile(api, model_id, {"x": [{"min": 1, "max": 32}, 16]})

    def _upload(self, api: Api, path: Path) -> str | None:
        data = path.read_bytes()
        while not self.stop.is_set():
            r = api.call("POST", "/v1/models", content=data, params={"name": path.stem},
                         headers={"content-type": "application/octet-stream"})
            if r is not None and r.status_code in (200, 201):
                return str(r.json()["id"])
            if r is not None and 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                return None  # a refusal this client would not retry; counted by route and status
            time.sleep(retry_after(r))
        return None

    def _compile(self, api: Api, model_id: str, shapes: dict[str, Any]) -> None:
        body = {"model_id": model_id, "shapes": shapes, "target": "cpu"}
        while not self.stop.is_set():
            r = api.call("POST", "/v1/compilations", json=body)
            if r is None or r.status_code >= 500 or r.status_code in (408, 429):
                time.sleep(retry_after(r))
                continue
            if r.status_code >= 400:
                return
            answer = r.json()
            if answer["status"] == "cached":
                with self.rec.lock:
                    self.rec.cache_hits += 1
                self._pull(api, answer["key"], None)
                return
            job_id = answer["job"]["id"]
            with self.rec.lock:
                known = job_id in self.rec.jobs
                if not known:
                    self.rec.jobs[job_id] = Job(job_id, model_id, shapes, self.rec.now())
            if known:  # joined a job another client is following
                return
            self._follow(api, job_id)
            return

    def _follow(self, api: Api, job_id: str) -> None:
        """Follow the job's events to `end` (reconnecting with Last-Event-ID), as the SDK's wait does."""
        last: str | None = None
        job = self.rec.jobs[job_id]
        while job.state not in TERMINAL:
            headers = {"Last-Event-ID": last} if last else {}
            try:
                with api.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers,
                                     timeout=httpx.Timeout(10.0, read=30.0)) as resp:
                    self.rec.saw("GET", f"/v1/jobs/{job_id}/events", resp.status_code)
                    if resp.status_code != 200:
                        time.sleep(retry_after(resp))
                        continue
                    event = ""
                    for line in resp.iter_lines():
                        if line.startswith("id: "):
                            last = line[4:]
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line.startswith("data: ") and event == "end":
                            self._ended(job, json.loads(line[6:]))
                            break
            except httpx.TransportError as e:
                with self.rec.lock:
                    self.rec.transport_errors[f"GET /v1/jobs/{{id}}/events: {type(e).__name__}"] += 1
                time.sleep(1.0)
        if job.state == "succeeded":
            self._pull(api, job.artifact, job)

    def _ended(self, job: Job, record: dict[str, Any] | None) -> None:
        if record is None:
            job.state, job.error = "gone", "the job record is gone"
            return
        job.state, job.attempts, job.ended_at = record["state"], int(record.get("attempts") or 0), self.rec.now()
        job.error = str((record.get("error") or {}).get("message", "")) if isinstance(record.get("error"), dict) \
            else str(record.get("error") or "")
        job.artifact = str(record.get("artifact") or "")
        if job.state == "succeeded":
            with self.rec.lock:
                self.rec.compiled_times.append(job.ended_at)
                self.built.append((job.model, job.shapes))

    def _pull(self, api: Api, key: str, job: Job | None) -> None:
        """Pull and verify with the SDK (signature, subject, sha256, size) through a client of its own."""
        from client import Client
        from compiler.errors import AotcError

        for attempt in range(30):
            try:
                with Client(self.url, api_key=ADMIN_KEY, cache_dir=self.cache / f"c{threading.get_ident()}",
                            timeout=60) as c:
                    c.pull(key, self.cache / "pulled" / f"{key}.pt2")
                if job:
                    job.pulled = True
                return
            except (AotcError, httpx.HTTPError, OSError) as e:
                err = f"{type(e).__name__}: {e}"[:300]
                if job:
                    job.pull_error = err
                time.sleep(min(5.0, 0.5 * (attempt + 1)))
        if job:
            job.pulled = False


def prober(url: str, rec: Record, stop: threading.Event) -> None:
    """A cheap read every 0.25 s, so the time from a fault to the next successful request is measured even when the
    clients are all waiting on jobs."""
    api = Api(url, rec)
    while not stop.wait(0.25):
        api.call("GET", "/v1/models", params={"limit": 1})


# -- faults ----------------------------------------------------------------------------------------------------


def fill_disk(data: Path) -> tuple[Path, int]:
    ballast = data / "chaos-ballast"
    written = 0
    block = b"\0" * (1 << 20)
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
                written += len(block)
        except OSError:
            pass
    # The last bytes too: a write of less than a block may still fit.
    with contextlib.suppress(OSError), open(ballast, "ab") as f:
        for _ in range(1 << 10):
            f.write(b"\0" * 1024)
            f.flush()
            written += 1024
    return ballast, written


def full_disk_answers(service: Service, rec: Record) -> dict[str, str]:
    """What a user meets on the full disk: a new model's upload (a 507 naming the free space and the setting is
    right), a model the service holds uploaded again (it needs no room: 200), and a lookup (a read: 200)."""
    api = Api(service.url, rec)
    out: dict[str, str] = {}
    new = service.base / "full-disk-new.pt2"
    new.write_bytes(b"PK" + os.urandom(256 << 10))  # a fresh id; refused for room before it is ever inspected
    held = sorted(service.base.glob("mlp-*.pt2"))[0]
    for what, path in (("upload a new model", new), ("upload a held model again", held)):
        r = api.call("POST", "/v1/models", content=path.read_bytes(), params={"name": path.stem},
                     headers={"content-type": "application/octet-stream"})
        out[what] = "no answer" if r is None else f"{r.status_code} {r.text[:300]}"
    r = api.call("GET", "/v1/models", params={"limit": 1})
    out["list models"] = "no answer" if r is None else str(r.status_code)
    return out


def inject(service: Service, rec: Record, kind: str, disk_full_s: float, stop: threading.Event) -> Fault:
    fault = Fault(kind, rec.now())
    if kind == "disk":
        if not service.tmpfs:
            fault.skipped = service.mount_error or "no tmpfs"
            return fault
        ballast, written = fill_disk(service.data)
        fault.detail = f"filled {written >> 20} MiB, held {disk_full_s:.0f} s"
        fault.answers = full_disk_answers(service, rec)
        stop.wait(disk_full_s)
        ballast.unlink()
        return fault
    # A child exists only while a job compiles or checks: wait for one (up to 4 minutes).
    deadline = time.monotonic() + (240 if kind.endswith("child") else 30)
    while (pid := service.find(kind)) is None and time.monotonic() < deadline and not stop.is_set():
        time.sleep(0.2)
    if pid is None:
        fault.skipped = f"no {kind.replace('_', ' ')} process appeared"
        return fault
    fault.at, fault.pid = rec.now(), pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    fault.detail = "kill -9"
    return fault


def run_faults(service: Service, rec: Record, kinds: list[str], duration_s: float, disk_full_s: float,
               stop: threading.Event, rng: random.Random) -> None:
    """One of each fault, in a random order, each at a random moment of its own slot of the run (the first and last
    minutes are kept quiet: the service warms up, and the last fault gets time to heal)."""
    span = max(60.0, duration_s - 120.0)
    slot = span / len(kinds)
    for i, kind in enumerate(kinds):
        at = 60.0 + i * slot + rng.uniform(0.0, slot * 0.6)
        if stop.wait(max(0.0, at - rec.now())):
            return
        fault = inject(service, rec, kind, disk_full_s, stop)
        with rec.lock:
            rec.faults.append(fault)
        print(f"[{rec.now():7.1f}s] fault {kind}: {fault.skipped or fault.detail} (pid {fault.pid})", flush=True)


# -- the end ---------------------------------------------------------------------------------------------------


def recoveries(rec: Record) -> None:
    ok = sorted(rec.ok_times)
    compiled = sorted(rec.compiled_times)
    for f in rec.faults:
        if f.skipped:
            continue
        # From the moment the fault is over: for the disk, when it was freed.
        end = f.at + (float(f.detail.split("held ")[1].split(" s")[0]) if f.kind == "disk" else 0.0)
        f.next_request_s = next((round(t - end, 2) for t in ok if t > end), None)
        f.next_compile_s = next((round(t - end, 2) for t in compiled if t > end), None)


def duplicates(api: Api, rec: Record, data: Path) -> dict[str, Any]:
    r = None
    for _ in range(60):  # the service may still be healing from the last fault
        r = api.call("GET", "/v1/artifacts", params={"limit": 1000})
        if r is not None and r.status_code == 200:
            break
        time.sleep(1.0)
    if r is None or r.status_code != 200:
        return {"error": f"could not list the artifacts: {r.status_code if r is not None else 'no answer'}",
                "count": None}
    listed = [a["key"] for a in r.json().get("artifacts", [])]
    twice = [k for k, n in Counter(listed).items() if n > 1]
    # The file blob store keeps one data file per kind and id (DIR/{kind}/{id[:2]}/{id}.{sha256[:16]}.data; an
    # artifact has a package and its sources under one key): a second of one kind is a second copy.
    files = Counter((p.parent.parent.name, p.name.split(".")[0]) for p in (data / "blobs").rglob("*.data")) \
        if (data / "blobs").is_dir() else Counter()
    stored_twice = sorted({k for (_, k), n in files.items() if n > 1 and k in set(listed)})
    by_request: dict[str, set[str]] = {}
    for j in rec.jobs.values():
        if j.state == "succeeded":
            by_request.setdefault(json.dumps([j.model, j.shapes], sort_keys=True), set()).add(j.artifact)
    two_keys = [k for k, keys in by_request.items() if len(keys) > 1]
    return {"artifacts_listed": len(listed), "keys_listed_twice": twice, "keys_stored_twice": stored_twice,
            "requests_with_two_keys": two_keys, "count": len(twice) + len(stored_twice) + len(two_keys)}


def report(rec: Record, dup: dict[str, Any], args: argparse.Namespace, service: Service) -> dict[str, Any]:
    jobs = list(rec.jobs.values())
    lost = [j for j in jobs if j.state not in TERMINAL or (j.state == "succeeded" and not j.pulled)]
    five: Counter[str] = Counter()
    for (method, route, status), n in rec.statuses.items():
        if status >= 500:
            five[f"{status} {method} {route}"] += n
    recovered = [f for f in rec.faults if not f.skipped]
    worst_request = max((f.next_request_s or float("inf") for f in recovered), default=None)
    worst_compile = max((f.next_compile_s or float("inf") for f in recovered), default=None)
    out = {
        "schema": 1,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cores": os.cpu_count(), "load_avg": os.getloadavg()},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "disk": {"tmpfs": service.tmpfs, "why_not": "" if service.tmpfs else service.mount_error},
        "jobs": {"submitted": len(jobs), "succeeded": sum(j.state == "succeeded" for j in jobs),
                 "failed": sum(j.state == "failed" for j in jobs),
                 "failure_reasons": dict(Counter(j.error[:160] for j in jobs if j.state == "failed")),
                 "lost": [asdict(j) for j in lost], "cache_hits": rec.cache_hits,
                 "attempts": dict(Counter(j.attempts for j in jobs))},
        "duplicates": dup,
        "answers": {f"{s} {m} {r}": n for (m, r, s), n in sorted(rec.statuses.items())},
        "five_xx_by_route": dict(five),
        "http_500": sum(n for k, n in five.items() if k.startswith("500 ")),
        "transport_errors": dict(rec.transport_errors),
        "faults": [asdict(f) for f in rec.faults],
        "goals": {
            "jobs_lost_0": not lost,
            "duplicates_0": dup["count"] == 0,  # None: could not be counted, which is not met
            "http_500_0": not any(k.startswith("500 ") for k in five),
            "recovery_under_30s": worst_request is not None and worst_request < 30
                                  and worst_compile is not None and worst_compile < 30 + args.compile_allowance_s,
        },
        "worst_recovery_s": {"request": worst_request, "compile": worst_compile},
    }
    return out


def print_table(out: dict[str, Any]) -> None:
    j = out["jobs"]
    print(f"\njobs: {j['submitted']} submitted, {j['succeeded']} succeeded, {j['failed']} failed, "
          f"{len(j['lost'])} lost; {j['cache_hits']} cache hits; attempts {j['attempts']}")
    for why, n in j["failure_reasons"].items():
        print(f"  failed x{n}: {why}")
    dup = out["duplicates"]
    print(f"duplicates: {dup['count'] if dup['count'] is not None else dup['error']}   HTTP 500: {out['http_500']}")
    print("\n| fault | at (s) | pid | what | next request (s) | next compile (s) |")
    print("|---|---|---|---|---|---|")
    for f in out["faults"]:
        print(f"| {f['kind']} | {f['at']:.1f} | {f['pid'] or ''} | {f['skipped'] or f['detail']} | "
              f"{f['next_request_s'] if f['next_request_s'] is not None else '-'} | "
              f"{f['next_compile_s'] if f['next_compile_s'] is not None else '-'} |")
    for f in out["faults"]:
        for what, said in f["answers"].items():
            print(f"while the {f['kind']} fault lasted, {what}: {said}")
    if out["five_xx_by_route"]:
        print("\n| 5xx | count |\n|---|---|")
        for k, n in sorted(out["five_xx_by_route"].items()):
            print(f"| {k} | {n} |")
    print("\ngoals:", ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in out["goals"].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0, help="how long clients submit work and faults happen")
    p.add_argument("--drain-s", type=float, default=600.0, help="how long to wait for every job to end afterwards")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--api-workers", type=int, default=2)
    p.add_argument("--models", type=int, default=40, help="distinct models to upload (each a compile of its own)")
    p.add_argument("--disk-mb", type=int, default=512,
                   help="size of the data dir's tmpfs (AOTC_DISK_LOW_WATER_MB is an eighth of it)")
    p.add_argument("--disk-full-s", type=float, default=30.0, help="how long the disk stays full")
    p.add_argument("--faults", default=",".join(FAULTS), help="which faults, comma-separated")
    p.add_argument("--compile-allowance-s", type=float, default=120.0,
                   help="a compile takes this long on this machine: the next successful compile after a fault is "
                        "held to 30 s plus this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the scratch dir (logs, data)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / f"chaos-{time.strftime('%Y-%m-%d')}.json")
    args = p.parse_args()
    kinds = [k for k in args.faults.split(",") if k]
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    rng.shuffle(kinds)

    # A SIGTERM or Ctrl-C still stops the service and unmounts its tmpfs (the finally below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))
    base = Path(tempfile.mkdtemp(prefix="aotc-chaos-"))
    print(f"scratch dir {base}; exporting {args.models} models", flush=True)
    models = export_models(args.models, base)
    service = Service(base, args.disk_mb, args.workers, args.api_workers)
    try:
        service.wait_ready()
        rec = Record()
        print(f"service ready at {service.url}; running {args.duration_s:.0f} s with faults {kinds}", flush=True)
        stop_faults, stop_probe = threading.Event(), threading.Event()
        clients = Clients(service.url, rec, models, args.clients, base / "client")
        clients.start()
        probe = threading.Thread(target=prober, args=(service.url, rec, stop_probe), daemon=True)
        probe.start()
        faults = threading.Thread(target=run_faults, daemon=True,
                                  args=(service, rec, kinds, args.duration_s, args.disk_full_s, stop_faults, rng))
        faults.start()
        time.sleep(args.duration_s)
        print(f"[{rec.now():7.1f}s] no new work; draining up to {args.drain_s:.0f} s", flush=True)
        with clients.model_lock:
            clients.next_model = len(clients.models)  # no new uploads; jobs under way are followed to their end
        clients.built.clear()
        faults.join(args.disk_full_s + 300)
        stop_faults.set()
        deadline = time.monotonic() + args.drain_s
        while time.monotonic() < deadline and any(j.state not in TERMINAL for j in rec.jobs.values()):
            time.sleep(1.0)
        clients.join(120)
        stop_probe.set()
        recoveries(rec)
        out = report(rec, duplicates(Api(service.url, rec), rec, service.data), args, service)
    finally:
        service.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
