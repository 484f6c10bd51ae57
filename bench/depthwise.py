"""Depthwise convolutions, one by one: cuDNN's first call (its execution plan) and steady time against
compiler.dwconv's Triton kernel and ATen's own depthwise kernel, on the distinct depthwise convolutions of zoo
models at their serving batch (a GPU).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6 python bench/depthwise.py \\
        --models efficientnet_b0,mobilenet_v3_large,convnext_tiny --out bench/results/depthwise.json

Per convolution (channels-last, as Inductor's layout optimisation calls them, and with --nchw NCHW too):
  cudnn_first_ms  the first call on a fresh thread: ATen keeps cuDNN's plans per thread, so this is the plan
                  a new process builds for it (the cuDNN handle made once before, off the clock)
  cudnn_ms        the median of cuDNN's later calls, replayed from a CUDA graph (do_bench_cudagraph: device
                  time, no launch overhead; a Python launch of a Triton kernel costs more than a small one runs)
  triton_ms       compiler.dwconv's kernel at the blocks it picks (its Triton compile off the clock)
  tried           with --sweep, the kernel at other tilings, "rows,block,block_c,num_warps,taps_major" (a
                  compiler.convs.Config; rows 0 is the flat kernel, taps_major 1 copies the weight to [KH, KW, C]
                  first, inside the timed call), ms each; NAME_err is that tiling's error as below
  native_ms       aten._conv_depthwise2d, ATen's own CUDA kernel (NCHW; a channels-last input is copied first)
  err             the largest |triton - cudnn| over the largest |cudnn| (float32 accumulation both)
Also: cuDNN's version, and whether libnvrtc was loaded by the first calls (cuDNN compiling at run time).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _nvrtc_loaded() -> bool:
    return any("nvrtc" in line for line in Path("/proc/self/maps").read_text().splitlines())


def depthwise_calls(model: str, batch: int | None, device: str) -> list[dict[str, Any]]:
    import torch

    from bench import zoo
    from bench.first_call import conv_calls

    m, inputs = zoo.build(model, device=device, batch=batch)
    ep = torch.export.export(m, inputs)
    return [c for c in conv_calls(ep) if c["groups"] == c["input"][1] == c["weight"][0] and c["weight"][1] == 1]


# (rows, block, block_c or 0 for the pick's, num_warps, taps_major): rows 0 is the flat kernel (BLOCK_P pixels)
SWEEP = ((0, 0, 0, 4, False), (2, 16, 0, 4, False), (2, 8, 0, 4, False), (4, 8, 0, 4, False),
         (4, 16, 0, 4, False), (2, 8, 0, 4, True), (2, 16, 0, 4, True), (4, 8, 0, 4, True), (4, 16, 0, 4, True),
         (2, 32, 0, 4, True))


def sweep_configs(c: dict[str, Any]) -> list[tuple[str, Any]]:
    """SWEEP as (label, compiler.convs.Config) for one convolution: the config has the pick's channel block where
    SWEEP says 0, and the label keeps the 0, so that the summary can add one entry's times over a model."""
    from compiler.convs import Config, flat_config

    ch = c["input"][1]
    base = flat_config(True, ch)
    out = []
    for rows, block, bc, warps, tm in SWEEP:
        bc = bc or base.block_c
        block = block or base.block_p * base.block_c // bc  # the flat kernel: flat_config's elements a program
        if bc <= max(16, 1 << (ch - 1).bit_length()) and Config(rows, block, bc, warps, tm) not in (
                cfg for _, cfg in out):
            label = ",".join(str(int(v)) for v in (rows, block if rows else 0, bc if bc != base.block_c else 0,
                                                    warps, tm))
            out.append((label, Config(rows, block, bc, warps, tm)))
    return out


def prewarm(x: Any, w: Any, b: Any, args: tuple[Any, Any, Any], configs: list[Any]) -> None:
    """Compile the configs' kernels on a few threads (ptxas runs in a process of its own), so that the sweep's
    wall time is mostly measuring. A failure here is left for the measured launch to raise."""
    from concurrent.futures import ThreadPoolExecutor

    from compiler.dwconv import launch

    def one(cfg: Any) -> None:
        try:
            launch(x, w, b, *args, config=cfg)
        except Exception:  # noqa: BLE001  # raised again, and recorded, where it is measured
            pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, configs))


