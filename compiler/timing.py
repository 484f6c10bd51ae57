"""The timing pass: eager, the package, and (on CUDA, for a static artifact) its CUDA-graph replay, timed at every
point of the spec, in a child of its own that the worker runs under the device lock (worker/devlock.py).

The correctness check (compiler.check) runs beside compiles and other checks: it takes no lock, so its own figures
were taken on a busy device and are replaced by these (compiler.speed.with_timing), which the record says were
taken under the lock, after how long a wait, and at what load. The pass is short: one load of the program and the
package, then `compiler.check.measure` per figure (do_bench's method), no adversarial probes and no comparisons
beyond the graph replay's own (a replay that disagrees with eager is not timed).

Windows (`windows`, AOTC_TIMING_WINDOWS). On one H200 a program's eager figure at its serving batch moved by a
median 1.4-1.5x between `do_bench` runs seconds apart, on every one of 16 cores, while the smallest figure held
(bench/host_noise.py): the host is fast or slow by the moment, for at least one run's 200 ms. With `windows` > 1
each figure is taken in that many windows of 1/windows of the calls, interleaved in rounds (each point's eager,
package and replay, then the next round), and the figure is the window with the smallest median, with every
window's median beside it: the host's quiet moment rather than whichever the pass landed in, for the same number
of calls. On a CPU eager's windows all come before the package is loaded (eager_cases says why).

A dynamic artifact's graph replay is not timed: no client replays it (compiler.speed.NOT_REPLAYABLE).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler.check import (
    GRAPH_PAYS,
    MEASURE_REP_MS,
    PRECISION_TOLERANCE,
    compare,
    device_info,
    eager_cases,
    measure,
)
from compiler.compat.aoti import aoti_load_package, load_for_graphs
from compiler.speed import is_dynamic

WINDOW_WARMUP_MS = 25.0  # a later window's warm-up: its calls ran already, a round ago


def time_artifact(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str, seed: int = 0,
                  graphs: bool = True, precision: str = "keep", allow_nonfinite: bool = False,
                  windows: int = 1) -> dict[str, Any]:
    """{'points': [{point, eager_ms, compiled_ms, speedup, latency, graph_ms?, graph_speedup?}], 'device_info'},
    each figure `measure`'s median and spread; with `windows` > 1, the window with the smallest median and
    `windows_ms`, every window's median, in the order taken."""
    windows = max(1, windows)
    rep_ms = MEASURE_REP_MS / windows
    cuda = device.startswith("cuda")
    # Eager first, before the package's OpenMP runtime is loaded (compiler.check.eager_cases says why).
    _, eager, with_shapes = eager_cases(model_path, spec, device, seed, rep_ms=rep_ms)
    cases = [(label, args, kwargs, expected) for label, _, args, kwargs, expected, _ in with_shapes]
    taken: list[dict[str, list[dict[str, Any]]]] = [{"eager": [eager_t]} for *_, eager_t in with_shapes]
    calls: list[dict[str, Callable[[], Any]]] = [{"eager": functools.partial(eager, *args, **kwargs)}
                                                 for _, args, kwargs, _ in cases]
    if not cuda or windows == 1:  # eager is done before the package loads: its other windows now, then let it go
        _rounds(calls, taken, windows - 1, device, rep_ms)
        for c in calls:
            del c["eager"]
    del eager
    compiled = aoti_load_package(package_path, device)
    for c, (_, args, kwargs, _) in zip(calls, cases, strict=True):
        c["compiled"] = functools.partial(compiled, *args, **kwargs)
    with torch.inference_mode():
        for c, t in zip(calls, taken, strict=True):
            t["compiled"] = [measure(c["compiled"], device, rep_ms=rep_ms)]
    runner = None
    if graphs and cuda and not is_dynamic(spec):
        if windows == 1:  # one copy of the weights at a time: the graph runner loads its own
            for c in calls:
                del c["compiled"]
            del compiled
            torch.cuda.empty_cache()
        runner = _graph_calls(package_path, device, cases, calls, taken,
                              PRECISION_TOLERANCE.get(precision, 0.0), allow_nonfinite, rep_ms)
    try:
        _rounds(calls, taken, windows - 1, device, rep_ms)
    finally:
        if runner is not None:
            runner.release()
    points = [_point(label, t) for (label, *_), t in zip(cases, taken, strict=True)]
    return {"points": points, "device_info": device_info(device), **({"windows": windows} if windows > 1 else {})}


def _rounds(calls: list[dict[str, Callable[[], Any]]], taken: list[dict[str, list[dict[str, Any]]]], n: int,
            device: str, rep_ms: float) -> None:
    """`n` rounds: in each, every point's calls timed once more, in order, each already warm from its first window."""
    with torch.inference_mode():
        for _ in range(n):
            for c, t in zip(calls, taken, strict=True):
                for name, fn in c.items():
                    t[name].append(measure(fn, device, warmup_ms=WINDOW_WARMUP_MS, rep_ms=rep_ms))


def _best(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """A figure from its windows: the one with the smallest median, and every window's median."""
    if len(windows) == 1:
        return windows[0]
    best = dict(min(windows, key=lambda w: w["median_ms"]))
    best["windows_ms"] = [w["median_ms"] for w in windows]
    best["method"] = f"{best['method']}; the smallest median of {len(windows)} windows taken in turn"
    return best


def _point(label: str, taken: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    latency = {name: _best(ws) for name, ws in taken.items()}
    e, c = latency["eager"]["median_ms"], latency["compiled"]["median_ms"]
    p: dict[str, Any] = {"point": label, "eager_ms": round(e, 4), "compiled_ms": round(c, 4),
                         "speedup": round(e / c, 3) if c > 0 else None, "latency": latency}
    if "graph" in latency:
        g = latency["graph"]["median_ms"]
        p["graph_ms"] = round(g, 4)
        p["graph_speedup"] = round(c / g, 3) if g else None
        p["graph_pays"] = g <= GRAPH_PAYS * c
    return p


def _graph_calls(package_path: str, device: str, cases: list[Any], calls: list[dict[str, Callable[[], Any]]],
                 taken: list[dict[str, list[dict[str, Any]]]], tolerance: float, allow_nonfinite: bool,
                 rep_ms: float) -> Any:
    """Each point's graph replay, captured and compared with eager, added to `calls` with its first window timed;
    the runner (to release), or None when the package cannot load for graphs (the check recorded why)."""
    from compiler.cudagraphs import GraphRunner

    try:
        pkg = load_for_graphs(package_path, device)
    except RuntimeError:
        return None
    runner = GraphRunner(pkg.run_flat, torch.device(device))
    try:
        for (_, args, kwargs, expected), c, t in zip(cases, calls, taken, strict=True):
            flat = pkg.flat_inputs(args, kwargs)
            with torch.inference_mode():
                out = pkg.unflatten(runner(flat))
                if runner.last != "graph" or not compare(expected, out, tolerance, allow_nonfinite)["ok"]:
                    continue  # not captured, or not right: the check says which; no figure
                c["graph"] = functools.partial(runner, flat)
                t["graph"] = [measure(c["graph"], device, rep_ms=rep_ms)]
    except BaseException:
        runner.release()
        raise
    return runner
