"""The training check: a train-step package against eager over several optimizer steps, in a fresh process.

What it proves, before the worker signs anything (docs/training.md, docs/security.md):
  - the weights blob is the program's own tensors, and the package reads every one of them (compiler.weights: a
    parameter Inductor inlined or folded is named);
  - the package's flat outputs have the roles the manifest says (compiler.training): their count and shapes;
  - for `STEPS` steps on fresh random batches, each from the same state on both sides: the loss, every other
    output and the gradient of every parameter agree with eager's `loss.backward()` within the tolerance of their
    dtype (compiler.check.TOLERANCE; a gradient relative to its own scale, `grad_scales`), and every buffer the
    program mutates (BatchNorm's running statistics and its batch count) holds what eager's holds after the step:
    the package updates the caller's buffers in place, or the check names the one it did not;
  - the package leaves the caller's parameters as they were (it returns gradients; it writes only the buffers its
    manifest names): one it wrote to is named;
  - between steps, SGD updates eager's parameters with eager's gradients, and the bound parameters and buffers are
    set in place to eager's (`sync`), so a step sees the last step's weights: a parameter the package froze makes
    the next step disagree. The package's own gradients never steer its weights: two correct implementations in
    bf16 (eager's kernels, the package's) differ by rounding, and a deep network amplifies a difference in its
    weights step after step, so after two steps on their own trajectories a package whose gradients were exact
    (float32) was 6x farther from float64 than eager (bench/train_drift.py). Each step checks one step.
Then it times one step of each (eager: forward + backward; the package: one boxed run).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from typing import Any

import torch

from compiler import fp64, training
from compiler import inputs as inputs_mod
from compiler import weights as weights_mod
from compiler.adversarial import check_adversarial, refuse_failures
from compiler.check import TOLERANCE, compare, device_info, measure, sync_device
from compiler.compat import joint as joint_mod
from compiler.compat.aoti import LoadedPackage
from compiler.errors import CheckFailed, first_line
from compiler.loading import load_program, on_device
from compiler.specialize import drop_metadata_asserts

STEPS = 3
# Under autocast, a statistic a step keeps (BatchNorm's running_var) is computed from activations that went through
# every bf16 layer before it, and two bf16 runs (eager's kernels, the package's) differ there by more than the dtype's
# tolerance: ResNet-50's layer4 running_var by 5.07 % at step 2 on an H100 (bf16 tolerance 5 %). A buffer is compared
# at this multiple of the dtype's tolerance; a frozen one is caught exactly (the step left it as it was, where eager's
# changed).
BUFFER_AUTOCAST_FACTOR = 4
LR = 0.05  # large enough that a frozen parameter shows in the next step's loss, small enough to stay finite


def live_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by FQN, as the tensors the module holds (not copies)."""
    out: dict[str, torch.Tensor] = {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)}
    out.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if isinstance(b, torch.Tensor)})
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit equal (a NaN equals itself, where torch.equal says no)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def sync(eager: torch.nn.Module, bound_params: dict[str, torch.nn.Parameter], live: dict[str, torch.Tensor],
         mutated: list[str]) -> None:
    """Set the bound parameters and the mutated buffers, in place (the tensors the package reads), to eager's."""
    with torch.no_grad():
        for name, p in eager.named_parameters():
            bound_params[name].copy_(p)
        for fqn in mutated:
            e = weights_mod.module_tensor(eager, fqn)
            if e is not None and fqn in live:
                live[fqn].copy_(e)


# mixed precision (precision=bf16/fp16 with mode=training): the step runs under torch.autocast to this dtype
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cmp(name: str, expected: torch.Tensor, actual: torch.Tensor, floor: float = 0.0) -> dict[str, Any]:
    got = compare(expected.detach(), actual.detach(), max(floor, TOLERANCE.get(expected.dtype, 0.0)))
    return {**got, "what": name}


# A gradient is compared relative to its own largest magnitude, not to 1 as outputs are (compiler.check.compare):
# gradients are often far below 1, where an absolute 1e-4 would pass anything. The floor, this fraction of the largest
# gradient of any parameter, keeps gradients that are zero up to rounding (a bias before BatchNorm) from failing.
GRAD_FLOOR = 0.1


