"""The artifact check: load the package, run it on random inputs of the requested shapes, compare with the
exported program run eagerly, and time both; then try what an attacker would feed it (compiler.adversarial: every
integer input at its boundaries and out of range, where the package must raise exactly where eager raises). On
CUDA it also captures the package's run in a CUDA graph (compiler/cudagraphs.py, what
`Client.load(..., cuda_graphs=True)` replays), checks the replay against eager and times it, so the artifact's
record says whether graphs pay for this model and shape. Run it in a fresh process: a package can crash whoever
loads it.

Timings (`measure`) are what `triton.testing.do_bench` would report: on CUDA, CUDA events around each call, after a
warm-up by time, with L2 flushed before each call, over enough calls to fill a time budget; on a CPU, wall-clock per
call the same way. Each figure keeps its median and its spread (quartiles, min, max), and the check records the
device's name and clocks beside them: lookup compares only figures taken the same way on the same kind of device.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler import weights as weights_mod
from compiler.adversarial import Oracle, Prestarted, check_adversarial, oracle_at, refuse_failures
from compiler.compat import pytree
from compiler.compat.aoti import aoti_load_package, constant_fqns, load_for_graphs, native_graph_support
from compiler.device import cpu_name
from compiler.errors import CheckFailed, first_line
from compiler.fp64 import NONFINITE_PLACES, float64_run
from compiler.loading import load_program, on_device

log = logging.getLogger("aotc.check")

# Error allowed, as max|compiled - eager| / max(max|eager|, 1), by output dtype. Compiled code reorders
# reductions and fuses ops, so low-precision dtypes differ by a few ulps of their own.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
# A package compiled with precision=bf16/fp16 computes in that dtype whatever its outputs' dtype: the tolerance is
# at least that of the compute dtype.
PRECISION_TOLERANCE: dict[str, float] = {"keep": 0.0, "bf16": TOLERANCE[torch.bfloat16],
                                          "fp16": TOLERANCE[torch.float16]}


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# How each latency is taken; lookup compares only figures of one method (records without one are "legacy": the
# median of 20 wall-clock calls after 3 warm-up calls, synchronising after each).
METHOD_CUDA = "cuda-events-l2flush"
METHOD_CPU = "wall-clock"
L2_FLUSH_BYTES = 256 * 2**20  # what do_bench zeroes before each call: more than any GPU's L2


# Set (`untimed()`) when a timing pass of its own follows the check (compiler/timing.py, under the device lock): the
# check then runs beside compiles and other checks, so it must not spend the device on figures nobody keeps, nor
# disturb the timing pass of another job.
_UNTIMED: contextvars.ContextVar[bool] = contextvars.ContextVar("aotc_check_untimed", default=False)
METHOD_UNTIMED = "untimed-one-call"


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Within: `measure` times one call only (method METHOD_UNTIMED), a figure the timing pass replaces."""
    token = _UNTIMED.set(True)
    try:
        yield
    finally:
        _UNTIMED.reset(token)


MEASURE_WARMUP_MS, MEASURE_REP_MS = 100.0, 400.0  # `measure`'s warm-up and timed calls, by default


