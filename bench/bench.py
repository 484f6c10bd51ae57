"""GPU benchmark for a serving team: real models (random weights, bf16) at batch 1 and at their serving batch,
through the service, against eager and torch.compile, each peer in a fresh process.

Run on a machine with a CUDA GPU, from the repo root:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python3 bench/bench.py --out bench/results/h100.json \\
        [--models resnet50,hf_bert_base | --partition 2/5] [--budget-s 540] [--rounds 2] [--max-autotune]
    python3 bench/report.py bench/results/h100.json --svg bench/results/h100.svg

It starts `aotc serve` (embedded Redis, the API, --workers GPU workers) unless --url points at a running service.
Per model (in --models order, or the --partition's share of zoo.py):

1. compile: the model is exported at each batch (static shapes) and submitted; the workers compile (and check)
   while the next model exports. Recorded: compile seconds, artifact size, and the worker's check (its median
   latency and spread, the CUDA-graph run, whether graphs pay).
2. measure: with no compile running, each peer runs in its own fresh process, in alternating rounds (--rounds):
   `eager`, `tc_default` (torch.compile), `tc_reduce_overhead` (torch.compile mode="reduce-overhead": CUDA graphs),
   `tc_max_autotune` (only with --max-autotune), `aot` (the artifact pulled, loaded and called) and `aot_graphs`
   (the same with `cuda_graphs=True`). A peer process takes the batches in order (1 first): its first batch's
   time to first inference is from a cold process (import torch, build or pull, compile or load, first call;
   torch.compile with empty Inductor and Triton caches); later batches' first-call figures are in a warm process.
   Latency is the median of triton.testing.do_bench (warm-up 25 ms, 200 ms of calls, L2 flushed); `aot` also
   takes compiler.check.measure (the worker's method) in the same process, to compare with the worker's figure.
   Memory: the allocator's peak, and the device memory in use after the run (cudaMemGetInfo; it sees the
   package's constants and CUDA-graph pools, which the allocator statistics do not all see).

`--profile` adds, in each peer's process after its timing, torch.profiler over 20 calls (CUPTI reports the kernels
a CUDA graph replays, too): the kernels per call, their summed device time, the span from the first kernel's start to
the last one's end, and the kernels by time, their names with Inductor's numbering dropped. `--batch 1` measures batch
1 only and `--peers` a subset: e.g. `--batch 1 --peers tc_reduce_overhead,aot_graphs --profile` asks why a package
replayed from a graph is behind `reduce-overhead` at batch 1 (issue 24), and prints the two side by side at the end.
It also times where do_bench's figure goes (`_flushed`: the call's host time, the device idle after do_bench's L2
flush, one call's device trace and its largest gaps, a call on an idle device, calls back to back, and for aotc's
graph its replay alone and without the clone). Two switches for the aot_graphs peer's process:
`BENCH_SAME_PROCESS=1` times aotc's graph and reduce-overhead's (compiled there) in that one process, alternating;
`BENCH_BISECT=1` times reduce-overhead's graph after each step of loading the artifact (`_bisect`) instead.

Resumable: a (model, batch, peer) already in --out is not measured again; --budget-s stops before a model that
would start after it. The JSON is schema 2 (schema 1 was the 2026-11-22 run: one batch, three peers).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
PROFILE_CALLS = 20
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = 2
PEERS = ("eager", "tc_default", "tc_reduce_overhead", "tc_max_autotune", "aot", "aot_graphs")
TC_MODE = {"tc_default": "default", "tc_reduce_overhead": "reduce-overhead", "tc_max_autotune": "max-autotune"}


# -- a peer, in its own process ------------------------------------------------------------------------------


def _do_bench_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def child(peer: str, name: str, batches: list[int], keys: dict[str, str], url: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"import_s": time.perf_counter() - T_START, "batches": {}}
    torch.cuda.init()
    if os.environ.get("BENCH_BISECT") and peer == "aot_graphs":
        out["batches"][str(batches[0])] = _bisect(name, batches[0], keys[str(batches[0])], url)
        return out
    for n, batch in enumerate(batches):
        free0 = torch.cuda.mem_get_info()[0]
        torch.cuda.reset_peak_memory_stats()
        rec: dict[str, Any] = {}
        t0 = time.perf_counter()
        if peer in ("aot", "aot_graphs"):
            fn, inputs = _load_artifact(peer, name, batch, keys[str(batch)], url, rec)
        else:
            fn, inputs = _build_peer(peer, name, batch, rec)
        with torch.inference_mode():
            t1 = time.perf_counter()
            fn(*inputs)
            torch.cuda.synchronize()
            rec["first_call_s"] = time.perf_counter() - t1
            rec["ttfi_in_process_s"] = time.perf_counter() - t0  # build or pull, compile or load, first call
            if n == 0:
                rec["ttfi_s"] = time.perf_counter() - T_START  # from the process's start: import torch included
                rec["ttfi_after_import_s"] = rec["ttfi_s"] - out["import_s"]
            call = functools.partial(fn, *inputs)
            rec["latency_ms"] = _do_bench_ms(call)
            if peer == "aot":
                from compiler.check import measure

                rec["measure"] = measure(call, "cuda:0")
            if os.environ.get("BENCH_PROFILE"):
                rec["profile"] = _profile(call)
                rec["profile"]["flushed"] = _flushed(call)
            if os.environ.get("BENCH_SAME_PROCESS") and peer == "aot_graphs":
                rec["same_process"] = _same_process(call, name, batch)
        torch.cuda.synchronize()
        rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        rec["device_mem_bytes"] = free0 - torch.cuda.mem_get_info()[0]
        if peer == "aot_graphs":
            rec["graphs"] = {"impl": getattr(fn, "impl", None), "reason": getattr(fn, "reason", None),
                             "last": getattr(fn, "last", None), "stats": fn.stats() if hasattr(fn, "stats") else []}
        out["batches"][str(batch)] = rec
        del fn, inputs, call
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return out


def _kernel_family(name: str) -> str:
    """A kernel's name without what changes between two compiles of one program: Inductor's numbering and the
    templates' tile suffixes (triton_poi_fused_add_gelu_3 -> triton_poi_fused_add_gelu), cut at 90 characters."""
    import re

    base = re.sub(r"(_\d+)+$", "", name.split("(")[0].strip())
    return base[:90]


