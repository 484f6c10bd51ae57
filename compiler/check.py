"""The artifact check: load the package, run it on random inputs of the requested shapes, compare with the
exported program run eagerly, and time both. Run it in a fresh process: a package can crash whoever loads it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler.compat import pytree
from compiler.compat.aoti import aoti_load_package
from compiler.errors import CheckFailed
from compiler.loading import load_program

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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], device: str, *, warmup: int = 3, runs: int = 20, budget_s: float = 3.0) -> float:
    """Median milliseconds of `fn`, after warm-up; stops early when over the time budget."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < runs and (len(samples) < 3 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


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
            return {**worst, "ok": False, "why": f"output {k} has NaN or inf where eager has none, or the reverse"}
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


def check_artifact(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str, seed: int = 0,
                   precision: str = "keep", allow_nonfinite: bool = False) -> dict[str, Any]:
    """Run the package and the program eagerly at every point of `spec` and compare (see `compare`). Raises
    CheckFailed when they disagree, or when any output holds NaN or inf and `allow_nonfinite` is not set."""
    ep = load_program(model_path)
    eager = ep.module()
    eager.to(device)
    ranges = inputs_mod.int_ranges(ep)
    cases = []
    # Eager first, for every point, before the package is loaded: on CPUs the package brings its own OpenMP
    # runtime, and two runtimes spinning on the same cores would slow whichever runs second.
    for label, shapes in inputs_mod.points(spec).items():
        flat = inputs_mod.random_inputs(spec, shapes, device, ranges, seed)
        args, kwargs = inputs_mod.call_args(ep, flat)
        with torch.inference_mode():
            expected = eager(*args, **kwargs)
            eager_ms = time_ms(lambda: eager(*args, **kwargs), device)
        cases.append((label, shapes, args, kwargs, expected, eager_ms))
    compiled = aoti_load_package(package_path, device)
    results = []
    for label, shapes, args, kwargs, expected, eager_ms in cases:
        with torch.inference_mode():
            cmp = compare(expected, compiled(*args, **kwargs), PRECISION_TOLERANCE.get(precision, 0.0),
                          allow_nonfinite)
            compiled_ms = time_ms(lambda: compiled(*args, **kwargs), device)
        results.append({"point": label, "shapes": {i["name"]: s for i, s in zip(spec, shapes)}, **cmp,
                        "eager_ms": round(eager_ms, 4), "compiled_ms": round(compiled_ms, 4),
                        "speedup": round(eager_ms / compiled_ms, 3) if compiled_ms > 0 else None})
    failed = [r for r in results if not r["ok"]]
    summary = {
        "passed": not failed,
        "device": device,
        "precision": precision,
        "points": results,
        "max_abs_err": max(r.get("max_abs_err", 0.0) for r in results),
        "max_rel_err": max(r.get("max_rel_err", 0.0) for r in results),
        "eager_ms": results[0]["eager_ms"],
        "compiled_ms": results[0]["compiled_ms"],
        "speedup": results[0]["speedup"],
        "notes": sorted({n for r in results for n in r.get("notes", [])}),
        "allow_nonfinite": allow_nonfinite,
        "nonfinite": [{"point": r["point"], **n} for r in results for n in r.get("nonfinite", [])],
    }
    if failed:
        raise CheckFailed(f"artifact disagrees with eager at {failed[0]['point']} shapes: {failed[0]['why']}",
                          stage="check", excerpt=str(summary))
    return summary
