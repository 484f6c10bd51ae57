"""Pieces that bench/compile_overhead.py and bench/farm.py share: a service of N workers on one device with its
own data dir, the models they compile (small CPU ones, or the zoo's on a GPU), and a finished job's timeline read
from its own stage events.

Torch is imported only where a model is built or exported, so the service side stays torch-free.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Small CPU models (bench/report_overhead.py's), at a fixed batch: a plain compile takes 7-10 s on 2 cores.
SMALL = ("inplace_reduce", "convnet", "transformer")


def build(name: str, device: str, seed: int = 0, batch: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    """The model (weights drawn from `seed`) and its inputs: the zoo's at its serving batch (or `batch`), or a small
    CPU model's at a small batch."""
    import torch

    if name in SMALL:
        from bench.report_overhead import MODELS

        cls, shape = MODELS[name]
        torch.manual_seed(seed)
        return cls().eval().to(device), (torch.randn(*shape, device=device),)
    from bench.zoo import build as zoo_build

    return zoo_build(name, seed=seed, device=device, batch=batch)


def export(name: str, path: Path, device: str, seed: int = 0, batch: int | None = None) -> Path:
    """Export `name` at a static shape: the same program goes to the plain compile and to aotc. `seed` draws new
    weights (a new model to aotc). Its inputs go beside it (PATH.inputs.pt, written here, read by this bench)."""
    import torch

    model, inputs = build(name, device, seed, batch)
    with torch.no_grad():
        torch.export.save(torch.export.export(model, inputs), str(path))
    torch.save(tuple(t.cpu() for t in inputs), str(path) + ".inputs.pt")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


