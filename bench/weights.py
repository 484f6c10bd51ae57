"""Weights stored once: bytes stored and downloaded, load time, resident memory and latency, before and after.

    python bench/weights.py --out bench/results/weights-cpu.json
    python bench/weights.py --device cuda --out bench/results/weights-gpu.json     # on the GPU machine
    python bench/weights.py --device cuda --hidden 7168 --out bench/results/weights-gpu-441mb.json
    python bench/weights.py --ttfi --out bench/results/weights-ttfi-cpu.json          # TTFI after import, 441 MB
    python bench/weights.py --ttfi --device cuda:0 --out bench/results/weights-ttfi-h100.json   # on the GPU machine

One model (a 4-layer MLP, 42 MB of float32 weights) at three static shape buckets (batch 1, 4, 16) and two
precisions (keep, bf16), each bucket compiled twice from the same specialised program through AOTInductor:
`before` with what main builds (the weights inside every package), `after` weightless (compiler.compat.aoti
.weightless_configs) with the model's weights blob beside it (compiler.weights). Reported:

- bytes the store holds for the six artifacts (each package, and each distinct weights blob once), and bytes a
  server downloads to load the three buckets of one precision;
- in a fresh process per variant: seconds from interpreter start to the first inference of each of the three
  buckets (torch's import included), and the memory held after all three are loaded (the process's RSS on a CPU,
  torch.cuda.memory_allocated on a GPU);
- the median call of the batch-16 bucket, weightless and self-contained, alternating in one process (each round a
  do_bench-style median, compiler.check.measure; `--latency-rounds` rounds, the order swapped every round); the
  median and the minimum of the rounds' medians.

With `--ttfi`: time to first inference after `import torch`, through the service, for a >= 400 MB model (the MLP at
--hidden 7168 by default: 441 MB of float32 weights), weightless with its blob against its self-contained build
(compile option embed_weights, what `aotc pull --self-contained` fetches). A service of its own (embedded Redis, the
API, one worker: bench/ttfi.py's) compiles both; then each round runs, per artifact, a fresh process with an empty
client cache (`cold`: the whole pull) and one with the cache the cold one left (`warm`: verified records checked,
nothing downloaded or hashed). Each process imports torch, then times `Client.load(..., timings=...)`'s parts:
verify (manifest, signature, the cached copy's record), pull (the package, hashed as it streams), bind (the device
check), weights_pull (the blob: pulled and verified, or its verified record read), weights_load (the blob mapped and
put on the device), load (the package opened, the weights bound) and the first call.

Figures on a loaded 2-core CPU move with the load: quote medians from one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BUCKETS = (1, 4, 16)
TTFI_PARTS = ("verify_s", "pull_s", "bind_s", "weights_pull_s", "weights_load_s", "load_s", "first_call_s")
TTFI_BATCH = 8
PRECISIONS = ("keep", "bf16")
D_IN, HIDDEN = 1024, 2048


def wide(hidden: int) -> Any:
    """The benchmark's MLP: Linear(D_IN, hidden), 2x Linear(hidden, hidden), LayerNorm, Linear(hidden, 4)."""
    import torch

    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(D_IN, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
                torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    torch.manual_seed(0)
    return Wide().eval()


def build(work: Path, device: str, hidden: int) -> dict[str, Any]:
    import torch

    from compiler.compat.aoti import aoti_compile_and_package, weightless_configs
    from compiler.options import CompileOptions
    from compiler.specialize import specialize
    from compiler.weights import program_weights, save

    model = wide(hidden)
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())  # before any cast touches them
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(4, D_IN),), dynamic_shapes={"x": {0: batch}})
    program_inputs = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64, "symbol": "s0"}, D_IN]}]
    rows = []
    for precision in PRECISIONS:
        for b in BUCKETS:
            spec = [{"name": "x", "dtype": "float32", "shape": [b, D_IN]}]
            program = specialize(ep, spec, program_inputs, device, precision)
            configs = CompileOptions(precision=precision).inductor_configs()  # type: ignore[arg-type]
            for variant in ("before", "after"):
                path = work / f"{precision}-b{b}-{variant}.pt2"
                extra = weightless_configs() if variant == "after" else {}
                t0 = time.perf_counter()
                aoti_compile_and_package(program, str(path), {**configs, **(extra or {})})
                seconds = time.perf_counter() - t0
                row: dict[str, Any] = {"precision": precision, "batch": b, "variant": variant, "path": str(path),
                                       "package_bytes": path.stat().st_size, "compile_s": round(seconds, 2)}
                if variant == "after":
                    blob = work / f"{precision}-b{b}-after.weights.safetensors"
                    save(program_weights(program), blob)
                    row["weights_bytes"] = blob.stat().st_size
                    row["weights_sha256"] = hashlib.sha256(blob.read_bytes()).hexdigest()
                rows.append(row)
                print(f"compiled {precision} batch {b} {variant}: {row['package_bytes']} bytes in {seconds:.1f} s",
                      file=sys.stderr)
    return {"rows": rows, "weights_fp32_bytes": params}