def measure(c: dict[str, Any], device: str, channels_last: bool, sweep: bool) -> dict[str, Any]:
    import torch
    from triton.testing import do_bench_cudagraph

    from compiler.dwconv import depthwise_conv2d, launch

    def do_bench(fn: Any, **_: Any) -> float:
        fn()
        return float(do_bench_cudagraph(fn, rep=40, return_mode="median"))

    dtype = getattr(torch, c["dtype"])
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(c["input"], device=device, dtype=dtype, generator=g)
    w = torch.randn(c["weight"], device=device, dtype=dtype, generator=g) * 0.1
    b = torch.randn(c["weight"][0], device=device, dtype=dtype, generator=g) if c["bias"] else None
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    args = (c["stride"], c["padding"], c["dilation"])

    def cudnn() -> Any:
        return torch.nn.functional.conv2d(x, w, b, *args, c["groups"])

    first: dict[str, float] = {}

    def on_fresh_thread() -> None:
        t = time.perf_counter()
        cudnn()
        torch.cuda.synchronize(device)
        first["s"] = time.perf_counter() - t

    th = threading.Thread(target=on_fresh_thread)
    th.start()
    th.join()
    want = cudnn()
    got = depthwise_conv2d(x, w.contiguous(), b, *args)
    torch.cuda.synchronize(device)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))
    wn = w.contiguous()

    def native() -> Any:
        return torch.ops.aten._conv_depthwise2d(x, wn, list(c["weight"][2:]), b, c["stride"], c["padding"],
                                               c["dilation"])

    tried: dict[str, float] = {}
    if sweep and channels_last:
        configs = sweep_configs(c)
        prewarm(x, wn, b, args, [cfg for _, cfg in configs])
        for name, cfg in configs:
            try:
                got = launch(x, wn, b, *args, config=cfg)
                torch.cuda.synchronize(device)
                tried[name + "_err"] = float((got.float() - want.float()).abs().max()
                                             / want.float().abs().max().clamp_min(1e-6))
                tried[name] = do_bench(lambda cfg=cfg: launch(x, wn, b, *args, config=cfg))
            except Exception as e:  # noqa: BLE001  # a config that fails to compile (registers) is a finding
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return {"tried": tried, "cudnn_first_ms": first["s"] * 1e3,
            "cudnn_ms": do_bench(cudnn, warmup=25, rep=100, return_mode="median"),
            "triton_ms": do_bench(lambda: depthwise_conv2d(x, wn, b, *args), warmup=25, rep=100,
                                  return_mode="median"),
            "native_ms": do_bench(native, warmup=25, rep=100, return_mode="median"), "err": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="efficientnet_b0,mobilenet_v3_large,convnext_tiny")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=None, help="default: each model's serving batch")
    ap.add_argument("--out", default="bench/results/depthwise.json")
    ap.add_argument("--nchw", action="store_true", help="NCHW inputs too")
    ap.add_argument("--sweep", action="store_true", help="the kernel at other blocks too (channels-last)")
    a = ap.parse_args()
    import torch

    torch.backends.cudnn.benchmark = False
    doc: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
                           "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(0),
                           "models": {}}
    x = torch.randn(1, 8, 8, 8, device=a.device, dtype=torch.bfloat16)  # cuDNN's handle, off the clock
    torch.nn.functional.conv2d(x, torch.randn(8, 8, 1, 1, device=a.device, dtype=torch.bfloat16))
    doc["nvrtc_before"] = _nvrtc_loaded()
    for model in a.models.split(","):
        rows = []
        for c in depthwise_calls(model, a.batch, a.device):
            for layout in ("channels_last", "nchw") if a.nchw else ("channels_last",):
                r = {**c, "layout": layout, **measure(c, a.device, layout == "channels_last", a.sweep)}
                rows.append(r)
                print(f"{model:20} {str(c['input']):22} k{c['weight'][2]}x{c['weight'][3]} s{c['stride'][0]} "
                      f"{layout:13} first {r['cudnn_first_ms']:7.1f} ms  cudnn {r['cudnn_ms']*1e3:8.1f} us  "
                      f"triton {r['triton_ms']*1e3:8.1f} us  native {r['native_ms']*1e3:8.1f} us  "
                      f"err {r['err']:.1e}" + "".join(f"  {k}: {v*1e3:.1f}" for k, v in r["tried"].items()
                                                      if not k.endswith("_err")),
                      flush=True)
        summary = {}
        for layout in ("channels_last", "nchw"):
            rs = [r for r in rows if r["layout"] == layout]
            if rs:
                summary[layout] = {
                    "convs": len(rs), "cudnn_first_ms_sum": round(sum(r["cudnn_first_ms"] for r in rs), 1),
                    "cudnn_first_ms_median": round(statistics.median(r["cudnn_first_ms"] for r in rs), 2),
                    "cudnn_us_sum": round(sum(r["cudnn_ms"] for r in rs) * 1e3, 1),
                    "triton_us_sum": round(sum(r["triton_ms"] for r in rs) * 1e3, 1),
                    "native_us_sum": round(sum(r["native_ms"] for r in rs) * 1e3, 1),
                    "best_tried_us_sum": round(sum(min([r["triton_ms"], *(v for k, v in r["tried"].items()
                                                                               if not k.endswith("_err"))])
                                                   for r in rs) * 1e3, 1),
                    "max_err": max(r["err"] for r in rs)}
                labels = {k for r in rs for k in r["tried"] if not k.endswith("_err")}
                summary[layout]["tried_us_sum"] = {  # an entry some convolution lacks is left out
                    k: round(sum(r["tried"][k] for r in rs) * 1e3, 1) for k in sorted(labels)
                    if all(k in r["tried"] for r in rs)}
        doc["models"][model] = {"convs": rows, "summary": summary}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
    doc["nvrtc_after"] = _nvrtc_loaded()
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"\ncuDNN {doc['cudnn']}; libnvrtc loaded before the first depthwise call: {doc['nvrtc_before']}, after: "
          f"{doc['nvrtc_after']}")
    print(f"{'model':20} {'layout':13} {'convs':>5} {'cudnn first (sum ms)':>21} {'cudnn us':>9} {'triton us':>9} "
          f"{'native us':>9} {'best us':>9} {'max err':>8}")
    for model, d in doc["models"].items():
        for layout, s in d["summary"].items():
            print(f"{model:20} {layout:13} {s['convs']:5d} {s['cudnn_first_ms_sum']:21.1f} {s['cudnn_us_sum']:9.1f} "
                  f"{s['triton_us_sum']:9.1f} {s['native_us_sum']:9.1f} {s['best_tried_us_sum']:9.1f} "
                  f"{s['max_err']:8.1e}")
            for k, v in sorted(s.get("tried_us_sum", {}).items(), key=lambda kv: kv[1]):
                print(f"{'':20} {'':13} tiling {k:16} {v:9.1f} us ({v / s['cudnn_us_sum']:.2f}x cuDNN)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
