"""The float64 second opinion: a comparison of the package with eager that failed, judged again against a float64
run of the same weights and inputs.

Two implementations of one model in bf16 (eager's kernels and the package's) may differ by more than the dtype's
tolerance where both are that far from float64, and a value that cancels to zero (the gradient of a bias right before
a norm) differs between any two float32 runs by the size of the terms cancelled. So a value the first comparison
refuses passes where the package is not much farther from float64 than eager is (`judge`):

- its largest element's distance is at most FP64_MULTIPLIER times eager's, plus the tolerance; or
- as torchbench judges (torch._dynamo.utils.same with fp64_ref): its root-mean-square distance is at most
  FP64_MULTIPLIER times eager's, plus a tenth of the tolerance, while its largest element stays within twice the
  first rule's bound. One element far off (an index bug, a frozen weight's effect) still fails.

A package that ignores a weight, or computes something else, is as far from float64 as that moves the value, which
eager is not. Used by the inference check's weight perturbation (compiler.weights.follows), the training check
(compiler.traincheck) and the adversarial probes (compiler.adversarial).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from compiler.compat import pytree
from compiler.specialize import drop_metadata_asserts

__all__ = ["FP64_MULTIPLIER", "OVERFLOW_MARGIN", "judge", "second_opinion", "beyond_range", "double", "float64_copy",
           "float64_run", "float64_peak_run"]

# How much farther from a float64 run the package may be than eager is (torchbench's accuracy check uses 2 to 3).
FP64_MULTIPLIER = 3.0


def _rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double().cpu() - ref).pow(2).mean().sqrt()) if ref.numel() else 0.0


def judge(package: torch.Tensor, eager: torch.Tensor, reference: torch.Tensor, scale: float,
          tolerance: float) -> dict[str, Any]:
    """The two rules of the module's docstring for one value; distances are divided by `scale` (the value's size:
    its largest element, at least 1, or a gradient's own scale). `ok`, the rule that passed it (`largest`, `rms`), and
    the distances of both sides, for the record."""
    r64 = reference.detach().double().cpu()
    if not r64.numel():
        return {"ok": True, "rule": "largest", "package": 0.0, "eager": 0.0, "bound": 0.0}
    e_eager = float((eager.detach().double().cpu() - r64).abs().max()) / scale
    e_pkg = float((torch.as_tensor(package).detach().double().cpu() - r64).abs().max()) / scale
    rms = {"package": _rmse(package, r64) / scale, "eager": _rmse(eager, r64) / scale}
    bound = FP64_MULTIPLIER * e_eager + tolerance
    rms_bound = FP64_MULTIPLIER * rms["eager"] + tolerance / 10
    out = {"package": e_pkg, "eager": e_eager, "bound": bound, "rmse": rms, "rms_bound": rms_bound}
    if e_pkg <= bound:
        return {**out, "ok": True, "rule": "largest"}
    if rms["package"] <= rms_bound and e_pkg <= 2 * bound:
        return {**out, "ok": True, "rule": "rms"}
    return {**out, "ok": False, "rule": None}


def describe(j: dict[str, Any]) -> str:
    """A refused judgment in words."""
    return (f"against float64 the package is off by {j['package']:.3g}, eager by {j['eager']:.3g} (allowed: "
            f"{j['bound']:.3g}; root-mean-square: the package {j['rmse']['package']:.3g}, eager "
            f"{j['rmse']['eager']:.3g}, allowed {j['rms_bound']:.3g} with the largest within {2 * j['bound']:.3g})")


def second_opinion(verdict: dict[str, Any], expected: Any, actual: Any, reference: Any,
                   tolerance: float) -> dict[str, Any]:
    """`verdict`, compiler.check.compare's of (expected, actual), judged again against `reference` (the same
    structure, from `float64_run`) where it failed on a value ("is off by"). Every floating output is judged, each
    relative to its reference's largest element (at least 1) and with its dtype's tolerance (or `tolerance`, the
    precision's, where larger), as compare measures; the verdict passes where all pass. A verdict that failed for
    another reason (shapes, NaN) stands."""
    if verdict.get("ok") or "is off by" not in str(verdict.get("why")):
        return verdict
    from compiler.check import TOLERANCE  # compiler.check imports this module

    flat = [pytree.tree_flatten(x)[0] for x in (expected, actual, reference)]
    if not len(flat[0]) == len(flat[1]) == len(flat[2]):
        return verdict
    worst: dict[str, Any] = {}
    for k, (e, a, r) in enumerate(zip(*flat)):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point() and isinstance(r, torch.Tensor)):
            continue
        scale = max(float(r.detach().abs().max()) if r.numel() else 0.0, 1.0)
        j = {"output": k, **judge(a, e, r, scale, max(tolerance, TOLERANCE.get(e.dtype, 1e-4)))}
        if not j["ok"]:
            return {**verdict, "fp64": j, "why": f"{verdict['why']}; output {k}: {describe(j)}"}
        if not worst or j["package"] / max(j["bound"], 1e-12) > worst["package"] / max(worst["bound"], 1e-12):
            worst = j
    return {**verdict, "ok": True, "why": None, "fp64": worst, "first_judgment": verdict.get("why")}


def double(x: Any) -> Any:
    """A floating tensor in float64 (detached); anything else as it is."""
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


# The floating dtypes a cast or a factory in an exported graph may name, each made float64 in the reference.
NARROW_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` (an exported program's module, or any) computing in float64: its floating weights in
    float64, its dtype asserts dropped, and every floating dtype its graph's ATen ops name widened to float64.

    Export bakes what a model's source computes from a dtype: `.float()`, `.to(x.dtype)`, `torch.full(...,
    dtype=...)` become casts and factories of float32 in the graph. Kept, they put float32 tensors back into the
    float64 run: a mixed op then raises (EfficientViT-B1's attention, computed in float32 and cast back, then a
    convolution of float64 weights: on the H200s its training check had no second opinion), or the reference is
    rounded to float32 inside (Llama's RMSNorm). Widened, the reference is the same computation in float64, which is
    what the second opinion means. `aten.view.dtype` reinterprets bits, not values, and higher-order ops (autocast's
    regions) are left as they are."""
    ref = drop_metadata_asserts(copy.deepcopy(module).double())
    for gm in ref.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for n in gm.graph.nodes:
            if (n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload)
                    or n.target is torch.ops.aten.view.dtype):
                continue
            args, kwargs = pytree.tree_map(_widened, (n.args, n.kwargs))
            if (args, kwargs) != (n.args, n.kwargs):
                n.args, n.kwargs, changed = args, kwargs, True
        if changed:
            gm.recompile()
    return ref