LOAD = r"""
import sys, time, json, resource
t0 = time.perf_counter()
sys.path[:0] = [sys.argv[1]]
import torch
from compiler.compat.aoti import aoti_load_package
paths, device = json.loads(sys.argv[2]), sys.argv[3]
firsts, fns = [], []
shared = None
for p, b in paths:
    weights = None
    if p.endswith("after.pt2"):
        from compiler.weights import load, sidecar
        blob = sidecar(p)
        # one blob bound into every bucket, as Client.load does (the buckets' sidecars hold the same bytes)
        shared = shared if shared is not None else load(blob, device)
        weights = shared
    fn = aoti_load_package(p, device, weights=weights)
    with torch.inference_mode():
        fn(torch.randn(b, D_IN, device=device))
    if device != "cpu":
        torch.cuda.synchronize()
    firsts.append(round(time.perf_counter() - t0, 3))
    fns.append(fn)
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
gpu = torch.cuda.memory_allocated() if device != "cpu" else None
# AOTInductor allocates an embedded package's constants with cudaMalloc, outside torch's caching allocator
# (aot_inductor.weight_use_caching_allocator is off), so memory_allocated misses them: the device's used bytes too.
used = (lambda fr: fr[1] - fr[0])(torch.cuda.mem_get_info()) if device != "cpu" else None
print(json.dumps({"first_inference_s": firsts, "rss_bytes": rss, "cuda_allocated_bytes": gpu,
                  "cuda_used_bytes": used}))
""".replace("D_IN", str(D_IN))

LATENCY = r"""
import sys, json
sys.path[:0] = [sys.argv[1]]
import torch
from compiler.check import measure
from compiler.compat.aoti import aoti_load_package
before, after, b, device, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
x = torch.randn(b, D_IN, device=device)
fns = {"before": aoti_load_package(before, device), "after": aoti_load_package(after, device)}
out = {"before": [], "after": []}
with torch.inference_mode():
    for k in range(rounds):
        for name in (("before", "after") if k % 2 == 0 else ("after", "before")):
            out[name].append(measure(lambda: fns[name](x), device, budget_s=2.0)["median_ms"])
print(json.dumps(out))
""".replace("D_IN", str(D_IN))


