"""The timing pass: eager, the package, and (on CUDA, for a static artifact) its CUDA-graph replay, timed at every
point of the spec, in a child of its own that the worker runs under the device lock (worker/devlock.py).

The correctness check (compiler.check) runs beside compiles and other checks: it takes no lock, so its own figures
were taken on a busy device and are replaced by these (compiler.speed.with_timing), which the record says were
taken under the lock, after how long a wait, and at what load. The pass is short: one load of the program and the
package, then `compiler.check.measure` per figure (do_bench's method), no adversarial probes and no comparisons
beyond the graph replay's own (a replay that disagrees with eager is not timed).

A dynamic artifact's graph replay is not timed: no client replays it (compiler.speed.NOT_REPLAYABLE).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler.check import GRAPH_PAYS, PRECISION_TOLERANCE, compare, device_info, eager_cases, measure
from compiler.compat.aoti import aoti_load_package, load_for_graphs
from compiler.speed import is_dynamic


def time_artifact(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str, seed: int = 0,
                  graphs: bool = True, precision: str = "keep", allow_nonfinite: bool = False) -> dict[str, Any]:
    """{'points': [{point, eager_ms, compiled_ms, speedup, latency, graph_ms?, graph_speedup?}], 'device_info'},
    each figure `measure`'s median and spread."""
    # Eager first, before the package's OpenMP runtime is loaded (compiler.check.eager_cases says why).
    _, _, with_shapes = eager_cases(model_path, spec, device, seed)
    cases = [(label, args, kwargs, expected, eager_t) for label, _, args, kwargs, expected, eager_t in with_shapes]
    compiled = aoti_load_package(package_path, device)
    points = []
    for label, args, kwargs, _, eager_t in cases:
        with torch.inference_mode():
            compiled_t = measure(functools.partial(compiled, *args, **kwargs), device)
        e, c = eager_t["median_ms"], compiled_t["median_ms"]
        points.append({"point": label, "eager_ms": round(e, 4), "compiled_ms": round(c, 4),
                       "speedup": round(e / c, 3) if c > 0 else None,
                       "latency": {"eager": eager_t, "compiled": compiled_t}})
    del compiled
    if graphs and device.startswith("cuda") and not is_dynamic(spec):
        torch.cuda.empty_cache()
        _time_graphs(package_path, device, cases, points, PRECISION_TOLERANCE.get(precision, 0.0), allow_nonfinite)
    return {"points": points, "device_info": device_info(device)}


def _time_graphs(package_path: str, device: str, cases: list[Any], points: list[dict[str, Any]], tolerance: float,
                 allow_nonfinite: bool) -> None:
    from compiler.cudagraphs import GraphRunner

    try:
        pkg = load_for_graphs(package_path, device)
    except RuntimeError:
        return  # the check recorded why graphs are off
    runner = GraphRunner(pkg.run_flat, torch.device(device))
    try:
        for (_, args, kwargs, expected, _), p in zip(cases, points, strict=True):
            flat = pkg.flat_inputs(args, kwargs)
            with torch.inference_mode():
                out = pkg.unflatten(runner(flat))
                if runner.last != "graph" or not compare(expected, out, tolerance, allow_nonfinite)["ok"]:
                    continue  # not captured, or not right: the check says which; no figure
                graph_t = measure(lambda: runner(flat), device)
            p["latency"]["graph"] = graph_t
            p["graph_ms"] = round(graph_t["median_ms"], 4)
            p["graph_speedup"] = round(p["compiled_ms"] / graph_t["median_ms"], 3) if graph_t["median_ms"] else None
            p["graph_pays"] = graph_t["median_ms"] <= GRAPH_PAYS * p["compiled_ms"]
    finally:
        runner.release()
