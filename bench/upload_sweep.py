"""Do the upload checks take every real model? Export each model of zoo.py on the CPU (or `--device`; bf16, random
weights, batch 1) and run only what the API runs on an upload (compiler.archive.inspect_archive): no service, no
compile.

The first wider GPU run found three real models refused at upload as hostile (HF Llama and Qwen2: the positional
arguments of the grad-mode regions export keeps are named ''; torchvision's RegNet: 'block4-1'). This finds that
kind of false refusal on any machine with torchvision, timm and transformers, in minutes.

With --load it also runs what the worker runs before a compile (compiler.loading.load_program: the same checks
again, torch.export.load under the guard, and the walk of the loaded graph that holds every callable to the operator
list), still no compile.

    python bench/upload_sweep.py [--models resnet50,hf_gpt2] [--load] [--device cuda] \
        --out bench/results/upload-sweep.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


_STUBS: list[Any] = []


def stub_torchvision_ops() -> None:
    """PyPI's torchvision is a CUDA build: on a CPU-only torch its C extension does not load, and importing it fails
    on registering a fake for an op it never defined (torchvision::nms). There, define the two it registers as stubs
    and import again; none of the zoo's models calls them (one that did would fail to export, never reach the door).
    Where the extension loads (a GPU machine), nothing is stubbed."""
    try:
        importlib.import_module("torchvision")
        return
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    import torch

    for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[mod]  # the failed import's half-made modules
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _STUBS.append(lib)  # the ops live as long as their Library object
    importlib.import_module("torchvision")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="", help="comma-separated (default: all of zoo.py)")
    ap.add_argument("--load", action="store_true", help="also load each program as the worker does (load_program)")
    ap.add_argument("--device", default="cpu", help="export on this device (cuda: what a GPU user uploads, whose "
                    "attention, for one, can trace to other kernels)")
    ap.add_argument("--out", default="bench/results/upload-sweep.json")
    a = ap.parse_args()

    import torch

    stub_torchvision_ops()
    from bench.zoo import MODELS, build
    from compiler.archive.inspect import inspect_archive
    from compiler.errors import AotcError, CompileError
    from compiler.inputs import index_inputs
    from compiler.loading import load_program

    names = a.models.split(",") if a.models else list(MODELS)
    rows: list[dict[str, Any]] = []
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> None:
        out.write_text(json.dumps({"torch": torch.__version__, "device": a.device, "load": a.load,
                                   "summary": summary, "rows": rows}, indent=1))

    with tempfile.TemporaryDirectory() as d:
        for name in names:
            row: dict[str, Any] = {"model": name, "family": MODELS[name].family}
            try:
                t0 = time.perf_counter()
                model, inputs = build(name, device=a.device, batch=1)
                row["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
                ep = torch.export.export(model, inputs)
                path = Path(d) / f"{name}.pt2"
                torch.export.save(ep, str(path))
                row.update(export_s=round(time.perf_counter() - t0, 2), archive_mb=round(path.stat().st_size / 1e6, 1))
                hops = sorted({f"{n.target.__module__}.{n.target.__name__}" for gm in ep.graph_module.modules()
                               if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
                               if n.op == "call_function" and "higher_order" in getattr(n.target, "__module__", "")})
                row["higher_order_ops"] = hops
                t1 = time.perf_counter()
                inspected = inspect_archive(str(path))
                row.update(accepted=True, inspect_s=round(time.perf_counter() - t1, 3),
                           inputs=[i["name"] for i in inspected["inputs"]])
                # What the check's adversarial half varies besides integer inputs (compiler.inputs): float inputs cast
                # to an integer, bool masks the program indexes by; the upload's own inputs as the spec.
                t_walk = time.perf_counter()
                floats, masks = index_inputs(ep, inspected["inputs"])
                row.update(check_floats=[inspected["inputs"][k]["name"] for k in floats],
                           check_masks=[inspected["inputs"][k]["name"] for k in masks],
                           walk_s=round(time.perf_counter() - t_walk, 4))
                if a.load:
                    t2 = time.perf_counter()
                    load_program(str(path))
                    row["load_s"] = round(time.perf_counter() - t2, 2)
                path.unlink()
            except AotcError as e:  # the upload's answer: a refusal
                row.update(accepted=False, status=e.status, refusal=e.message[:500])
            except CompileError as e:  # the worker's loader refused it
                row.update(accepted=False, status="load", refusal=f"{type(e).__name__}: {e.message}"[:500])
            except Exception as e:  # noqa: BLE001 - a model this machine cannot build or export is a result too
                row.update(accepted=None, error=f"{type(e).__name__}: {e}"[:500])
            rows.append(row)
            save(rows)  # each row as it lands: a sweep cut short still leaves what it measured
            verdict = {True: "accepted", False: f"REFUSED {row.get('status')}", None: "not exported"}[row["accepted"]]
            print(f"{name:42s} {verdict:14s} export {row.get('export_s', '-')} s, inspect {row.get('inspect_s', '-')} s"
                  + (f", load {row.get('load_s', '-')} s" if a.load else "")
                  + (f"  {row.get('refusal') or row.get('error')}"[:300] if not row["accepted"] else ""), flush=True)
    summary = {"models": len(rows), "accepted": sum(r["accepted"] is True for r in rows),
               "refused": [r["model"] for r in rows if r["accepted"] is False],
               "not_exported": [r["model"] for r in rows if r["accepted"] is None],
               "check_floats_or_masks": [r["model"] for r in rows if r.get("check_floats") or r.get("check_masks")]}
    print(json.dumps(summary))
    save(rows, summary)
    return 1 if summary["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
