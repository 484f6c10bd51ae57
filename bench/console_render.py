"""How long the console takes to render an artifact with many kernels: the artifact page, its provenance and the
code view of the kernels file, each fetched over HTTP from a real API (uvicorn) on a real Redis. Prints a table and
writes JSON.

The artifact is made here, not compiled (a 500-kernel compile takes hours on 2 cores): a stage report shaped like
the compiler's (fusion groups with their post-grad and source nodes, extern calls, graphs with their code) and a
sources archive whose kernel file defines every kernel, stored through `Store` as a worker would publish them.

    python bench/console_render.py --kernels 500 --out bench/results/console-render.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.store import Store  # noqa: E402
from service.store.embedded import EmbeddedRedis, free_port  # noqa: E402

ADMIN = "bench-console-admin-key-0123456789"
SPEC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64}, 3, 224, 224]}]


def report(key: str, kernels: int) -> dict[str, Any]:
    groups, post_code, src_code = [], [], []
    for k in range(kernels):
        fx = [f"mul_{k}_{i}" for i in range(8)] + [f"convolution_{k}"]
        src = [f"conv2d_{k}", f"batch_norm_{k}", f"relu_{k}"]
        groups.append({"kernel": f"cpp_fused__native_batch_norm_legit_no_training_relu_{k}",
                       "scheduler_nodes": [f"op{2 * k}", f"op{2 * k + 1}"], "fx_nodes": fx, "capture_nodes": src})
        post_code += [f"    {n} = torch.ops.aten.mul.Tensor(a, b)" for n in fx]
        src_code += [f"    {n} = torch.ops.aten.conv2d.default(x, w)" for n in src]
    externs = [{"node": f"op{9000 + e}", "kernel": "extern_kernels.convolution", "library": "mkldnn",
                "fx_nodes": [f"convolution_{e}"]} for e in range(kernels // 10)]
    stage = {"status": "ok", "seconds": 1.0, "observed_by": "bench", "note": ""}
    return {"schema": 1, "key": key, "torch": "2.13.0+cpu", "device": "cpu", "mode": "default", "options": {},
            "spec": SPEC, "hooks": {}, "notes": [], "stages": {
                "capture": {**stage, "graph": {"nodes": len(src_code), "histogram": {}, "code": "\n".join(src_code),
                                               "file": "graphs/capture.py"}, "dynamic_dims": []},
                "autograd": {**stage, "graph": {"nodes": 1, "histogram": {}}, "inplace_removed": 0},
                "lowering": {**stage, "graph": {"nodes": 1, "histogram": {}}, "before": {"nodes": 1}},
                "fusion": {**stage, "groups": groups, "externs": externs, "kernels": kernels,
                           "extern_calls": len(externs), "nodes_before": 2 * kernels, "nodes_after": 2 * kernels,
                           "inductor_graph": {"nodes": len(post_code), "histogram": {}, "code": "\n".join(post_code),
                                              "file": "graphs/inductor_post_grad.py"}},
                "codegen": {**stage, "language": "cpp", "kernel_count": kernels, "files": []},
                "package": {**stage, "bytes": 1}}}


def sources(kernels: int) -> bytes:
    body = "".join(f'extern "C" void cpp_fused__native_batch_norm_legit_no_training_relu_{k}(const float* in_ptr0,\n'
                   f"    float* out_ptr0)\n{{\n" + "    out_ptr0[0] = in_ptr0[0] * 2.0f;\n" * 30 + "}\n"
                   for k in range(kernels))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("code/kernel.cpp", body)
        zf.writestr("code/wrapper.cpp", "// wrapper\n" * 2000)
        zf.writestr("graphs/capture.py", "def forward(x):\n    return x\n")
    return buf.getvalue()


def publish(store: Store, tmp: Path, kernels: int) -> str:
    key = f"{kernels:032x}"
    package, srcs = tmp / "p.pt2", tmp / "s.zip"
    package.write_bytes(b"p" * 1024)
    srcs.write_bytes(sources(kernels))
    point = {"point": "min", "shapes": {"x": [1, 3, 224, 224]}, "max_rel_err": 1e-7, "eager_ms": 2.0,
             "compiled_ms": 1.0, "speedup": 2.0,
             "latency": {f: {"min_ms": 0.9, "p25_ms": 1.0, "median_ms": 1.1, "p75_ms": 1.2, "max_ms": 1.5,
                             "reps": 20, "warmup_reps": 5, "method": "wall-clock"} for f in ("eager", "compiled")}}
    record = {"key": key, "factors": {"model": "m" * 64, "spec": SPEC}, "model_id": "m" * 64, "target": "cpu-bench",
              "spec": SPEC, "options": {"mode": "default"}, "timings": {"compile_total": 1.0},
              "check": {"passed": True, "max_abs_err": 0, "max_rel_err": 0, "eager_ms": 2.0, "compiled_ms": 1.0,
                        "points": [point, {**point, "point": "max"}]}}
    store.artifacts.put(record, package, report=report(key, kernels), sources=srcs)
    return key


def timed(client: httpx.Client, url: str, reps: int) -> dict[str, float]:
    client.get(url).raise_for_status()  # warm: templates compiled, connections open
    times = []
    size = 0
    for _ in range(reps):
        t = time.perf_counter()
        r = client.get(url)
        times.append(time.perf_counter() - t)
        r.raise_for_status()
        size = len(r.content)
    return {"median_s": statistics.median(times), "max_s": max(times), "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=500)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d) / "redis", appendonly=False) as redis:
        tmp = Path(d)
        store = Store(redis.url)
        key = publish(store, tmp, args.kernels)
        port = free_port()
        env = {**os.environ, "AOTC_REDIS_URL": redis.url, "AOTC_ADMIN_KEY": ADMIN, "AOTC_DATA_DIR": str(tmp),
               "PYTHONPATH": str(ROOT)}
        api = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory",
                                "--port", str(port), "--log-level", "warning"], env=env, cwd=ROOT)
        try:
            base = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=base, timeout=60) as c:
                for _ in range(100):
                    try:
                        c.get("/healthz")
                        break
                    except httpx.TransportError:
                        time.sleep(0.2)
                page = c.get("/ui/login")
                csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
                c.post("/ui/login", data={"key": ADMIN, "csrf": csrf}, headers={"Origin": base})
                c.headers["Authorization"] = f"Bearer {ADMIN}"  # for /v1 (the console reads its cookie only)
                rows = {name: timed(c, path, args.reps) for name, path in (
                    ("artifact page", f"/ui/artifacts/{key}"),
                    ("provenance", f"/ui/artifacts/{key}/provenance"),
                    ("code view (kernel.cpp)", f"/ui/artifacts/{key}/code/code/kernel.cpp"),
                    ("stage report JSON (/v1)", f"/v1/artifacts/{key}/report"))}
        finally:
            api.terminate()
            api.wait(30)
            store.close()
    print(f"{args.kernels} kernels, {args.reps} requests each, load average {os.getloadavg()[0]:.2f}")
    print(f"{'PAGE':28} {'MEDIAN':>9} {'MAX':>9} {'BYTES':>10}")
    for name, r in rows.items():
        print(f"{name:28} {r['median_s'] * 1000:7.0f}ms {r['max_s'] * 1000:7.0f}ms {r['bytes']:>10}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kernels": args.kernels, "reps": args.reps, "cpus": os.cpu_count(),
                                    "load_avg_1m": os.getloadavg()[0], "pages": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