def _widened(x: Any) -> Any:
    return torch.float64 if isinstance(x, torch.dtype) and x in NARROW_FLOATS else x


def float64_run(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`module`'s output in float64 (`float64_copy`, with the floating inputs in float64), on the same device,
    outside any autocast or inference mode."""
    return _run64(module, args, kwargs, walk=False)[0]


def float64_peak_run(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[Any, float | None]:
    """`float64_run`'s output, and its peak: the largest finite magnitude of any floating value the run computed,
    its intermediates included (None where `module` is not one FX graph whose placeholders are the call's flat
    inputs, to walk node by node)."""
    walk = isinstance(module, torch.fx.GraphModule) and len(pytree.tree_leaves((args, kwargs))) == sum(
        n.op == "placeholder" for n in module.graph.nodes)
    return _run64(module, args, kwargs, walk)


class _Peak(torch.fx.Interpreter):
    """Runs a graph as its module would, recording the largest finite magnitude of the floating values its nodes
    compute (`peak`)."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.extra_traceback = False  # an op's own exception, as the module's forward raises it
        self.peak = 0.0

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                finite = t.detach().abs().nan_to_num(nan=0.0, posinf=0.0)
                self.peak = max(self.peak, float(finite.max()))
        return value


def _run64(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], walk: bool
           ) -> tuple[Any, float | None]:
    device = next((x.device.type for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), "cpu")
    with torch.inference_mode(False), torch.no_grad(), torch.autocast(device, enabled=False):
        ref = float64_copy(module)
        args, kwargs = tuple(double(a) for a in args), {k: double(v) for k, v in kwargs.items()}
        try:
            if not walk:
                return ref(*args, **kwargs), None
            assert isinstance(ref, torch.fx.GraphModule)
            runner = _Peak(ref)  # on the graph's flat inputs, as its forward flattens them (run takes no keywords)
            return runner.run(*pytree.tree_leaves((args, kwargs))), runner.peak
        finally:
            del ref