def _profile(call: Any) -> dict[str, Any]:
    """torch.profiler over PROFILE_CALLS calls: per call, the kernels, their device time and span; the kernel
    families by time (microseconds per call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    if not kernels:
        return {"kernels_per_call": 0, "note": "the profiler saw no kernels"}
    by: dict[str, float] = {}
    for e in kernels:
        key = _kernel_family(e.name)
        by[key] = by.get(key, 0.0) + e.device_time / PROFILE_CALLS  # microseconds
    starts = sorted(e.time_range.start for e in kernels)
    ends = sorted(e.time_range.end for e in kernels)
    return {"calls": PROFILE_CALLS, "kernels_per_call": len(kernels) / PROFILE_CALLS,
            "kernel_us_per_call": sum(by.values()), "span_us_per_call": (ends[-1] - starts[0]) / PROFILE_CALLS,
            "families": dict(sorted(((k, round(v, 2)) for k, v in by.items()), key=lambda kv: -kv[1])[:40])}


def _flushed(call: Any, calls: int = 50) -> dict[str, Any]:
    """Where do_bench's figure goes for a call: its loop zeroes a buffer larger than L2 before each timed call, so the
    host prepares the call while the device flushes. Per call (medians, microseconds):
    - `host_us`: the call's own host time, launched while the device is busy with a flush (what it takes to return);
    - `idle_after_flush_us`: under the profiler (device activity only), from the flush's end to the call's first
      kernel: the device waiting for the host;
    - `span_after_flush_us`: from that first kernel to the call's last kernel's end;
    - `isolated_us`: from the call on an idle device to the device being idle again (wall clock, synchronised), what
      a request that finds the GPU idle waits;
    - `back_to_back_us`: CUDA events around `calls` calls with no flush, per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")  # do_bench's buffer
    host, isolated = [], []
    for _ in range(calls):
        flush.zero_()
        t0 = time.perf_counter()
        call()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        isolated.append((time.perf_counter() - t0) * 1e6)
    back_to_back = _per_call_us(call, calls)
    parts = _graph_parts(call, calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            flush.zero_()
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    fills = [e for e in kernels if "Fill" in e.name]
    longest = max((e.time_range.end - e.time_range.start for e in fills), default=0)
    flushes = [e for e in fills if e.time_range.end - e.time_range.start > longest / 2]
    idle, span, trace = [], [], []
    for i, f in enumerate(flushes):
        until = flushes[i + 1].time_range.start if i + 1 < len(flushes) else float("inf")
        mine = [e for e in kernels if f.time_range.end <= e.time_range.start < until]
        if mine:
            idle.append(mine[0].time_range.start - f.time_range.end)
            span.append(max(e.time_range.end for e in mine) - mine[0].time_range.start)
            if i == len(flushes) // 2:  # one call's device activity, kernels, copies and sets alike, in order
                t0 = mine[0].time_range.start
                trace = [(e.name[:100], round(e.time_range.start - t0, 2), round(e.time_range.end - e.time_range.start,
                                                                                  2)) for e in mine]
    med = statistics.median
    gaps = sorted(((round(b[1] - (a[1] + a[2]), 2), a[0][:60], b[0][:60]) for a, b in zip(trace, trace[1:])),
                  reverse=True)
    return {"calls": calls, "host_us": med(host), "isolated_us": med(isolated), "back_to_back_us": back_to_back,
            **parts, "flushes_seen": len(flushes),
            "flush_us": med([f.time_range.end - f.time_range.start for f in flushes]) if flushes else None,
            "idle_after_flush_us": med(idle) if idle else None, "span_after_flush_us": med(span) if span else None,
            "trace_gap_us": round(sum(g for g, _, _ in gaps), 2), "trace_top_gaps": gaps[:12], "trace": trace}


def _per_call_us(fn: Any, calls: int = 50) -> float:
    """Microseconds per call of `fn`, CUDA events around `calls` calls back to back."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / calls, 2)


def _reduce_overhead_here(name: str, batch: int) -> tuple[Any, tuple[Any, ...]]:
    """`torch.compile(mode="reduce-overhead")` of the model, built in this process and warmed (its graphs captured):
    the call, and the inputs it takes."""
    import torch

    ro, inputs = _build_peer("tc_reduce_overhead", name, batch, {})
    ro_call = functools.partial(ro, *inputs)
    with torch.inference_mode():
        for _ in range(5):
            ro_call()
    torch.cuda.synchronize()
    return ro_call, inputs


def _bisect(name: str, batch: int, key: str, url: str, rounds: int = 3) -> dict[str, Any]:
    """BENCH_BISECT=1 (the aot_graphs peer): which step of loading an aotc artifact makes a process's CUDA graphs
    slower. `torch.compile(mode="reduce-overhead")` of the model is built and timed first (back to back, per call),
    then timed again after each step a serving process takes to load the artifact: the client imported, pinned
    buffers and streams as the weights' copy uses, the package loaded plainly (its weights blob pulled onto the device
    as it arrives), then loaded for CUDA graphs and captured. The step after which reduce-overhead's figure moves
    is where the process, not the graph, costs time. The model in eager is timed beside it at every step, and the
    plain package from its load on: whether what slows graphs (a kernel on a second stream, 2026-12-01) slows
    kernels launched one by one too."""
    import torch

    ro_call, inputs = _reduce_overhead_here(name, batch)
    eager, eager_inputs = _build_peer("eager", name, batch, {})
    eager_call = functools.partial(eager, *eager_inputs)
    with torch.inference_mode():
        eager_call()
    steps: list[dict[str, Any]] = []
    plain_call: Any = None

    def step(label: str, extra: Any = None) -> None:
        with torch.inference_mode():
            row: dict[str, Any] = {"step": label, "reduce_overhead_us": [_per_call_us(ro_call) for _ in range(rounds)],
                                   "eager_us": [_per_call_us(eager_call, 20) for _ in range(rounds)]}
            if plain_call is not None:
                row["aot_plain_us"] = [_per_call_us(plain_call) for _ in range(rounds)]
            if extra is not None:
                row["aot_graphs_us"] = [_per_call_us(extra) for _ in range(rounds)]
        steps.append(row)
        print(f"bisect {name}: {row}", file=sys.stderr, flush=True)

    step("reduce-overhead alone")
    import client  # noqa: F401 - the step is the import
    from compiler import weights

    step("client and compiler.weights imported")
    pinned = [torch.empty(weights.COPY_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(weights.COPY_LANES)]
    lanes = [torch.cuda.Stream() for _ in range(weights.COPY_LANES)]
    for buf, lane in zip(pinned, lanes, strict=True):
        with torch.cuda.stream(lane):
            torch.empty(buf.numel(), dtype=torch.uint8, device="cuda").copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    step("pinned buffers and streams, a copy on each")
    from client import Client

    cache = tempfile.mkdtemp(prefix="aotc-bench-bisect-")
    with Client(url, cache_dir=cache, timeout=300) as c:
        art = c.artifact(key)
        plain = c.load(art, device="cuda:0")
        with torch.inference_mode():
            plain(*inputs)
        torch.cuda.synchronize()
        plain_call = functools.partial(plain, *inputs)
        step("the package loaded plainly (its weights onto the device as they arrived)")
        # c53 (2026-12-01) put the slowdown at the single-threaded package's run on a side stream: a second run of a
        # package, or any kernel on a second stream?
        with torch.inference_mode():
            for _ in range(2):
                plain(*inputs)
        torch.cuda.synchronize()
        step("the plain package run twice more (on the current stream)")
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            torch.ones(1024, device="cuda:0").add_(1)
        torch.cuda.synchronize()
        step("one small kernel on a stream of its own")
        # The graphed load, step by step (client/graphs.py, compiler/cudagraphs.py `_capture_now`): the second
        # package in single-threaded mode, its plain run on a side stream, the allocator's cache emptied, the capture.
        graphed = c.load(art, device="cuda:0", cuda_graphs=True)
        step("loaded again in single-threaded mode for CUDA graphs (not captured)")
        pkg = graphed._pkg  # noqa: SLF001 - the bisect runs the graphed load's parts one at a time
        flat = pkg.flat_inputs(tuple(inputs), {})
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                pkg.run_flat(list(flat))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        step("its single-threaded run, twice on a side stream")
        torch.cuda.empty_cache()
        step("the allocator's cache emptied")
        with torch.inference_mode():
            graphed(*inputs)
        torch.cuda.synchronize()
        step("captured (the graphed call's first call)", functools.partial(graphed, *inputs))
        graphed.release()
        del graphed, pkg
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        step("its graph released and the graphed artifact dropped")
    del pinned, lanes
    return {"bisect": steps, "latency_ms": statistics.median(steps[-2]["aot_graphs_us"]) / 1e3}


def _same_process(call: Any, name: str, batch: int, calls: int = 50, rounds: int = 5) -> dict[str, Any]:
    """aotc's graphed call and `torch.compile(mode="reduce-overhead")` of the same model in this one process (one CUDA
    context, one environment), back to back in alternating rounds: microseconds per call, CUDA events around
    `calls` calls. Whether a difference belongs to the graphs or to the processes they ran in."""
    import torch

    ro_call, _ = _reduce_overhead_here(name, batch)
    for _ in range(3):
        call()
    torch.cuda.synchronize()

    got: dict[str, list[float]] = {"aot_graphs_us": [], "tc_reduce_overhead_us": []}
    for _ in range(rounds):
        got["aot_graphs_us"].append(_per_call_us(call, calls))
        got["tc_reduce_overhead_us"].append(_per_call_us(ro_call, calls))
    return got


def _graph_parts(call: Any, calls: int) -> dict[str, Any]:
    """For aotc's graphed artifact (`call` a partial of client.graphs.GraphedArtifact): back-to-back microseconds per
    call of the captured graph's replay alone (no copy in, no clone out), and of the whole call without the clone."""
    runner = getattr(getattr(call, "func", None), "_runner", None)
    captured = [e for e in getattr(runner, "entries", {}).values() if hasattr(e, "graph")]
    if runner is None or len(captured) != 1:
        return {}

    # No replay on a stream of its own here any more: once a kernel has run on a second stream, every graph the
    # process replays is slower (2026-12-01), which tainted what this process timed after it.
    graph_only = _per_call_us(captured[0].graph.replay, calls)
    runner.clone_outputs = False
    try:
        no_clone = _per_call_us(call, calls)
    finally:
        runner.clone_outputs = True
    return {"graph_replay_only_us": graph_only, "back_to_back_no_clone_us": no_clone}


