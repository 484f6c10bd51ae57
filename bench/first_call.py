"""Where a package's first call goes: each model compiled once (plain `aoti_compile_and_package`, the same
kernels and ATen fallbacks an aotc package has), then fresh processes that load it and time the first call, as it
is and with the libraries' one-off set-up split out, plus the same first call in eager, and a profile of it.

    # GPU (the lead), e.g.:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python bench/first_call.py --device cuda:0 \\
        --models mobilenet_v3_large,efficientnet_b0 --out bench/results/first-call-h100.json

Variants, each in a fresh process after `import torch`:
  aoti         load, first call, second call (all synchronised)
  aoti-nolayout  the same program built with Inductor's layout optimisation off (convolutions stay NCHW)
  aoti-nocudnn  what options.convolutions="generated" builds: the depthwise convolutions lowered by compiler.convs
               (on a GPU compiler.dwconv's Triton kernel, until 2026-12-01 pointwise kernels; no cuDNN plan to
               build for them at first call), 1x1 ones as matmuls (Inductor's conv_1x1_as_mm); only the variants
               asked for are built
  aoti-dw      the depthwise convolutions lowered as in aoti-nocudnn, the 1x1 ones left to cuDNN (no
               conv_1x1_as_mm): which of the two rewrites the steady time pays for
  aoti-cudnn-v7  the package with TORCH_CUDNN_V8_API_DISABLED=1 (cuDNN's older heuristics API, where torch has it)
  aoti-warm    the same after a 1x1 convolution and a matmul on the device (cuDNN's and cuBLAS's handles made),
               so that `first_call_s` is what is left: per-shape choices and kernel loading
  aoti-prewarm  before the load, each distinct convolution of the program run once on zeros, channels-last as
               Inductor's layout optimisation calls them, from as many threads as the process has cores
               (`prewarm_s`), so that cuDNN's per-shape plans are made in parallel; then the first call. Whether
               those plans are the ones the package's calls find is what its `first_call_s` tells
  aoti-prewarm1  the same from a pool of one thread: what the plans cost made one after another
  aoti-prewarm-here  the same on the thread that then calls the package. ATen caches cuDNN's execution plans per
               thread (`thread_local` in Conv_v8.cpp), so the two above make plans the calling thread never finds
               (2026-11-29 on an H200: only the process-wide part, ConvNeXt-T's kernel loading, left the first call);
               this one tells whether the plans made here are the ones the package's calls look up
  eager        the model built on the device, then its first and second call
  profile      torch.profiler over the package's first call: the ATen ops by self CPU time
Prints a table of medians and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("aoti", "aoti-warm", "aoti-prewarm", "aoti-prewarm1", "aoti-prewarm-here", "aoti-nolayout", "aoti-nocudnn",
            "aoti-dw", "aoti-cudnn-v7", "eager", "profile")


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _warm_libraries(device: str) -> dict[str, float]:
    import torch

    out = {}
    t = time.perf_counter()
    x = torch.randn(1, 8, 8, 8, device=device, dtype=torch.bfloat16)
    w = torch.randn(8, 8, 1, 1, device=device, dtype=torch.bfloat16)
    torch.nn.functional.conv2d(x, w)
    _sync(device)
    out["cudnn_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    out["cublas_init_s"] = time.perf_counter() - t
    return out


def conv_calls(ep: Any) -> list[dict[str, Any]]:
    """The program's distinct 2-D convolutions (aten.conv2d and aten.convolution with static shapes): input and
    weight shape, bias, stride, padding, dilation, groups and dtype, what cuDNN keys its plans by (with the layout)."""
    import torch

    ops = {torch.ops.aten.conv2d.default: ("stride", "padding", "dilation", "groups"),
           torch.ops.aten.convolution.default: ("bias", "stride", "padding", "dilation", "transposed",
                                                "output_padding", "groups")}
    seen: dict[str, dict[str, Any]] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        x, w = (a.meta.get("val") for a in node.args[:2])
        if x is None or w is None or x.dim() != 4 or not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
            continue
        rest = list(node.args[2:])
        if node.target is torch.ops.aten.conv2d.default:
            bias = rest.pop(0) if rest else node.kwargs.get("bias")
            defaults = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1}
            params = {**defaults, **node.kwargs, **dict(zip(ops[node.target], rest, strict=False))}
        else:
            params = dict(zip(ops[node.target], rest, strict=False))
            bias = params.pop("bias")
            if params.pop("transposed") or any(params.pop("output_padding")):
                continue
        call = {"input": list(x.shape), "weight": list(w.shape), "bias": bias is not None,
                "dtype": str(x.dtype).removeprefix("torch."), **{k: params[k] for k in ("stride", "padding",
                                                                                          "dilation", "groups")}}
        seen.setdefault(json.dumps(call, sort_keys=True), call)
    return list(seen.values())


def prewarm(convs: list[dict[str, Any]], device: str, threads: int) -> dict[str, float]:
    """Run each convolution once on zeros, channels-last, from a pool of `threads` threads (0: on this thread, the
    one that calls the package next); synchronised."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def one(c: dict[str, Any]) -> None:
        dtype = getattr(torch, c["dtype"])
        x = torch.zeros(c["input"], device=device, dtype=dtype).to(memory_format=torch.channels_last)
        w = torch.zeros(c["weight"], device=device, dtype=dtype).to(memory_format=torch.channels_last)
        b = torch.zeros(c["weight"][0], device=device, dtype=dtype) if c["bias"] else None
        with torch.no_grad():
            torch.nn.functional.conv2d(x, w, b, c["stride"], c["padding"], c["dilation"], c["groups"])
        _sync(device)

    t = time.perf_counter()
    if threads == 0:
        for c in convs:
            one(c)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(one, convs))
    _sync(device)
    return {"prewarm_s": time.perf_counter() - t, "prewarm_convs": float(len(convs)), "prewarm_threads": float(threads)}