# How close to a narrow dtype's largest finite value a float64 run may come before the narrow runs of the same
# computation may overflow in one order of operations and not in another: a sum of this many such terms, or a few
# products and sums of them, leaves the dtype's range, and two correct implementations reduce, scale and fuse in
# different orders. Seen on an H200: at an int64 extreme of DeBERTa-v3's attention mask (cast to bf16, 9.2e18) its
# float64 run's values reached 1.5e37 to 3.4e38 (bench/overflow_cases.py), and the package held NaN or inf where
# eager held none.
OVERFLOW_MARGIN = 2.0 ** 10

NONFINITE_PLACES = "has NaN or inf where eager has none, or the reverse"  # compiler.check.compare's words


def beyond_range(verdict: dict[str, Any], expected: Any, actual: Any, reference: Any,
                 peak: float | None) -> dict[str, Any]:
    """`verdict` (compiler.check.compare's, after `second_opinion`) accepted where the inputs drive the computation
    out of its dtype's range, so that where it overflows depends on the order of operations; else as it is.

    Accepted only where it failed on the places of non-finite values (NONFINITE_PLACES), and for every floating
    output where eager and the package disagree on which values are finite:
    - the float64 run is finite at each of those places: each non-finite value there is a narrow run overflowing
      (or dividing what underflowed), not the computation's own NaN or inf; and
    - the float64 run's `peak` (`float64_peak_run`) came within OVERFLOW_MARGIN of that output's dtype's largest
      finite value.
    Then no value of the case is compared: near the edge of the range, the finite values of a run that overflowed
    elsewhere mean little. What the check guards is untouched: a package that faults, or returns where eager
    raises, is judged before this. The answer says why (`beyond_range`)."""
    if verdict.get("ok") or NONFINITE_PLACES not in str(verdict.get("why")) or peak is None:
        return verdict
    flat = [pytree.tree_flatten(x)[0] for x in (expected, actual, reference)]
    if not len(flat[0]) == len(flat[1]) == len(flat[2]):
        return verdict
    places, dtypes = 0, set()
    for e, a, r in zip(*flat):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point() and isinstance(r, torch.Tensor)):
            continue
        a = torch.as_tensor(a).detach().cpu()
        differ = torch.isfinite(e.detach().cpu()) != torch.isfinite(a)
        if not bool(differ.any()):
            continue
        if tuple(r.shape) != tuple(differ.shape) or not bool(torch.isfinite(r.detach().cpu()[differ]).all()):
            return verdict  # float64 is not finite there either: the computation's own NaN or inf, misplaced
        if peak < torch.finfo(e.dtype).max / OVERFLOW_MARGIN:
            return verdict
        places += int(differ.sum())
        dtypes.add(str(e.dtype).removeprefix("torch."))
    if not places:
        return verdict
    names = ", ".join(sorted(dtypes))
    why = (f"beyond {names}'s range: eager and the package disagree on which of {places} values are finite, where "
           f"float64 is finite everywhere, and the float64 run reached {peak:.3g}, within {OVERFLOW_MARGIN:g}x of "
           f"{names}'s largest value: where a run overflows depends on its order of operations")
    return {**verdict, "ok": True, "why": None, "beyond_range": why, "first_judgment": verdict.get("why")}
