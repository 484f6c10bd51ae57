"""Where a train step's numbers part from eager's (issue 23): one step of a zoo model, one batch, the same weights,
computed five ways, each against a float64 run of the same step.

  eager     the module under autocast, `loss.backward()` (what the training check compares with)
  joint     the joint forward/backward program a train-step package is built from (compiler.stages.capture with
            autocast, compiler.compat.joint.joint_program), run op by op with ATen's kernels: no Inductor. A value
            off here is the export path's (its decompositions), not the generated code's
  compile   torch.compile of the module (Inductor, default mode) under autocast
  package   with --aoti: the joint program through AOTInductor with the training options, as a worker builds it,
            bound to a copy of the weights and run once

Per value (the loss, each output, each parameter's gradient): its largest-element distance from float64 over the
value's scale (max |float64|, at least 1; a gradient's own largest magnitude, as compiler.traincheck.grad_scales), and
its root-mean-square distance; then each way's worst values by their distance over eager's. Prints a table and
writes JSON.

    python bench/train_numerics.py --model timm_caformer_s18 --device cuda --batch 32 --aoti \\
        --out bench/results/train-numerics-caformer-h200.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def distances(value: torch.Tensor, ref: torch.Tensor, scale: float) -> dict[str, float]:
    d = value.detach().double().cpu() - ref.detach().double().cpu()
    return {"largest": float(d.abs().max()) / scale if d.numel() else 0.0,
            "rms": float(d.pow(2).mean().sqrt()) / scale if d.numel() else 0.0}


def run_module(model: torch.nn.Module, args: tuple[Any, ...], amp: torch.dtype | None,
               device: str) -> dict[str, torch.Tensor]:
    """loss, output:i and grad:<fqn> of one step of `model` (its grads set to none first)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.split(":")[0], dtype=amp or torch.float32, enabled=amp is not None):
        out = model(*args)
    flat = list(out) if isinstance(out, (tuple, list)) else [out]
    flat[0].backward()
    got = {"loss": flat[0].detach()}
    got.update({f"output:{i}": t.detach() for i, t in enumerate(flat[1:])})
    got.update({f"grad:{n.removeprefix('_orig_mod.')}": p.grad.detach() for n, p in model.named_parameters()
                if p.grad is not None})  # torch.compile's wrapper names them _orig_mod.<fqn>
    return got


def by_role(flat: list[torch.Tensor], roles: list[Any]) -> dict[str, torch.Tensor]:
    return {r.role: flat[r.index].detach() for r in roles if r.index < len(flat)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a bench/zoo.py name or a tiny model of bench/trainmodels.py")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--amp", choices=("none", "bf16"), default="bf16")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    ap.add_argument("--aoti", action="store_true", help="also build the package (minutes) and run it")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.device == "cpu":
        from bench.upload_sweep import stub_torchvision_ops

        stub_torchvision_ops()
    from bench import trainmodels
    from compiler import stages
    from compiler.compat.joint import joint_program, roles, run_op_by_op
    from compiler.specialize import drop_metadata_asserts
    from compiler.traincheck import AUTOCAST, grad_scales, live_tensors

    amp = AUTOCAST.get(a.amp)
    model, args, ep, spec = trainmodels.exported(a.model, a.batch, a.device)
    t0 = time.perf_counter()
    ways: dict[str, dict[str, torch.Tensor]] = {}
    ref = run_module(drop_metadata_asserts(copy.deepcopy(model).double()),
                     tuple(t.double() if t.is_floating_point() else t for t in args), None, a.device)
    ways["eager"] = run_module(copy.deepcopy(model), args, amp, a.device)
    captured = stages.capture(ep, spec, spec, a.device, "keep" if amp is None else a.amp, amp is not None, True)
    joint = joint_program(captured.program, 0)
    got_roles, _ = roles(joint)
    ways["joint"] = by_role(run_op_by_op(copy.deepcopy(joint), args), got_roles)
    if a.compile:
        ways["compile"] = run_module(torch.compile(copy.deepcopy(model)), args, amp, a.device)
    if a.aoti:
        from compiler.compat.aoti import LoadedPackage, aoti_compile_and_package, weightless_configs
        from compiler.options import TRAINING_INDUCTOR_CONFIGS, CompileOptions

        with tempfile.TemporaryDirectory(prefix="aotc-numerics-") as tmp:
            package = str(Path(tmp) / "artifact.pt2")
            configs = {**CompileOptions(mode="training").inductor_configs(), **(weightless_configs() or {}),
                       **TRAINING_INDUCTOR_CONFIGS}
            t1 = time.perf_counter()
            aoti_compile_and_package(joint, package, configs)
            print(f"package built in {time.perf_counter() - t1:.1f} s", flush=True)
            bound = copy.deepcopy(model)  # the blob is the module's own tensors: bound directly, as a trainer does
            live = live_tensors(bound)
            loaded = LoadedPackage(package, a.device)
            loaded.bind_constants({k: live[k] for k in loaded.get_constant_fqns()})
            ways["package"] = by_role(loaded.run_flat(loaded.flat_inputs(args, {})), got_roles)
    scales = grad_scales({k.removeprefix("grad:"): v for k, v in ref.items() if k.startswith("grad:")})
    rows: dict[str, dict[str, Any]] = {}
    for key, r64 in ref.items():
        scale = scales[key.removeprefix("grad:")] if key.startswith("grad:") else max(float(r64.abs().max()), 1.0)
        rows[key] = {way: distances(vals[key], r64, scale) for way, vals in ways.items() if key in vals}
    worst: dict[str, list[dict[str, Any]]] = {}
    for way in ways:
        if way == "eager":
            continue
        ratios = []
        for key, d in rows.items():
            if way in d and "eager" in d:
                e, w = d["eager"]["rms"], d[way]["rms"]
                ratios.append({"value": key, "ratio_rms": round(w / max(e, 1e-12), 2), "rms": w, "eager_rms": e,
                               "largest": d[way]["largest"], "eager_largest": d["eager"]["largest"]})
        worst[way] = sorted(ratios, key=lambda x: -x["ratio_rms"])[:a.top]
    print(f"{'value':<44}" + "".join(f"{w + ' rms':>14}{w + ' max':>14}" for w in ways))
    for key in ["loss", *[k for k in rows if k.startswith("output:")]]:
        print(f"{key:<44}" + "".join(f"{rows[key][w]['rms']:>14.3g}{rows[key][w]['largest']:>14.3g}"
                                     if w in rows[key] else f"{'-':>28}" for w in ways))
    for way, items in worst.items():
        print(f"\n{way}: the values farthest from float64 against eager's distance (root-mean-square)")
        for x in items:
            print(f"  {x['value']:<60} {x['ratio_rms']:>8}x  rms {x['rms']:.3g} (eager {x['eager_rms']:.3g})  "
                  f"max {x['largest']:.3g} (eager {x['eager_largest']:.3g})")
    result = {"model": a.model, "device": a.device, "batch": int(args[0].shape[0]), "amp": a.amp,
              "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 1), "ways": list(ways),
              "values": rows, "worst": worst}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