def child(variant: str, model: str, package: str, device: str, batch: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    from bench import zoo

    res: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    if device.startswith("cuda"):
        t = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device=device)
        res["context_s"] = time.perf_counter() - t
    if variant == "aoti-warm":
        res.update(_warm_libraries(device))
    if variant in ("aoti-prewarm", "aoti-prewarm1", "aoti-prewarm-here"):
        convs = json.loads(Path(package + ".convs.json").read_text())
        threads = {"aoti-prewarm1": 1, "aoti-prewarm-here": 0}.get(
            variant, max(1, min(16, len(os.sched_getaffinity(0)), len(convs))))
        res.update(prewarm(convs, device, threads))
    inputs = zoo.inputs(model, batch, device)
    if variant == "eager":
        m, _ = zoo.build(model, device=device, batch=batch)
        fn = m
        res["load_s"] = 0.0
    else:
        from compiler.compat.aoti import aoti_load_package

        if variant == "aoti-nolayout":
            package = package.replace(".pt2", "-nolayout.pt2")
        elif variant in ("aoti-nocudnn", "aoti-dw"):
            package = package.replace(".pt2", f"-{variant.removeprefix('aoti-')}.pt2")
        t = time.perf_counter()
        fn = aoti_load_package(package, device)
        _sync(device)
        res["load_s"] = time.perf_counter() - t
    with torch.no_grad():
        if variant == "profile":
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
            with profile(activities=acts, record_shapes=False) as prof:
                t = time.perf_counter()
                fn(*inputs)
                _sync(device)
                res["first_call_s"] = time.perf_counter() - t
            ops = []
            for e in prof.key_averages():
                ops.append({"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                            "cpu_total_ms": round(e.cpu_time_total / 1e3, 2)})
            ops.sort(key=lambda o: -o["self_cpu_ms"])
            res["top_ops"] = ops[:25]
        else:
            t = time.perf_counter()
            fn(*inputs)
            _sync(device)
            res["first_call_s"] = time.perf_counter() - t
        t = time.perf_counter()
        fn(*inputs)
        _sync(device)
        res["second_call_s"] = time.perf_counter() - t
        if device.startswith("cuda"):
            from triton.testing import do_bench

            res["steady_ms"] = float(do_bench(lambda: fn(*inputs), warmup=50, rep=300, return_mode="median"))
        else:
            ts = []
            for _ in range(30):
                t = time.perf_counter()
                fn(*inputs)
                ts.append(time.perf_counter() - t)
            res["steady_ms"] = statistics.median(ts) * 1e3
    return res


def compile_one(model: str, device: str, batch: int | None, out_dir: Path, variants: str) -> dict[str, Any]:
    import torch

    from bench import zoo

    m, inputs = zoo.build(model, device=device, batch=batch)
    t = time.perf_counter()
    ep = torch.export.export(m, inputs)
    path = str(out_dir / f"{model}.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
    out = {"package": path, "compile_s": round(time.perf_counter() - t, 1),
           "size_mb": round(os.path.getsize(path) / 1e6, 1)}
    convs = conv_calls(ep)  # for the prewarm variants
    Path(path + ".convs.json").write_text(json.dumps(convs))
    out["distinct_convs"] = len(convs)
    if "aoti-nolayout" in variants:
        # the same program with Inductor's layout optimisation off: convolutions stay NCHW, as eager runs them
        t = time.perf_counter()
        torch._inductor.aoti_compile_and_package(ep, package_path=path.replace(".pt2", "-nolayout.pt2"),
                                                 inductor_configs={"layout_optimization": False})
        out["compile_nolayout_s"] = round(time.perf_counter() - t, 1)
    if "aoti-nocudnn" not in variants and "aoti-dw" not in variants:
        return out
    # depthwise convolutions as pointwise kernels and 1x1 ones as matmuls: no cuDNN plans for them at first call
    from compiler.convs import lower_depthwise

    lowering = lower_depthwise(ep)
    lowered, out["depthwise_lowered"] = lowering.program, lowering.lowered
    for variant, configs in (("nocudnn", {"conv_1x1_as_mm": True}), ("dw", {})):
        if f"aoti-{variant}" in variants:
            t = time.perf_counter()
            torch._inductor.aoti_compile_and_package(lowered, package_path=path.replace(".pt2", f"-{variant}.pt2"),
                                                     inductor_configs=configs)
            out[f"compile_{variant}_s"] = round(time.perf_counter() - t, 1)
    return out


def run_child(variant: str, model: str, package: str, device: str, batch: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, "--models", model, "--package", package,
           "--device", device] + (["--batch", str(batch)] if batch else [])
    t = time.perf_counter()
    env = dict(os.environ)
    if variant == "aoti-cudnn-v7":
        env["TORCH_CUDNN_V8_API_DISABLED"] = "1"
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 180 s", "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-1500:], "wall_s": wall}
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["wall_s"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mobilenet_v3_large")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=None, help="default: each model's serving batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/first-call.json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", choices=VARIANTS)
    ap.add_argument("--package")
    ap.add_argument("--work", default=None, help="where packages go (default: a temporary dir)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.models, a.package or "", a.device, a.batch)))
        return
    work = Path(a.work or tempfile.mkdtemp(prefix="first-call-"))
    work.mkdir(parents=True, exist_ok=True)
    import torch

    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.processor()
    doc: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device, "torch": torch.__version__,
                           "gpu": gpu, "rounds": a.rounds, "models": {}}
    for model in a.models.split(","):
        built = compile_one(model, a.device, a.batch, work, a.variants)
        print(f"# {model}: compiled in {built['compile_s']} s, {built['size_mb']} MB", flush=True)
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for _ in range(a.rounds):
            for v in a.variants.split(","):
                if v == "profile" and rows[v]:
                    continue
                r = run_child(v, model, built["package"], a.device, a.batch)
                rows[v].append(r)
                print(f"  {model} {v}: " + (f"error {str(r['error'])[-300:]}" if "error" in r else " ".join(
                    f"{k}={r[k]:.3f}" for k in r if isinstance(r[k], float))), flush=True)
        summary: dict[str, Any] = {}
        for v, rs in rows.items():
            if not rs:
                continue
            ok = [r for r in rs if "error" not in r]
            if not ok:
                summary[v] = {"error": rs[0].get("error")}
                continue
            keys = [k for k in ok[0] if isinstance(ok[0][k], float)]
            summary[v] = {k: round(statistics.median(r[k] for r in ok), 4) for k in keys}
            if v == "profile":
                summary[v]["top_ops"] = ok[0]["top_ops"]
        doc["models"][model] = {**built, "variants": summary, "runs": rows}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    cols = ("import_s", "context_s", "cudnn_init_s", "cublas_init_s", "prewarm_s", "load_s", "first_call_s",
            "second_call_s", "steady_ms")
    print(f"{'model':22} {'variant':10} " + " ".join(f"{c.rsplit('_', 1)[0]:>13}" for c in cols))
    for model, d in doc["models"].items():
        for v, s in d["variants"].items():
            if "error" in s:
                print(f"{model:22} {v:10} error: {str(s['error'])[-200:]}")
                continue
            print(f"{model:22} {v:10} " + " ".join(f"{s.get(c, float('nan')):13.3f}" for c in cols))
        top = d["variants"].get("profile", {}).get("top_ops", [])[:12]
        for o in top:
            print(f"    {o['op'][:60]:60} calls {o['calls']:5d} self {o['self_cpu_ms']:9.1f} ms")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