def _build_peer(peer: str, name: str, batch: int, rec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    import torch

    from bench.zoo import build

    t0 = time.perf_counter()
    model, inputs = build(name, batch=batch)
    torch.cuda.synchronize()
    rec["build_s"] = time.perf_counter() - t0
    if peer == "eager":
        return model, inputs
    compiled = torch.compile(model, mode=TC_MODE[peer], dynamic=False)
    t1 = time.perf_counter()
    with torch.inference_mode():
        compiled(*inputs)
    torch.cuda.synchronize()
    rec["compile_s"] = time.perf_counter() - t1  # the compile and its first call
    return compiled, inputs


def _load_artifact(peer: str, name: str, batch: int, key: str, url: str,
                   rec: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    from bench.zoo import inputs as zoo_inputs
    from client import Client

    inputs = zoo_inputs(name, batch)
    cache = tempfile.mkdtemp(prefix="aotc-bench-cache-")
    with Client(url, cache_dir=cache, timeout=300) as c:
        t0 = time.perf_counter()
        art = c.artifact(key)
        c.pull(art)
        rec["pull_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        fn = c.load(art, device="cuda:0", cuda_graphs=peer == "aot_graphs")  # the pull above is cached
        rec["load_s"] = time.perf_counter() - t1
    return fn, inputs


def cpu_set(spec: str | None) -> set[int] | None:
    """'0-7,12' -> {0..7, 12}; None or '' -> None (no pinning)."""
    if not spec:
        return None
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _pinned(cpus: set[int] | None) -> Any:
    """A preexec_fn that pins the child (and everything it starts) to `cpus` (only before any thread starts)."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def _fresh(args: list[str], env: dict[str, str], timeout: float, cpus: set[int] | None = None) -> dict[str, Any]:
    """Run a peer in a fresh process (pinned to `cpus`: the child pins itself, as preexec_fn is unsafe beside the
    driver's threads)."""
    t0 = time.perf_counter()
    if cpus:
        env = {**env, "BENCH_CPUS": ",".join(map(str, sorted(cpus)))}
    try:
        p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:], "returncode": p.returncode}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = wall
    return out


# -- the driver ----------------------------------------------------------------------------------------------


def start_service(port: int, data_dir: Path, workers: int, gpu: str | None = None,
                  cpus: set[int] | None = None) -> list[subprocess.Popen[bytes]]:
    """Embedded Redis (AOF, so artifacts survive a restart), the API, and `workers` worker processes on cuda:0
    (the visible device `gpu` when given), pinned to `cpus` when given. Several workers share the GPU to overlap
    compiles, which are mostly CPU work."""
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
    wenv = {**env, "CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else env
    procs += [subprocess.Popen([sys.executable, "-m", "worker"], env=wenv, stdout=log, stderr=subprocess.STDOUT,
                               cwd=ROOT, preexec_fn=_pinned(cpus)) for _ in range(workers)]
    import httpx

    headers = {"authorization": f"Bearer {os.environ['AOTC_API_KEY']}"} if os.environ.get("AOTC_API_KEY") else {}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/workers", timeout=2, headers=headers)
            if r.status_code == 200 and len(r.json()["workers"]) >= workers:
                procs.append(redis_srv.proc)  # type: ignore[arg-type]
                return procs
        except httpx.TransportError:
            pass
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"service exited: {(data_dir / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.5)
    raise RuntimeError("the service did not come up with its cuda workers")


ONLY_BATCH: int | None = None  # --batch


def batches_of(name: str) -> list[int]:
    from bench.zoo import MODELS

    return [ONLY_BATCH] if ONLY_BATCH else sorted({1, MODELS[name].batch})


def submit_all(names: list[str], url: str, state: Path, submitted: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """Export each model at each batch and submit its compile; the workers compile while the next one exports.
    Each model goes to `submitted` as soon as it is in: (name, {batch: {'job': id} | {'key': key} | {'error': ...}})."""
    import torch

    from bench.zoo import build
    from client import Client

    with Client(url, cache_dir=state / "client-cache", timeout=300) as c:
        for name in names:
            entries: dict[str, Any] = {}
            for batch in batches_of(name):
                path = state / f"{name}-b{batch}.pt2"
                try:
                    t0 = time.perf_counter()
                    if not path.exists():
                        model, inputs = build(name, batch=batch)
                        torch.export.save(torch.export.export(model, inputs), str(path))
                        del model, inputs
                        torch.cuda.empty_cache()
                    rec = c.upload(path)
                    shapes = {i["name"]: i["shape"] for i in rec["inputs"]}
                    ans = c.submit(rec["id"], shapes, "cuda", priority="batch")
                    entries[str(batch)] = ({"key": ans["key"]} if ans["status"] == "cached"
                                           else {"job": ans["job"]["id"]})
                    entries[str(batch)]["export_s"] = time.perf_counter() - t0
                    print(f"submitted {name} b={batch}: {ans['status']}", flush=True)
                except Exception as e:  # a model we cannot build, export or upload is a result too
                    entries[str(batch)] = {"error": f"{type(e).__name__}: {e}"[:1500], "stage": "export"}
                    print(f"{name} b={batch}: {entries[str(batch)]['error'][:300]}", flush=True)
            submitted.put((name, entries))


def wait_artifact(c: Any, entry: dict[str, Any]) -> dict[str, Any]:
    """The compile's outcome: {'ok', 'key', 'compile_s', 'artifact_bytes', 'check', ...} or the failure."""
    from client import JobFailed

    if "error" in entry:
        return {"ok": False, **entry}
    try:
        art = c.artifact(entry["key"]) if "key" in entry else c.wait(entry["job"], timeout=1200)
    except JobFailed as e:
        err = e.job.get("error") or {}
        return {"ok": False, "stage": err.get("stage"), "error": err.get("message"),
                "excerpt": (err.get("excerpt") or "")[-800:]}
    check = art.meta.get("check") or {}
    return {"ok": True, "key": art.key, "artifact_bytes": art.meta["size"],
            "compile_s": (art.meta.get("timings") or {}).get("compile_total"),
            "check_s": (art.meta.get("timings") or {}).get("check"), "export_s": entry.get("export_s"),
            "check": {k: check.get(k) for k in ("compiled_ms", "eager_ms", "graph_ms", "max_rel_err", "latency",
                                                "graphs", "device_info")}}


@dataclass
class Lane:
    """Where peers are measured: a visible GPU and the cores its processes are pinned to. A lane on the GPU the
    workers compile on opens only when every compile is over, so no timing shares a GPU with a compile."""
    gpu: str | None = None
    cpus: set[int] | None = None
    after_compiles: bool = False

    @classmethod
    def parse(cls, spec: str, compile_gpu: str | None) -> Lane:
        gpu, _, cpus = spec.partition(":")
        return cls(gpu or None, cpu_set(cpus), compile_gpu is None or gpu == compile_gpu)

    def __str__(self) -> str:
        return f"gpu {self.gpu or 'default'}" + (f", {len(self.cpus)} cores" if self.cpus else "")


def measure_model(name: str, row: dict[str, Any], url: str, peers: list[str], rounds: int,
                  lane: Lane | None = None, lock: Any = None) -> None:
    """Every peer of every batch of one model, in alternating rounds, each a fresh process; fills `row` (under
    `lock`, when lanes measure other models beside it)."""
    lane = lane or Lane()
    lock = lock or contextlib.nullcontext()
    batches = batches_of(name)
    keys = {b: row["batches"][b]["artifact"].get("key") for b in map(str, batches)}
    for r in range(rounds):
        for peer in peers:
            need = [b for b in batches
                    if len(row["batches"][str(b)]["peers"].get(peer, {}).get("rounds", [])) <= r]
            if peer.startswith("aot"):
                need = [b for b in need if keys[str(b)]]
            if not need:
                continue
            with tempfile.TemporaryDirectory() as cold:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cold}/inductor",
                       "TRITON_CACHE_DIR": f"{cold}/triton"}
                if lane.gpu is not None:
                    env["CUDA_VISIBLE_DEVICES"] = lane.gpu
                res = _fresh(["--child", peer, name, ",".join(map(str, need)),
                              json.dumps({k: v for k, v in keys.items() if v}), url], env, 900, lane.cpus)
            with lock:
                for b in need:
                    slot = row["batches"][str(b)]["peers"].setdefault(peer, {"rounds": []})
                    got_b = res["batches"][str(b)] if "batches" in res else {"error": res.get("error")}
                    slot["rounds"].append({**got_b, "lane": str(lane)})
                    lat = [x["latency_ms"] for x in slot["rounds"] if "latency_ms" in x]
                    slot["latency_ms"] = statistics.median(lat) if lat else None
            got = {b: (res.get("batches", {}).get(str(b)) or {}).get("latency_ms") for b in need}
            print(f"  {name} round {r + 1} {peer} ({lane}): {got}" + (f" ERROR {res['error'][-300:]}" if "error" in res
                                                            else ""), flush=True)


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
    ap.add_argument("--models", default="", help="comma-separated, in this order (default: all of zoo.py)")
    ap.add_argument("--partition", default="", help="I/N: every N-th model of the list from the I-th (1-based)")
    ap.add_argument("--url", default=None, help="a running service; default: start `aotc serve` here")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--state", default=".bench-state", help="service data and exported models (kept for resuming)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no model's measurement after this long")
    ap.add_argument("--workers", type=int, default=3, help="GPU worker processes (compiles overlap)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of the peers")
    ap.add_argument("--max-autotune", action="store_true", help="add torch.compile(mode='max-autotune')")
    ap.add_argument("--compile-gpu", default=None, help="the GPU (CUDA_VISIBLE_DEVICES) the workers compile on")
    ap.add_argument("--worker-cpus", default=None, help="cores the workers are pinned to, e.g. 8-31")
    ap.add_argument("--lanes", default="", help="where peers are measured, GPU:cores each, e.g. 1:0-7,0:8-15; a "
                    "lane on --compile-gpu opens when the compiles are over, and the others measure meanwhile")
    ap.add_argument("--batch", type=int, default=None, help="this batch only (default: 1 and the serving batch)")
    ap.add_argument("--peers", default="", help=f"comma-separated, a subset of {','.join(PEERS)}")
    ap.add_argument("--profile", action="store_true", help="profile PROFILE_CALLS calls in each peer's process")
    ap.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    global ONLY_BATCH
    ONLY_BATCH = a.batch
    if a.profile:
        os.environ["BENCH_PROFILE"] = "1"  # the peers' processes inherit it
    unknown = set(filter(None, a.peers.split(","))) - set(PEERS)
    if unknown:
        raise SystemExit(f"--peers: unknown {sorted(unknown)}; known: {', '.join(PEERS)}")

    if a.child:
        if os.environ.get("BENCH_CPUS"):  # before torch, so its threads and compile workers inherit it
            os.sched_setaffinity(0, cpu_set(os.environ["BENCH_CPUS"]) or set())
        peer, name, batches, keys, url = a.child
        print(json.dumps(child(peer, name, [int(b) for b in batches.split(",")], json.loads(keys), url)))
        return 0

    import torch

    from bench.zoo import MODELS
    from client import Client
    from compiler.check import device_info

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if results.get("schema", SCHEMA) != SCHEMA:
        raise SystemExit(f"{out} is a schema {results.get('schema', 1)} result; write schema {SCHEMA} elsewhere")
    results.update(schema=SCHEMA, device=torch.cuda.get_device_name(0), device_info=device_info("cuda:0"),
                   date=time.strftime("%Y-%m-%d"), versions=versions())
    results.setdefault("models", {})
    results.setdefault("runs", []).append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]})
    peers = [p for p in PEERS if p != "tc_max_autotune" or a.max_autotune]
    if a.peers:
        peers = [p for p in peers if p in a.peers.split(",")]
    names = a.models.split(",") if a.models else list(MODELS)
    if a.partition:
        i, n = (int(x) for x in a.partition.split("/"))
        names = names[i - 1::n]

    def done(name: str) -> bool:
        row = results["models"].get(name)
        return bool(row) and all(
            len(b["peers"].get(p, {}).get("rounds", [])) >= a.rounds
            or (p.startswith("aot") and not (b.get("artifact") or {}).get("ok"))
            for b in row["batches"].values() for p in peers)

    names = [n for n in names if n not in results["models"] or not done(n)]
    state = Path(a.state).resolve()
    (state / "aotc").mkdir(parents=True, exist_ok=True)
    lanes = [Lane.parse(x, a.compile_gpu) for x in a.lanes.split(",")] if a.lanes else [Lane()]
    if a.worker_cpus:  # the driver exports beside the workers, away from the lanes' cores (before any thread)
        os.sched_setaffinity(0, cpu_set(a.worker_cpus) or set())
    service = [] if a.url else start_service(a.port, state / "aotc", a.workers, a.compile_gpu,
                                             cpu_set(a.worker_cpus))
    url = a.url or f"http://127.0.0.1:{a.port}"
    lock = threading.Lock()

    def save() -> None:
        with lock:
            text = json.dumps(results, indent=1, default=str)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(out)

    submitted: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
    ready: queue.Queue[str | None] = queue.Queue()
    compiled = threading.Event()

    def collect() -> None:
        """Each model's compiles, in order; a model whose batches are all settled goes to the lanes at once."""
        with Client(url, cache_dir=state / "client-cache", timeout=300) as c:
            for _ in names:
                name, entries = submitted.get()
                with lock:
                    row = results["models"].setdefault(name, {"family": MODELS[name].family, "batches": {}})
                for b in batches_of(name):
                    got = wait_artifact(c, entries[str(b)])
                    with lock:
                        row["batches"].setdefault(str(b), {"peers": {}})["artifact"] = got
                    print(f"{name} b={b}: compiled ok={got['ok']} "
                          f"{got.get('compile_s') or str(got.get('error', ''))[:300]}", flush=True)
                save()
                ready.put(name)
        compiled.set()
        for _ in lanes:
            ready.put(None)

    def measure(lane: Lane) -> None:
        if lane.after_compiles and (len(lanes) > 1 or a.compile_gpu is not None):
            compiled.wait()
            print(f"compiles over: lane {lane} opens", flush=True)
        while (name := ready.get()) is not None:
            if time.perf_counter() - T_START > a.budget_s:
                print(f"budget reached; not measured: {name}", flush=True)
                continue
            t0 = time.perf_counter()
            row = results["models"][name]
            try:
                measure_model(name, row, url, peers, a.rounds, lane, lock)
            except Exception as e:  # one model's trouble must not lose the others' figures
                with lock:
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
            with lock:
                row["bench_s"] = row.get("bench_s", 0.0) + time.perf_counter() - t0
            save()
            print(f"{name}: measured in {time.perf_counter() - t0:.0f} s on lane {lane}", flush=True)

    try:
        # Every model still to measure is (re)submitted: a service started by an earlier run is gone with its
        # machine, and on a service that has the artifact the submit is a cache hit.
        threads = [threading.Thread(target=submit_all, args=(names, url, state, submitted), daemon=True),
                   threading.Thread(target=collect, daemon=True)]
        threads += [threading.Thread(target=measure, args=(lane,), daemon=True) for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:  # the API and workers first (a worker hands its job back through Redis), Redis (the last) after
        for p in service[:-1]:
            p.terminate()
        for p in service:
            if p is service[-1]:
                p.terminate()
            p.wait(60)
    if a.profile:
        print(profile_table(results, ("tc_reduce_overhead", "aot_graphs")))
    return 0


def profile_table(results: dict[str, Any], pair: tuple[str, str]) -> str:
    """Two peers' profiles side by side, per model and batch: latency, kernels per call, their summed time and span,
    and the kernel families whose time differs most between the two (the second's minus the first's)."""
    lines = []
    for name, row in results.get("models", {}).items():
        for b, brow in row.get("batches", {}).items():
            got = {}
            for p in pair:
                rounds = (brow["peers"].get(p) or {}).get("rounds", [])
                prof = [r["profile"] for r in rounds if (r.get("profile") or {}).get("kernels_per_call")]
                if prof:
                    got[p] = (brow["peers"][p].get("latency_ms"), prof[-1])
            if len(got) < 2:
                continue
            (la, pa), (lb, pb) = got[pair[0]], got[pair[1]]
            lines.append(f"{name} b={b}: {pair[1]} {lb:.3f} ms against {pair[0]} {la:.3f} ms ({la / lb:.3f}x); "
                         f"kernels/call {pb['kernels_per_call']:.0f} vs {pa['kernels_per_call']:.0f}, kernel us "
                         f"{pb['kernel_us_per_call']:.1f} vs {pa['kernel_us_per_call']:.1f}, span us "
                         f"{pb['span_us_per_call']:.1f} vs {pa['span_us_per_call']:.1f}")
            fa, fb = pa.get("flushed") or {}, pb.get("flushed") or {}
            for k in ("host_us", "idle_after_flush_us", "span_after_flush_us", "isolated_us", "back_to_back_us",
                      "graph_replay_only_us", "back_to_back_no_clone_us",
                      "trace_gap_us"):
                if fa.get(k) is not None or fb.get(k) is not None:
                    lines.append(f"    {k}: {fb.get(k) or float('nan'):.1f} vs {fa.get(k) or float('nan'):.1f}")
            for peer, fl in ((pair[1], fb), (pair[0], fa)):
                lines.append(f"    {peer} largest gaps in one call (us, before, after): "
                             f"{fl.get('trace_top_gaps', [])[:5]}")
            fams = set(pa["families"]) | set(pb["families"])
            diff = sorted(((pb["families"].get(f, 0.0) - pa["families"].get(f, 0.0), f) for f in fams),
                          key=lambda d: -abs(d[0]))
            for d, f in diff[:6]:
                lines.append(f"    {d:+8.1f} us  {f}  ({pb['families'].get(f, 0.0):.1f} vs "
                             f"{pa['families'].get(f, 0.0):.1f})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