def grad_scales(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, what its gradient's errors are divided by: max(max|g|, GRAD_FLOOR x the largest of all)."""
    tops = {k: float(g.detach().abs().max()) if g.numel() else 0.0 for k, g in grads.items()}
    floor = max(max(tops.values(), default=0.0) * GRAD_FLOOR, 1e-30)
    return {k: max(v, floor) for k, v in tops.items()}


def grad_error(expected: torch.Tensor, actual: torch.Tensor, scale: float) -> float:
    """max|expected - actual| / scale, in float64."""
    if not expected.numel():
        return 0.0
    return float((expected.detach().double() - actual.detach().double()).abs().max()) / scale


def autocast(device: str, precision: str) -> Any:
    """The autocast context eager runs its forward under for `precision` ("keep": none)."""
    if precision not in AUTOCAST:
        return contextlib.nullcontext()
    return torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=AUTOCAST[precision])


def check_training(model_path: str, package_path: str, spec: inputs_mod.Spec, device: str, loss_output: int = 0,
                   seed: int = 0, steps: int = STEPS, lr: float = LR, precision: str = "keep",
                   adversarial: bool = True) -> dict[str, Any]:
    """Check the train-step package at `package_path` against the uploaded program at `model_path` (see the module
    docstring). Raises CheckFailed naming the step and the output, gradient or buffer that disagrees. With a
    `precision` (bf16, fp16), eager's forward runs under the same autocast, and every comparison allows at least
    that dtype's tolerance (the loss and gradients are float32, computed through bf16 matmuls)."""
    floor = TOLERANCE[AUTOCAST[precision]] if precision in AUTOCAST else 0.0
    buffer_floor = floor * BUFFER_AUTOCAST_FACTOR
    t0 = time.perf_counter()
    parts: dict[str, float] = {}  # where the check's time went, by part (the summary's `seconds`)
    ep = load_program(model_path)
    joint = joint_mod.joint_program(ep, loss_output)
    roles, mutated = joint_mod.roles(joint)
    no_grad = joint_mod.untrained(joint)
    read = set(weights_mod.program_weights(joint))  # a parameter nothing reads (BERT's pooler) is not in the joint
    del joint
    drawn = joint_mod.random_ops(ep)  # seeded alike on both sides below
    eager = on_device(ep, device).module().to(device)
    if precision in AUTOCAST:  # the dtype asserts export put before each .to()/.float() would refuse autocast's dtypes
        drop_metadata_asserts(eager)
    bound_model = copy.deepcopy(eager)  # the "caller's" module: the package reads and updates these tensors
    live = live_tensors(bound_model)

    side = weights_mod.sidecar(package_path)
    if not side.exists():
        raise CheckFailed("a train-step package must be weightless (bound to the caller's parameters); this one "
                          "has no weights blob beside it", stage="check")
    blob = weights_mod.load(side, device)
    weights_mod.verify_blob(ep, blob, "keep", only=read)
    package = LoadedPackage(package_path, device)
    fqns = package.get_constant_fqns()
    weights_mod.check_bound(fqns, blob)
    lacking = sorted(set(fqns) - set(live))
    if lacking:
        raise CheckFailed(f"the package reads {lacking[:5]}, which the module has as no parameter or buffer",
                          stage="check")
    package.bind_constants({k: live[k] for k in fqns})
    del blob

    params = dict(eager.named_parameters())
    bound_params = dict(bound_model.named_parameters())
    grad_roles = {r.role.removeprefix("grad:"): r.index for r in roles if r.role.startswith("grad:")}
    missing = sorted(set(params) - set(grad_roles) - set(no_grad))
    if missing:
        raise CheckFailed(f"the package returns no gradient for parameter(s) {missing[:5]}", stage="check")
    user_roles = [r for r in roles if r.role.startswith("output:")]
    ranges = inputs_mod.int_ranges(ep)
    shapes = next(iter(inputs_mod.points(spec).values()))
    log: list[dict[str, Any]] = []
    worst = {"max_abs_err": 0.0, "max_rel_err": 0.0}

    def fail(step: int, why: str, detail: Any = None) -> CheckFailed:
        return CheckFailed(f"training check, step {step + 1} of {steps}: {why}", stage="check",
                           excerpt=str(detail or log)[:4000])

    parts["load"] = time.perf_counter() - t0
    for step in range(steps):
        flat_in = inputs_mod.random_inputs(spec, shapes, device, ranges, seed + step)
        args, kwargs = inputs_mod.call_args(ep, flat_in)
        eager.zero_grad(set_to_none=True)
        # The same seed before each side: a step that drops draws the same masks in both (the package's random ops
        # are ATen's, on torch's generator: options.TRAINING_INDUCTOR_CONFIGS fallback_random).
        torch.manual_seed(seed * 1009 + step)
        eager_before = {fqn: t.detach().clone() for fqn in mutated
                        if (t := weights_mod.module_tensor(eager, fqn)) is not None}
        try:
            with autocast(device, precision):
                expected = eager(*args, **kwargs)
            flat_expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
            loss = flat_expected[loss_output]
            loss.backward()
            sync_device(device)  # a CUDA kernel's assert surfaces here, not in the package's run after it
        except Exception as err:
            dtype = str(AUTOCAST.get(precision, "")).removeprefix("torch.")
            under = f", under {dtype} autocast" if precision in AUTOCAST else ""
            raise fail(step, f"the uploaded program's own forward and backward (eager on {device}{under}) raised on "
                             f"the check's inputs, drawn as its samples are (integers within the samples' range): "
                             f"{first_line(err, 300)}; a train step cannot be checked against a program that fails at "
                             "its own inputs") from err
        torch.manual_seed(seed * 1009 + step)
        before = {fqn: live[fqn].detach().clone() for fqn in mutated if fqn in live}
        try:
            got = package.run_flat(package.flat_inputs(args, kwargs))
            sync_device(device)
        except Exception as err:
            raise fail(step, f"the package raised on inputs eager's step accepted: {first_line(err, 300)}") from err
        if len(got) != len(roles):
            raise fail(step, f"the package returned {len(got)} outputs; its manifest has {len(roles)} roles")
        written = [name for name, p in bound_params.items() if not same_bits(p, params[name])]
        if written:  # eager's forward and backward leave them; the two sides start each step alike (`sync`)
            raise fail(step, f"the package wrote to parameter(s) {written[:5]} of the caller's model: a train step "
                             "returns gradients and updates only the buffers its manifest names")
        others = [t for i, t in enumerate(flat_expected) if i != loss_output]
        checks = [_cmp("loss", loss, got[0], floor)]
        checks += [_cmp(r.role, e, got[r.index], floor) for r, e in zip(user_roles, others, strict=True)]
        given = sorted(name for name in no_grad if params[name].grad is not None)
        if given:
            raise fail(step, f"eager's backward gives parameter(s) {given[:5]} a gradient, which the package does "
                             "not return (its manifest says the loss does not depend on them)")
        wants = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in params.items()
                 if name in grad_roles}
        scales = grad_scales(wants)
        for name, want in wants.items():
            checks.append(_cmp(f"grad:{name}", want / scales[name], got[grad_roles[name]] / scales[name], floor))
        for fqn in mutated:
            e, b = weights_mod.module_tensor(eager, fqn), live.get(fqn)
            if e is None or b is None:
                raise fail(step, f"buffer {fqn!r} is mutated by the program but the module has no such buffer")
            if fqn in before and torch.equal(b, before[fqn]) and not torch.equal(e, eager_before[fqn]):
                raise fail(step, f"buffer {fqn!r} was not updated in place as eager updates it (the step left it as "
                                 "it was): the package froze it (a constant folded into its code)", checks)
            checks.append(_cmp(f"buffer:{fqn}", e, b, buffer_floor))
        if any(not c["ok"] for c in checks):
            checks = _second_opinion(checks, eager, args, kwargs, loss_output, flat_expected, got, roles, scales,
                                     floor, seed * 1009 + step, eager_before, live, buffer_floor)
        bad = next((c for c in checks if not c["ok"]), None)
        if bad is not None:
            hint = (" (step 1 agreed: a parameter the package does not read from the bound tensors, frozen at "
                    "compile time, would do this)" if step > 0 else "")
            what = str(bad["what"])
            why = (f"buffer {what.removeprefix('buffer:')!r} disagrees with eager's after the step ({bad.get('why')})"
                   if what.startswith("buffer:") else f"{what} disagrees with eager: {bad.get('why')}{hint}")
            raise fail(step, why, checks)
        with torch.no_grad():
            for p in params.values():
                if p.grad is not None:
                    p.sub_(lr * p.grad)
            sync(eager, bound_params, live, mutated)
        for c in checks:
            for k in worst:
                worst[k] = max(worst[k], float(c.get(k) or 0.0))
        errs = {c["what"]: c.get("max_rel_err") for c in checks}
        log.append({"step": step + 1, "loss": float(loss.detach()), "loss_rel_err": errs["loss"],
                    "max_grad_rel_err": max((v or 0.0 for k, v in errs.items() if k.startswith("grad:")),
                                            default=0.0),
                    "buffers": len(mutated),
                    # the values the float64 second opinion passed, and by which rule (compiler.fp64.judge)
                    "fp64_passed": {c["what"]: c["fp64"]["rule"] for c in checks if c["ok"] and "fp64" in c}})

    parts["steps"] = time.perf_counter() - t0 - parts["load"]
    # One step each, timed: eager's forward and backward (grads set to none first, as an optimizer loop would),
    # and one boxed run of the package. Both go on updating their own buffers; nothing is compared after this.
    flat_in = inputs_mod.random_inputs(spec, shapes, device, ranges, seed)
    args, kwargs = inputs_mod.call_args(ep, flat_in)
    flat_args = package.flat_inputs(args, kwargs)

    def eager_step() -> None:
        eager.zero_grad(set_to_none=True)
        with autocast(device, precision):
            out = eager(*args, **kwargs)
        (out[loss_output] if isinstance(out, (tuple, list)) else out).backward()

    eager_t = measure(eager_step, device)
    compiled_t = measure(functools.partial(package.run_flat, flat_args), device)
    e_ms, c_ms = eager_t["median_ms"], compiled_t["median_ms"]
    parts["timing"] = time.perf_counter() - t0 - parts["load"] - parts["steps"]
    point = {"point": "static", "shapes": {i["name"]: s for i, s in zip(spec, shapes)}, "ok": True, **worst,
             "eager_ms": round(e_ms, 4), "compiled_ms": round(c_ms, 4),
             "speedup": round(e_ms / c_ms, 3) if c_ms > 0 else None,
             "latency": {"eager": eager_t, "compiled": compiled_t}}
    summary: dict[str, Any] = {
        "passed": True, "device": device, "device_info": device_info(device), "precision": precision,
        "points": [point], **worst, "eager_ms": point["eager_ms"], "compiled_ms": point["compiled_ms"],
        "speedup": point["speedup"], "latency": {"method": compiled_t["method"], **point["latency"]},
        "graphs": {"impl": None, "captured": False, "reason": "train steps are not captured in CUDA graphs yet"},
        "notes": ["timings are one training step: eager forward+backward against one run of the package"],
        "allow_nonfinite": False, "nonfinite": [],
        "weights": {"bound": "user_managed", "constants": len(fqns), "package_fqns": sorted(fqns),
                    "bytes": side.stat().st_size},
        "training": {**training.manifest(roles, mutated, loss_output, no_grad), "steps": log,
                     "optimizer": f"SGD lr={lr}",
                     "random_ops": drawn,
                     "autocast": str(AUTOCAST[precision]).removeprefix("torch.") if precision in AUTOCAST else None,
                     "tolerance": {str(k).removeprefix("torch."): v for k, v in TOLERANCE.items()}},
    }
    if adversarial:  # integer inputs at their boundaries and beyond: the package must raise where eager raises
        base = inputs_mod.random_inputs(spec, shapes, "cpu", ranges, seed)
        del package, eager, bound_model, live
        found = check_adversarial(model_path, package_path, spec, device, ep, base, shapes, ranges, floor,
                                  AUTOCAST.get(precision))
        summary["adversarial"] = {"point": "static", **found}
        parts["adversarial"] = time.perf_counter() - t0 - sum(parts.values())
        refuse_failures(found, "train-step package")
    summary["seconds"] = {k: round(v, 2) for k, v in parts.items()}
    return summary