def measure(fn: Callable[[], Any], device: str, *, warmup_ms: float = MEASURE_WARMUP_MS,
            rep_ms: float = MEASURE_REP_MS, min_reps: int = 10, max_reps: int = 2000,
            budget_s: float = 4.0) -> dict[str, Any]:
    """Milliseconds per call of `fn`, as do_bench takes them: estimate from 5 calls (1 if it is slow), warm up for
    `warmup_ms` (at least 3 calls), then time as many calls as fill `rep_ms` (between `min_reps` and `max_reps`,
    fewer when a call is so slow that `budget_s` would not hold them, but at least 3). On CUDA each call sits between
    two CUDA events and L2 is flushed before it; on a CPU each is timed by the wall clock. The median, quartiles,
    min and max."""
    cuda = device.startswith("cuda")
    if _UNTIMED.get():
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        one = round((time.perf_counter() - t0) * 1e3, 5)
        return {"median_ms": one, "p25_ms": one, "p75_ms": one, "iqr_ms": 0.0, "min_ms": one, "max_ms": one,
                "reps": 1, "warmup_reps": 0, "method": METHOD_UNTIMED}
    fn()
    sync_device(device)
    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device) if cuda else None

    def timed(n: int, within_s: float | None = None) -> list[float]:
        if flush is not None:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            for a, b in zip(starts, ends, strict=True):
                flush.zero_()
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(starts, ends, strict=True)]
        out: list[float] = []
        stop = time.perf_counter() + within_s if within_s is not None else None
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
            # Calls that turn far slower than the estimate (OpenMP threads waiting their turn on a CPU other
            # processes share) must not stretch the pass past its budget: 2,000 reps planned from a 0.05 ms
            # estimate once took 180 s on the 2-core box. At least 3 samples are kept.
            if stop is not None and len(out) >= 3 and time.perf_counter() > stop:
                break
        return out

    first = timed(1)[0]
    estimate = max(first if first > 10.0 else statistics.fmean(timed(5)), 1e-3)  # a slow call needs no more
    warm = max(3, min(math.ceil(warmup_ms / estimate), max_reps))
    warm = min(warm, max(3, int(budget_s * 250 / estimate)))  # warm-up takes at most a quarter of the budget
    timed(warm, budget_s / 4)
    reps = max(min_reps, min(math.ceil(rep_ms / estimate), max_reps))
    reps = max(3, min(reps, int(budget_s * 750 / estimate)))
    samples = sorted(timed(reps, budget_s * 3 / 4))
    reps = len(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [samples[0]] * 3
    return {"median_ms": round(statistics.median(samples), 5), "p25_ms": round(q[0], 5), "p75_ms": round(q[2], 5),
            "iqr_ms": round(q[2] - q[0], 5), "min_ms": round(samples[0], 5), "max_ms": round(samples[-1], 5),
            "reps": reps, "warmup_reps": warm, "method": METHOD_CUDA if cuda else METHOD_CPU}


def device_info(device: str) -> dict[str, Any]:
    """The name, kind and clocks of the device the check timed on (torch's device properties; no nvidia-smi)."""
    if not device.startswith("cuda"):
        return {"kind": "cpu", "name": cpu_name(), "threads": torch.get_num_threads()}
    index = torch.device(device).index or 0
    p = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {"kind": "cuda", "name": p.name, "capability": f"sm{p.major}{p.minor}",
                            "sm_count": p.multi_processor_count, "memory_bytes": p.total_memory}
    for attr, key in (("clock_rate", "sm_clock_max_khz"), ("memory_clock_rate", "memory_clock_max_khz"),
                      ("memory_bus_width", "memory_bus_bits"), ("L2_cache_size", "l2_bytes")):
        if hasattr(p, attr):  # torch 2.13 has them all; older builds fewer
            info[key] = int(getattr(p, attr))
    try:  # the current SM clock needs NVML (pynvml), which images may lack
        info["sm_clock_now_mhz"] = int(torch.cuda.clock_rate(index))
    except Exception:  # noqa: BLE001 - optional
        pass
    return info


OPT_IN = ("set the compile option allow_nonfinite=true (aotc compile --allow-nonfinite) if this model's outputs "
          "are meant to hold NaN or inf")


def _nonfinite(t: torch.Tensor) -> dict[str, int]:
    """NaN, +inf and -inf counts of a floating or complex tensor (a complex value counts once, by its worst part)."""
    if t.is_complex():
        t = torch.where(torch.isnan(t.real) | torch.isnan(t.imag), float("nan"), t.abs())
    return {"nan": int(torch.isnan(t).sum()), "posinf": int(torch.isposinf(t).sum()),
            "neginf": int(torch.isneginf(t).sum())}


def _describe(counts: dict[str, int]) -> str:
    n = counts["nan"] + counts["posinf"] + counts["neginf"]
    return f"{n} non-finite values ({counts['nan']} NaN, {counts['posinf']} +inf, {counts['neginf']} -inf)"


def compare(expected: Any, actual: Any, min_tolerance: float = 0.0, allow_nonfinite: bool = False) -> dict[str, Any]:
    """Compare the compiled result with eager. Any NaN or inf in either fails, naming the output and the counts,
    unless `allow_nonfinite`: then both must hold the same non-finite values in the same places, the finite rest
    is compared as usual, and the counts are recorded (`nonfinite`) with a note."""
    exp, exp_spec = pytree.tree_flatten(expected)
    act, act_spec = pytree.tree_flatten(actual)
    if len(exp) != len(act):
        return {"ok": False, "why": f"{len(act)} outputs, eager gives {len(exp)}"}
    worst: dict[str, Any] = {"ok": True, "max_abs_err": 0.0, "max_rel_err": 0.0, "tolerance": 0.0}
    for k, (e, a) in enumerate(zip(exp, act)):
        if not isinstance(e, torch.Tensor):
            if e != a:
                return {"ok": False, "why": f"output {k} is {a!r}, eager gives {e!r}"}
            continue
        a = torch.as_tensor(a)
        if tuple(a.shape) != tuple(e.shape):
            return {"ok": False, "why": f"output {k} has shape {tuple(a.shape)}, eager gives {tuple(e.shape)}"}
        if e.dtype.is_floating_point or e.dtype.is_complex:
            ce, ca = _nonfinite(e.detach().cpu()), _nonfinite(a.detach().cpu())
            if any(ce.values()) or any(ca.values()):
                entry = {"output": k, "numel": e.numel(), "eager": ce, "compiled": ca}
                worst.setdefault("nonfinite", []).append(entry)
                if not allow_nonfinite:
                    return {**worst, "ok": False, "why": (
                        f"output {k} ({e.dtype}, {e.numel()} values) holds {_describe(ca)} in the compiled result "
                        f"and {_describe(ce)} in eager; a non-finite result is refused: {OPT_IN}")}
        if not e.dtype.is_floating_point:
            if not torch.equal(e.cpu(), a.cpu().to(e.dtype)):
                return {"ok": False, "why": f"output {k} ({e.dtype}) differs from eager"}
            continue
        e64, a64 = e.detach().double().cpu(), a.detach().double().cpu()
        same_places = all(torch.equal(f(e64), f(a64)) for f in (torch.isnan, torch.isposinf, torch.isneginf))
        if not same_places:
            return {**worst, "ok": False, "why": f"output {k} {NONFINITE_PLACES}"}
        if "nonfinite" in worst and worst["nonfinite"][-1]["output"] == k:
            worst.setdefault("notes", []).append(
                f"output {k} holds {_describe(worst['nonfinite'][-1]['eager'])} in eager and compiled alike at "
                "these inputs; accepted because allow_nonfinite is set (the finite values are compared)")
        finite = torch.isfinite(e64)
        e64, a64 = torch.where(finite, e64, 0.0), torch.where(finite, a64, 0.0)
        if e64.numel() and bool(finite.any()) and not e64.any():
            worst.setdefault("notes", []).append(
                f"output {k} is all zeros in eager at these inputs, so this comparison shows little "
                "(a model with zero-initialised weights?)")
        abs_err = float((e64 - a64).abs().max()) if e64.numel() else 0.0
        rel_err = abs_err / max(float(e64.abs().max()) if e64.numel() else 0.0, 1.0)
        tol = max(TOLERANCE.get(e.dtype, 1e-4), min_tolerance)
        worst["max_abs_err"] = max(worst["max_abs_err"], abs_err)
        if rel_err >= worst["max_rel_err"]:
            worst["max_rel_err"], worst["tolerance"] = rel_err, tol
        if rel_err > tol:
            worst["ok"] = False
            worst["why"] = f"output {k} ({e.dtype}) is off by {rel_err:.3g} relative to eager; tolerance {tol:g}"
    return worst


# Graphs "pay" when the graph's median is at least this much below the plain run's.
GRAPH_PAYS = 0.95


class _Phases:
    """Seconds per part of the check, for its record ("phases"): where a check's time went, in the order they ran."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = round(now - self._t, 3)
        self._t = now

    def restart(self) -> float:
        """The next phase starts now; returns the seconds since the last one ended (an early check's wait for its
        package, which is no phase of the check)."""
        now = time.perf_counter()
        idle, self._t = now - self._t, now
        return round(idle, 3)


Case = tuple[str, Any, tuple, dict, Any]  # label, shapes, args, kwargs, eager's output


def eager_cases(model_path: str, spec: inputs_mod.Spec, device: str, seed: int, rep_ms: float = MEASURE_REP_MS,
                clock: _Phases | None = None,
                ) -> tuple[Any, torch.nn.Module, list[tuple[str, Any, tuple, dict, Any, dict[str, Any]]]]:
    """The program, its eager module on `device`, and per point of `spec` (label, shapes, args, kwargs, eager's
    output, eager's `measure` over `rep_ms`). Eager runs first, for every point, before any package is loaded: on
    CPUs a package brings its own OpenMP runtime, and two runtimes spinning on the same cores would slow whichever
    runs second."""
    ep, eager, cases, _ = eager_outputs(model_path, spec, device, seed, clock)
    return ep, eager, [(*case, eager_time(eager, case, device, rep_ms)) for case in cases]


def eager_outputs(model_path: str, spec: inputs_mod.Spec, device: str, seed: int, clock: _Phases | None = None,
                  ) -> tuple[Any, torch.nn.Module, list[Case], list[tuple[int, int] | None]]:
    """The program, its eager module on `device`, per point of `spec` eager's output on the check's random inputs
    (CheckFailed, saying why, where eager refuses them), and the integer ranges they were drawn from (int_ranges)."""
    ep = on_device(load_program(model_path), device)
    eager = ep.module()
    eager.to(device)
    if clock is not None:
        clock.done("program")
    ranges = inputs_mod.int_ranges(ep)
    cases: list[Case] = []
    for label, shapes in inputs_mod.points(spec).items():
        flat = inputs_mod.random_inputs(spec, shapes, device, ranges, seed)
        args, kwargs = inputs_mod.call_args(ep, flat)
        with torch.inference_mode():
            try:
                expected = eager(*args, **kwargs)
            except Exception as e:
                raise CheckFailed(_refused_samples(spec, ranges, label, e), stage="check") from None
        cases.append((label, shapes, args, kwargs, expected))
    return ep, eager, cases, ranges


def eager_time(eager: torch.nn.Module, case: Case, device: str, rep_ms: float = MEASURE_REP_MS) -> dict[str, Any]:
    """Eager's `measure` at one case of `eager_outputs`."""
    _, _, args, kwargs, _ = case
    with torch.inference_mode():
        return measure(lambda: eager(*args, **kwargs), device, rep_ms=rep_ms)


def _refused_samples(spec: inputs_mod.Spec, ranges: list[tuple[int, int] | None], label: str,
                     e: Exception) -> str:
    """Why the check cannot start when eager refuses its own random inputs: the user's to fix, said as such."""
    drawn = [f"'{spec[k]['name']}' in [{r[0]}, {r[1]})" for k in inputs_mod.integer_inputs(spec)
             if k < len(ranges) and (r := ranges[k]) is not None]
    where = (f"; its integer inputs are drawn from the range of values the upload's example inputs hold "
             f"({', '.join(drawn)}; where that range starts below 0, from 0 up, with its lowest value at one element "
             f"in {inputs_mod.SENTINEL_SHARE}), so the program must accept every value there: export it with "
             f"example inputs it accepts throughout their range" if drawn else "")
    return (f"eager PyTorch raises at the check's own random inputs at {label} shapes, so nothing can be compared: "
            f"{first_line(e).rstrip('.')}{where}")


@dataclass
class Prepared:
    """The part of a check that needs no package (`prepare_check`): the program on the device, eager's output at
    every point, the probes' zygotes started, and (`decided`) eager's verdict on each adversarial case. The worker's
    early check makes it while the compile runs, then waits for the package (worker.earlycheck)."""

    model_path: str
    spec: inputs_mod.Spec
    device: str
    ep: Any
    eager: torch.nn.Module | None
    cases: list[Case]
    ranges: list[tuple[int, int] | None]
    clock: _Phases
    early: Prestarted | None
    base: list[torch.Tensor] = field(default_factory=list)
    decided: Oracle | None = None

    def drop_eager(self) -> None:
        """Lets go of the eager module and its outputs (one copy of the weights at a time: the probes load theirs)."""
        self.eager, self.cases = None, []

    def close(self) -> None:
        if self.early is not None:
            self.early.close()


def prepare_check(model_path: str, spec: inputs_mod.Spec, device: str, seed: int = 0, adversarial: bool = True,
                  oracle: bool = False) -> Prepared:
    """A check's part before its package: the probes' zygotes first (Prestarted, so that they import torch while
    the rest runs), the program and eager's outputs, and with `oracle` eager's verdict on every adversarial case
    (which a check run at once decides only after the plain run passed). No figure is taken: eager is timed when
    the package has come (`check_artifact`), since an early check waits beside a compile."""
    clock = _Phases()
    early = Prestarted(device, spec) if adversarial else None
    try:
        ep, eager, cases, ranges = eager_outputs(model_path, spec, device, seed, clock)
        clock.done("eager")
        prepared = Prepared(model_path, spec, device, ep, eager, cases, ranges, clock, early)
        if adversarial:
            _, shapes = next(iter(inputs_mod.points(spec).items()))
            prepared.base = inputs_mod.random_inputs(spec, shapes, "cpu", ranges, seed)
            if oracle:
                prepared.decided = oracle_at(model_path, spec, device, ep, prepared.base, shapes, ranges)
                clock.done("oracle")
        return prepared
    except BaseException:
        if early is not None:
            early.close()
        raise


def check_artifact(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str, seed: int = 0,
                   precision: str = "keep", allow_nonfinite: bool = False, graphs: bool = True,
                   adversarial: bool = True, prepared: Prepared | None = None) -> dict[str, Any]:
    """Run the package and the program eagerly at every point of `spec` and compare (see `compare`). Raises
    CheckFailed when they disagree, or when any output holds NaN or inf and `allow_nonfinite` is not set. On CUDA
    (unless `graphs=False`) the package's run is also captured in a CUDA graph per point, checked and timed. Then
    (unless `adversarial=False`, which only tests use) the adversarial cases at the smallest point, in probe
    processes (compiler.adversarial): CheckFailed, naming the input and the value, where the package returns what
    eager refuses or disagrees with what eager returns. The summary's `adversarial` says what ran. `prepared`: the
    part before the package, made ahead by `prepare_check` for this program, spec, device and seed (closed here);
    without it the check makes it first."""
    ahead = prepared is not None
    if prepared is None:
        prepared = prepare_check(model_path, spec, device, seed, adversarial)
    try:
        return _check_artifact(prepared, package_path, precision, allow_nonfinite, graphs, ahead)
    finally:
        prepared.close()


def _check_artifact(prepared: Prepared, package_path: str, precision: str, allow_nonfinite: bool, graphs: bool,
                    ahead: bool) -> dict[str, Any]:
    model_path, spec, device, ep, eager, clock = (prepared.model_path, prepared.spec, prepared.device, prepared.ep,
                                                  prepared.eager, prepared.clock)
    assert eager is not None, "a prepared check runs once"
    idle = clock.restart()
    # Eager is timed before any package is loaded (eager_cases says why).
    cases = [(*case, eager_time(eager, case, device)) for case in prepared.cases]
    clock.done("eager_timed")
    ranges = prepared.ranges
    tolerance = PRECISION_TOLERANCE.get(precision, 0.0)
    weights_path = weights_mod.sidecar(package_path)
    weights_summary: dict[str, Any] | None = None
    if weights_path.exists():
        # A weightless package: bind its blob as a client will (user-managed), after proving the blob is the
        # program's own tensors and that the package reads every one of them from it.
        blob = weights_mod.load(weights_path, device)
        weights_mod.verify_blob(ep, blob, precision)
        compiled = aoti_load_package(package_path, device, weights=blob)
        fqns = constant_fqns(compiled)
        weights_mod.check_bound(fqns, blob)
        weights_summary = {"bound": "user_managed", "constants": len(fqns), "package_fqns": sorted(fqns),
                           "bytes": weights_path.stat().st_size}
    else:
        compiled = aoti_load_package(package_path, device)
    clock.done("load")
    results = []
    for label, shapes, args, kwargs, expected, eager_t in cases:
        with torch.inference_mode():
            cmp = compare(expected, compiled(*args, **kwargs), tolerance, allow_nonfinite)
            compiled_t = measure(functools.partial(compiled, *args, **kwargs), device)
        eager_ms, compiled_ms = eager_t["median_ms"], compiled_t["median_ms"]
        results.append({"point": label, "shapes": {i["name"]: s for i, s in zip(spec, shapes)}, **cmp,
                        "eager_ms": round(eager_ms, 4), "compiled_ms": round(compiled_ms, 4),
                        "speedup": round(eager_ms / compiled_ms, 3) if compiled_ms > 0 else None,
                        "latency": {"eager": eager_t, "compiled": compiled_t}})
    failed = [r for r in results if not r["ok"]]
    clock.done("plain")
    if weights_summary is not None and not failed:
        # The package follows its weights: perturbed in place, eager and the package must still agree.
        _, _, args0, kwargs0, _, _ = cases[0]
        weights_summary["perturbed"] = weights_mod.follows(
            eager, blob, precision, functools.partial(_both, eager, compiled, args0, kwargs0),
            lambda e, a: compare(e, a, tolerance, allow_nonfinite),
            reference=functools.partial(float64_run, args=args0, kwargs=kwargs0), tolerance=tolerance)
        del blob
        clock.done("follows")
    del compiled  # one copy of the weights at a time: the graph check and the probes load their own
    graph_summary: dict[str, Any] = {"impl": None, "captured": False}
    if not device.startswith("cuda"):
        graph_summary["reason"] = "CUDA graphs need a CUDA device"
    elif not graphs:
        graph_summary["reason"] = "not asked for"
    elif failed:
        graph_summary["reason"] = "the plain run disagrees with eager"
    else:
        torch.cuda.empty_cache()
        graph_summary = _check_graphs(package_path, device, cases, results, tolerance, allow_nonfinite)
        clock.done("graphs")
    first = results[0]
    summary = {
        "passed": not failed,
        "device": device,
        "device_info": device_info(device),
        "precision": precision,
        "points": results,
        "max_abs_err": max(r.get("max_abs_err", 0.0) for r in results),
        "max_rel_err": max(r.get("max_rel_err", 0.0) for r in results),
        "eager_ms": first["eager_ms"],
        "compiled_ms": first["compiled_ms"],
        "speedup": first["speedup"],
        "latency": {"method": first["latency"]["compiled"]["method"], **first["latency"]},
        "graph_ms": first.get("graph_ms"),
        "graphs": graph_summary,
        "notes": sorted({n for r in results for n in r.get("notes", [])}),
        "allow_nonfinite": allow_nonfinite,
        "nonfinite": [{"point": r["point"], **n} for r in results for n in r.get("nonfinite", [])],
        "weights": weights_summary,
        "phases": clock.phases,
    }
    if failed:
        raise CheckFailed(f"artifact disagrees with eager at {failed[0]['point']} shapes: {failed[0]['why']}",
                          stage="check", excerpt=str(summary))
    if ahead:
        summary["early"] = {"idle_s": idle}
    if prepared.early is not None:
        label, shapes = next(iter(inputs_mod.points(spec).items()))
        del eager, cases
        prepared.drop_eager()  # the probes load their own copies
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        found = check_adversarial(model_path, package_path, spec, device, ep, prepared.base, shapes, ranges,
                                  tolerance, zygotes=prepared.early.take(), decided=prepared.decided)
        summary["adversarial"] = {"point": label, **found}
        clock.done("adversarial")
        refuse_failures(found, "artifact", f" at {label} shapes")
    return summary


def _both(eager: Callable[..., Any], compiled: Callable[..., Any], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return eager(*args, **kwargs), compiled(*args, **kwargs)


def _check_graphs(package_path: str, device: str, cases: list[Any], results: list[dict[str, Any]],
                  tolerance: float, allow_nonfinite: bool) -> dict[str, Any]:
    """Capture the package's run at each point in a CUDA graph, compare the replay with eager and time it (copy in,
    replay, clone out: what a `cuda_graphs=True` load costs per call). Adds `graph_ms`, `graph_speedup` (over the
    plain run), `graph` and `latency.graph` to each point's result; returns the summary. A failure here never fails
    the check: the plain run is what was checked, and the record says why graphs are off."""
    from compiler.cudagraphs import GraphRunner, signature

    impl = native_graph_support() or "aotc"
    try:
        pkg = load_for_graphs(package_path, device)
    except RuntimeError as e:
        return {"impl": impl, "captured": False, "reason": str(e)}
    runner = GraphRunner(pkg.run_flat, torch.device(device))
    captured = []
    for (label, _, args, kwargs, expected, _), r in zip(cases, results, strict=True):
        flat = pkg.flat_inputs(args, kwargs)
        try:
            with torch.inference_mode():
                out = pkg.unflatten(runner(flat))
                row = runner.stat(signature(flat))
                if runner.last != "graph":
                    r["graph"] = {"captured": False, "reason": row.get("reason")}
                    continue
                cmp = compare(expected, out, tolerance, allow_nonfinite)
                # The same graph again after other points' graphs: each keeps its own buffers and pool.
                again = compare(expected, pkg.unflatten(runner(flat)), tolerance, allow_nonfinite)
                graph_t = measure(lambda: runner(flat), device)
        except Exception as e:  # noqa: BLE001 - graphs are optional; the plain run passed
            log.warning("CUDA graph at %s failed: %s", label, e)
            r["graph"] = {"captured": False, "reason": f"{type(e).__name__}: {e}"[:500]}
            continue
        ok = cmp["ok"] and again["ok"]
        plain_ms = r["latency"]["compiled"]["median_ms"]
        r["graph"] = {"captured": True, "ok": ok, "max_rel_err": max(cmp.get("max_rel_err", 0.0),
                                                                     again.get("max_rel_err", 0.0)),
                      "memory": row["memory"], "capture_s": row["capture_s"]}
        if not ok:
            r["graph"]["why"] = cmp.get("why") or again.get("why")
            continue
        r["latency"]["graph"] = graph_t
        r["graph_ms"] = round(graph_t["median_ms"], 4)
        r["graph_speedup"] = round(plain_ms / graph_t["median_ms"], 3) if graph_t["median_ms"] > 0 else None
        r["graph"]["pays"] = graph_t["median_ms"] <= GRAPH_PAYS * plain_ms
        captured.append((flat, expected, r))
    # Every point's graph once more, after all were captured: a shape that comes back replays its own graph.
    for flat, expected, r in captured:
        with torch.inference_mode():
            cmp = compare(expected, pkg.unflatten(runner(flat)), tolerance, allow_nonfinite)
        if not cmp["ok"]:
            r["graph"].update(ok=False, pays=False, why=f"after the other points' graphs: {cmp.get('why')}")
    first = results[0].get("graph") or {}
    summary = {"impl": impl, "captured": bool(first.get("captured")), "ok": first.get("ok"),
               "pays": first.get("pays"), "speedup": results[0].get("graph_speedup"),
               "memory_bytes": (first.get("memory") or {}).get("total_bytes"),
               "pays_at": [r["point"] for r in results if (r.get("graph") or {}).get("pays")]}
    if not first.get("captured"):
        summary["reason"] = first.get("reason")
    elif not first.get("ok"):
        summary["reason"] = f"the graph's replay disagrees with eager: {first.get('why')}"
    runner.release()
    return summary