def run(script: str, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", script, str(ROOT), *args], capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def ttfi_child(url: str, key: str, device: str, cache: str) -> dict[str, Any]:
    """One fresh process's time to first inference after `import torch` (timed apart), split into TTFI_PARTS."""
    t0 = time.perf_counter()
    import torch

    out: dict[str, Any] = {"import_s": time.perf_counter() - t0}
    from client import Client

    timings: dict[str, float] = {}
    with Client(url, cache_dir=cache, timeout=1800) as c:
        fn = c.load(key, device, timings=timings)
    x = torch.randn(TTFI_BATCH, D_IN, device=device)
    with torch.inference_mode():
        fn(x)
    out.update({p: timings.get(p, 0.0) for p in TTFI_PARTS})
    out["ttfi_s"] = sum(out[p] for p in TTFI_PARTS)
    out["rss_bytes"] = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    return out


def run_ttfi(args: argparse.Namespace) -> None:
    """--ttfi: both layouts of one >= 400 MB model, compiled by a service of its own, loaded in fresh processes."""
    import shutil

    import torch

    from bench.ttfi import _pythonpath, start_service
    from client import Client

    base = Path(tempfile.mkdtemp(prefix="aotc-weights-ttfi-"))
    url, procs, redis_srv = start_service(base, args.device)
    artifacts: dict[str, dict[str, Any]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        model = wide(args.hidden)
        target = "cpu" if args.device == "cpu" else "cuda"
        with Client(url, timeout=3600) as c:
            for layout, opts in (("weightless", {}), ("self-contained", {"embed_weights": True})):
                t0 = time.perf_counter()
                art = c.compile(model, (torch.randn(TTFI_BATCH, D_IN),), target=target, timeout=3600, **opts)
                assert not isinstance(art, tuple)
                w = art.meta.get("weights") or {}
                artifacts[layout] = {"key": art.key, "compile_s": round(time.perf_counter() - t0, 1),
                                     "package_bytes": art.meta["size"], "weights_bytes": w.get("size", 0),
                                     "layout": art.meta["factors"]["weights"]["layout"],
                                     "stage_s": art.meta.get("timings")}
                print(f"{layout}: {art.key}, package {art.meta['size']} bytes, weights {w.get('size', 0)} bytes, "
                      f"{artifacts[layout]['compile_s']} s", file=sys.stderr, flush=True)
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        for r in range(args.rounds):
            for layout, a in artifacts.items():
                cache = base / f"cache-{layout}"
                shutil.rmtree(cache, ignore_errors=True)
                for mode in ("cold", "warm"):
                    t0 = time.perf_counter()
                    p = subprocess.run([sys.executable, __file__, "--ttfi-child", url, a["key"], args.device,
                                        str(cache)], capture_output=True, text=True, timeout=1800, env=env)
                    if p.returncode != 0:
                        raise RuntimeError(p.stderr[-3000:])
                    row = json.loads(p.stdout.strip().splitlines()[-1])
                    row["wall_s"] = time.perf_counter() - t0
                    runs.setdefault(f"{layout}|{mode}", []).append(row)
                    print(f"round {r + 1} {layout} {mode}: ttfi {row['ttfi_s']:.3f} s", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        redis_srv.stop()
        shutil.rmtree(base, ignore_errors=True)
    cols = ("import_s", *TTFI_PARTS, "ttfi_s", "rss_bytes")
    rows = []
    for label, got in runs.items():
        layout, mode = label.split("|")
        rows.append({"layout": layout, "cache": mode, "runs": len(got),
                     **{k: round(statistics.median(g[k] for g in got), 4) for k in cols}})
    import platform

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__, "device": args.device,
        "model": {"hidden": args.hidden, "weights_fp32_bytes": sum(
            t.numel() * t.element_size() for t in model.state_dict().values())},
        "batch": TTFI_BATCH, "rounds": args.rounds, "artifacts": artifacts, "rows": rows, "runs": runs}, indent=1))
    head = ("layout", "cache", "import", "verify", "pull", "bind", "w.pull", "w.load", "load", "1st call", "TTFI",
            "RSS MB")
    print("  ".join(f"{h:>14}" if i < 2 else f"{h:>8}" for i, h in enumerate(head)))
    for r in rows:
        print(f"{r['layout']:>14}  {r['cache']:>14}  " + "  ".join(
            f"{r[k]:>8.3f}" for k in ("import_s", *TTFI_PARTS, "ttfi_s")) + f"  {r['rss_bytes'] / 2**20:>8.0f}")
    print(f"wrote {args.out}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ttfi-child":
        url, key, device, cache = sys.argv[2:6]
        print(json.dumps(ttfi_child(url, key, device, cache)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/weights-cpu.json")
    ap.add_argument("--rounds", type=int, default=3, help="fresh-process loads per variant")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:0) on the GPU machine")
    ap.add_argument("--hidden", type=int, default=None,
                    help="the MLP's width: 2048 is 42 MB of fp32 weights, 7168 is 441 MB (the issue's >= 400 MB); "
                    "default 2048, and 7168 with --ttfi")
    ap.add_argument("--ttfi", action="store_true", help="time to first inference after import, through the service, "
                    "weightless against self-contained (see above)")
    ap.add_argument("--latency-rounds", type=int, default=9, help="alternating rounds of the latency comparison")
    args = ap.parse_args()
    if args.ttfi:
        args.hidden = args.hidden or 7168
        run_ttfi(args)
        return
    args.hidden = args.hidden or HIDDEN
    with tempfile.TemporaryDirectory(prefix="aotc-weights-") as tmp:
        built = build(Path(tmp), args.device, args.hidden)
        rows = built["rows"]
        pick = {(r["precision"], r["batch"], r["variant"]): r for r in rows}
        before_store = sum(r["package_bytes"] for r in rows if r["variant"] == "before")
        after_rows = [r for r in rows if r["variant"] == "after"]
        blobs = {r["weights_sha256"]: r["weights_bytes"] for r in after_rows}
        after_store = sum(r["package_bytes"] for r in after_rows) + sum(blobs.values())
        downloads = {}
        for precision in PRECISIONS:
            b3 = [pick[(precision, b, "before")]["package_bytes"] for b in BUCKETS]
            a3 = [pick[(precision, b, "after")] for b in BUCKETS]
            downloads[precision] = {"before": sum(b3),
                                    "after": sum(r["package_bytes"] for r in a3) + a3[0]["weights_bytes"]}
        loads: dict[str, Any] = {}
        for variant in ("before", "after"):
            paths = json.dumps([[pick[("keep", b, variant)]["path"], b] for b in BUCKETS])
            runs = [run(LOAD, paths, args.device) for _ in range(args.rounds)]
            loads[variant] = {
                "first_inference_s_median": [statistics.median(r["first_inference_s"][i] for r in runs)
                                             for i in range(len(BUCKETS))],
                "rss_bytes_median": statistics.median(r["rss_bytes"] for r in runs), "runs": runs}
            if args.device != "cpu":
                for what in ("cuda_allocated_bytes", "cuda_used_bytes"):
                    loads[variant][f"{what}_median"] = statistics.median(r[what] for r in runs)
        lat = run(LATENCY, pick[("keep", 16, "before")]["path"], pick[("keep", 16, "after")]["path"], "16",
                  args.device, str(args.latency_rounds))
        latency = {k: {"medians_ms": v, "median_ms": statistics.median(v), "min_ms": min(v)} for k, v in lat.items()}
    import torch

    result = {
        "model": {"layers": f"Linear({D_IN},{args.hidden}), 2x Linear({args.hidden},{args.hidden}), LayerNorm, "
                            f"Linear({args.hidden},4)",
                  "weights_fp32_bytes": built["weights_fp32_bytes"]},
        "buckets": list(BUCKETS), "precisions": list(PRECISIONS), "torch": torch.__version__, "device": args.device,
        "distinct_weights_blobs": len(blobs), "rows": [{k: v for k, v in r.items() if k != "path"} for r in rows],
        "store_bytes": {"before": before_store, "after": after_store, "ratio": round(after_store / before_store, 3)},
        "download_bytes_three_buckets": downloads, "load": loads, "latency_batch16": latency,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'':34}{'before':>14}{'after':>14}{'ratio':>8}")
    print(f"{'store bytes (6 artifacts)':34}{before_store:>14}{after_store:>14}{after_store / before_store:>8.3f}")
    for p, d in downloads.items():
        print(f"{'download bytes, 3 buckets, ' + p:34}{d['before']:>14}{d['after']:>14}"
              f"{d['after'] / d['before']:>8.3f}")
    for i, b in enumerate(BUCKETS):
        fb, fa = (loads[v]["first_inference_s_median"][i] for v in ("before", "after"))
        print(f"{f'first inference of bucket {b} (s)':34}{fb:>14.3f}{fa:>14.3f}{fa / fb:>8.3f}")
    rb, ra = loads["before"]["rss_bytes_median"], loads["after"]["rss_bytes_median"]
    print(f"{'RSS after 3 buckets (bytes)':34}{rb:>14.0f}{ra:>14.0f}{ra / rb:>8.3f}")
    if args.device != "cpu":
        for what in ("cuda_allocated_bytes", "cuda_used_bytes"):
            gb, ga = (loads[v][f"{what}_median"] for v in ("before", "after"))
            print(f"{what + ', 3 buckets':34}{gb:>14.0f}{ga:>14.0f}{ga / max(gb, 1):>8.3f}")
    for stat in ("median_ms", "min_ms"):
        lb, la = latency["before"][stat], latency["after"][stat]
        print(f"{'call, batch 16, ' + stat.replace('_ms', '') + ' of rounds (ms)':34}{lb:>14.4f}{la:>14.4f}"
              f"{la / lb:>8.3f}")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