def _second_opinion(checks: list[dict[str, Any]], eager: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any], loss_output: int, expected: list[torch.Tensor], got: list[torch.Tensor],
                    roles: list[joint_mod.Role], scales: dict[str, float], floor: float, step_seed: int,
                    buffers_before: dict[str, torch.Tensor], live: dict[str, torch.Tensor],
                    buffer_floor: float) -> list[dict[str, Any]]:
    """The failed comparisons judged again against a float64 run of the same step: a value that is zero up to
    rounding (the gradient of a bias right before BatchNorm: a sum that cancels) differs between any two float32
    runs by the size of the terms cancelled, so the package passes where compiler.fp64.judge passes it (its distance
    from float64 at most FP64_MULTIPLIER times eager's, in the largest element or, torchbench's measure, in
    root-mean-square). A buffer the step updates (a running variance, computed from activations that went through
    every bf16 layer before it) is judged the same way, the float64 run starting from the buffers as they were
    before the step. Where the float64 run cannot be made (an op without a float64 kernel, a dtype the graph
    fixes), the first judgment stands and its message says why (EfficientViT-B1's refusal on the H200s gave no
    second opinion and no reason)."""
    try:
        ref = fp64.float64_copy(eager)
        ref.zero_grad(set_to_none=True)
        with torch.no_grad():  # the buffers as they were before the step (eager's forward has updated its own)
            for fqn, t in buffers_before.items():
                held = weights_mod.module_tensor(ref, fqn)
                if held is not None:
                    held.copy_(t)
        torch.manual_seed(step_seed)  # the step's own draws (dropout), as both sides had them
        out = ref(*[fp64.double(a) for a in args], **{k: fp64.double(v) for k, v in kwargs.items()})
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        flat[loss_output].backward()
    except Exception as err:  # noqa: BLE001 - no second opinion: the first stands, and says why
        first_line = (str(err).splitlines() or [""])[0][:300]
        missing = f"no float64 second opinion: {type(err).__name__}: {first_line}"
        return [c if c["ok"] else {**c, "why": f"{c['why']}; {missing}"} for c in checks]
    user = [r for r in roles if r.role.startswith("output:")]
    # role -> (eager's value, the package's, float64's, the scale errors are divided by)
    values: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
    values["loss"] = (expected[loss_output], got[0], flat[loss_output].detach(), 1.0)
    eager_others = [t for i, t in enumerate(expected) if i != loss_output]
    ref_others = [t for i, t in enumerate(flat) if i != loss_output]
    for r, e, f in zip(user, eager_others, ref_others, strict=True):
        values[r.role] = (e, got[r.index], f.detach(), 1.0)
    eager_params, ref_params = dict(eager.named_parameters()), dict(ref.named_parameters())
    for r in roles:
        if r.role.startswith("grad:"):
            fqn = r.role.removeprefix("grad:")
            e_grad, r_grad = eager_params[fqn].grad, ref_params[fqn].grad
            values[r.role] = (e_grad if e_grad is not None else torch.zeros_like(eager_params[fqn]), got[r.index],
                              r_grad if r_grad is not None else torch.zeros_like(ref_params[fqn]), scales[fqn])
    for fqn in buffers_before:
        e_buf, r_buf = weights_mod.module_tensor(eager, fqn), weights_mod.module_tensor(ref, fqn)
        if e_buf is not None and r_buf is not None and fqn in live and e_buf.is_floating_point():
            values[f"buffer:{fqn}"] = (e_buf, live[fqn], r_buf.detach(), 1.0)
    out_checks = []
    for c in checks:
        name = str(c["what"])
        if c["ok"] or "is off by" not in str(c.get("why")) or name not in values:
            out_checks.append(c)
            continue
        e, a, r64, scale = values[name]
        if not name.startswith("grad:"):
            scale = max(float(r64.abs().max()) if r64.numel() else 0.0, 1.0)
        tolerance = buffer_floor if name.startswith("buffer:") else floor
        j = fp64.judge(a, e, r64, scale, max(tolerance, TOLERANCE.get(a.dtype, 1e-4)))
        if j["ok"]:
            out_checks.append({**c, "ok": True, "why": None, "max_rel_err": j["package"], "fp64": j})
        else:
            out_checks.append({**c, "fp64": j, "why": f"{c['why']}; {fp64.describe(j)}"})
    return out_checks