def service_env(data_dir: Path, device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AOTC_REDIS_URL", "AOTC_ADMIN_KEY", "AOTC_API_KEY")}
    env.update({"AOTC_DATA_DIR": str(data_dir), "AOTC_WORK_DIR": str(data_dir / "work"), "AOTC_DEVICE": device,
                "AOTC_COMPILE_TIMEOUT_S": "1800", "AOTC_CHILD_LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
                # this tree first, then the caller's path (wheels installed with --target, as on a GPU host)
                "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    env.update(extra or {})
    return env


class Service:
    """An embedded Redis, one API process and `workers` worker processes on `device`, in `data_dir`."""

    def __init__(self, data_dir: Path, device: str, workers: int, extra_env: dict[str, str] | None = None) -> None:
        from service.store.embedded import EmbeddedRedis, free_port

        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.redis = EmbeddedRedis(data_dir / "redis", port=free_port()).start()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**service_env(data_dir, device, extra_env), "AOTC_REDIS_URL": self.redis.url}
        self.log_path = data_dir / "serve.log"
        self.log = open(self.log_path, "ab")
        self.api = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory",
                                     "--port", str(self.port), "--log-level", "warning"],
                                    env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.started: list[float] = []
        try:
            self._wait_api()
        except RuntimeError:
            self.stop()  # Redis, and the API if it still runs
            raise
        for _ in range(workers):
            self.add_worker()

    def _wait_api(self, timeout_s: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.api.poll() is not None:
                raise RuntimeError(f"the API exited ({self.exited()}): {self.errors()}")
            time.sleep(0.2)
        raise RuntimeError(f"the API did not answer in {timeout_s} s")

    def add_worker(self) -> float:
        """Start one more worker; returns when it was started (time.time())."""
        t = time.time()
        self.workers.append(subprocess.Popen([sys.executable, "-m", "worker"], env=self.env, stdout=self.log,
                                             stderr=subprocess.STDOUT, cwd=ROOT))
        self.started.append(t)
        return t

    def store(self) -> Any:
        from service.store import Store

        return Store(self.redis.url)

    def wait_registered(self, n: int, timeout_s: float = 600) -> None:
        """Until `n` workers are in the registry (a worker registers before it builds its headers)."""
        deadline = time.monotonic() + timeout_s
        store = self.store()
        while time.monotonic() < deadline:
            if len(store.workers.live()) >= n:
                return
            if gone := self.exited():
                raise RuntimeError(f"the service exited ({gone}): {self.errors()}")
            time.sleep(0.3)
        raise RuntimeError(f"{n} workers did not register in {timeout_s} s")

    def exited(self) -> str:
        """Which of the API and the workers has exited, with its status ("" while all run)."""
        procs = [("the API", self.api), *((f"worker {i}", w) for i, w in enumerate(self.workers))]
        return ", ".join(f"{name}: exit status {p.returncode}" for name, p in procs if p.poll() is not None)

    def errors(self, limit: int = 3000) -> str:
        """The log's error lines and tracebacks' last lines, else its tail: a lane's log interleaves five workers'
        start-up, so a failure printed first (the API's bind) is no longer in the tail when it is read."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        at = [i for i, line in enumerate(lines) if re.search(r"\b(ERROR|CRITICAL)\b|Error:|Errno", line)]
        marked = sorted({j for i in at for j in range(i, min(i + 3, len(lines)))})  # with the two lines after
        return "\n".join(lines[j] for j in marked or range(len(lines)))[-limit:]

    def wait_headers(self, n: int = 1, timeout_s: float = 1800) -> None:
        """Until `n` workers have their precompiled headers (found on disk or built)."""
        found = re.compile(r"precompiled headers: (built )?\d+ files")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len([line for line in self.logged("precompiled headers") if found.search(line)]) >= n:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{n} workers did not have their headers in {timeout_s} s")

    def logged(self, what: str) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if what in line]

    def stop_workers(self) -> None:
        """The workers only (the API and Redis serve pulls on): a quiet device for measuring."""
        for p in self.workers:
            p.terminate()
        for p in self.workers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()

    def stop(self) -> None:
        for p in [*self.workers, self.api]:
            p.terminate()
        for p in [*self.workers, self.api]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.stop()
        self.log.close()


def start_service(data_dir: Path, device: str, workers: int, extra_env: dict[str, str] | None = None,
                  attempts: int = 2) -> Service:
    """A Service with its `workers` registered. A start that fails at once (a process exited, as a lane's did on a
    GPU host in the 2026-11-28 coverage run, its cause gone with the machine) is stopped and tried again in a fresh
    directory with fresh ports, so one lane's bad start does not cost a quarter of a run."""
    for attempt in range(attempts):
        where = data_dir if attempt == 0 else data_dir.with_name(f"{data_dir.name}-retry{attempt}")
        svc = None
        try:
            svc = Service(where, device, workers, extra_env)
            svc.wait_registered(workers)
            return svc
        except RuntimeError as e:
            if svc is not None:
                svc.stop()
            if attempt + 1 == attempts:
                raise
            print(f"the service in {where} did not start, trying again: {e}", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def ts(value: Any) -> float:
    return float(value)


def timeline(store: Any, job_id: str) -> dict[str, Any]:
    """A finished job's record and the seconds between its stage events (the worker records each stage as it
    enters it: fetch is from the claim to the compile child's first stage, and includes the child's start)."""
    job = store.jobs.get(job_id) or {}
    events = [(ev.get("stage") or ev.get("state") or "", float(ev["ts"])) for _, ev in store.jobs.events(job_id)
              if "ts" in ev]
    spans: dict[str, float] = {}
    start = ts(job["started"]) if job.get("started") else None
    marks = [("claim", start)] if start is not None else []
    marks += [(stage, t) for stage, t in events if start is None or t >= start]
    marks.append(("end", ts(job["finished"])))
    for (stage, t0), (_, t1) in zip(marks, marks[1:]):
        spans[stage] = round(spans.get(stage, 0.0) + t1 - t0, 3)
    return {"job": job, "spans": spans, "wall_s": round(ts(job["finished"]) - ts(job["created"]), 3),
            "run_s": round(ts(job["finished"]) - start, 3) if start is not None else None}


def job_error(job: dict[str, Any], limit: int = 2000) -> dict[str, str | None] | None:
    """A failed job's error as a bench row keeps it: its type, stage, message and excerpt (each cut at `limit`: a
    check's excerpt has every failed case, where its message names the first); None if none."""
    error = job.get("error")
    if not isinstance(error, dict):
        return None
    return {k: str(error[k])[:limit] if error.get(k) is not None else None
            for k in ("type", "stage", "message", "excerpt")}


def time_call(fn: Any, device: str, rep_ms: float = 200.0) -> float:
    """One call's time in ms as the quiet passes take it: triton's `do_bench` (median, `rep_ms` of calls) on a GPU,
    a median of timed calls (at least 10, up to 200 in 10 x `rep_ms`, after 3 untimed) on a CPU."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    for _ in range(3):
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 100
    while len(times) < 10 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def table(rows: list[dict[str, Any]], header: list[str]) -> str:
    cells = [[str(r.get(h, "")) for h in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def cpu_of(pid: int | str = "self") -> tuple[int | None, float | None]:
    """The core a process last ran on (field 39 of /proc/PID/stat) and that core's clock now (MHz, from
    /proc/cpuinfo; None where the kernel does not say): where a timed process sat, recorded beside its figure."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        core = int(stat[stat.rindex(")") + 2:].split()[36])  # fields after the command name start at field 3
    except (OSError, ValueError, IndexError):
        return None, None
    return core, _clocks().get(core)


def host_cpus() -> dict[int, dict[str, Any]]:
    """Each core of this host: its SMT siblings and physical package (from sysfs) and its clock now (MHz). A figure
    that the host sets (eager at a serving batch is one launch per op) depends on which of these it ran on."""
    mhz = _clocks()
    cpus: dict[int, dict[str, Any]] = {}
    for d in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*")):
        n = int(d.name[3:])
        cpus[n] = {"siblings": _sysfs(d / "topology/thread_siblings_list"),
                   "package": _sysfs(d / "topology/physical_package_id"), "mhz": mhz.get(n)}
    return cpus


def _clocks() -> dict[int, float]:
    """Each core's clock now (MHz), as /proc/cpuinfo says it; empty where it does not."""
    mhz: dict[int, float] = {}
    try:
        core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "processor":
                core = int(value)
            elif key.strip() == "cpu MHz" and core is not None:
                mhz[core] = float(value)
    except (OSError, ValueError):
        pass
    return mhz


def _sysfs(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None
