"""Does an upload's timing tell one namespace that another already holds the same bytes? Prints a table and writes
JSON.

It starts `aotc-server --workers 0` (this tree, auth on, an embedded Redis, the default file blob store) and
exports `--models` distinct models of about `--mb` MB (an MLP with random weights). For each model:

    new        namespace A uploads it: bytes nobody holds (streamed, hashed, inspected, written to the blob store)
    other-ns   namespace B uploads the same bytes: A holds them (201, as for new bytes)
    own        B uploads them again: B holds them (200)

and times each request from the client, over loopback. Then, in this process, the two steps a `new` upload does that
a duplicate skips: `inspect_archive` on the file, and writing it to a file blob store (`put`, fsynced).

    python bench/upload_dedupe.py --out bench/results/upload-dedupe-2cores.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.api_load import wait_up  # noqa: E402


def export_models(n: int, mb: float, out: Path) -> list[Path]:
    import torch

    hidden = int((mb * 2**20 / 4 / 2) ** 0.5 / 1.41)  # two Linear layers of d x 2d: about mb MB of float32
    paths = []
    for i in range(n):
        torch.manual_seed(1000 + i)
        model = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(2 * hidden, hidden)).eval()
        ep = torch.export.export(model, (torch.randn(2, hidden),))
        path = out / f"model-{i}.pt2"
        torch.export.save(ep, path)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--mb", type=float, default=40.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import httpx

    from compiler.archive.inspect import inspect_archive
    from service.api.settings import Settings
    from service.store.blobstore.files import FileBlobs
    from service.store.embedded import free_port

    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                               "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="aotc-dedupe-bench-") as tmp_s:
        tmp = Path(tmp_s)
        paths = export_models(args.models, args.mb, tmp)
        sizes = [p.stat().st_size for p in paths]
        results["model_bytes"] = sizes
        port, admin = free_port(), secrets.token_urlsafe(24)
        env = {**{k: v for k, v in os.environ.items() if k != "AOTC_REDIS_URL"}, "AOTC_DATA_DIR": str(tmp / "data"),
               "AOTC_ADMIN_KEY": admin, "PYTHONPATH": str(ROOT)}
        log = tmp / "server.log"
        server = subprocess.Popen([sys.executable, "-m", "service", "--workers", "0", "--port", str(port),
                                   "--log-level", "warning"], env=env, cwd=ROOT, stdout=open(log, "wb"),
                                  stderr=subprocess.STDOUT)
        times: dict[str, list[float]] = {"new": [], "other-ns": [], "own": []}
        try:
            url = f"http://127.0.0.1:{port}"
            wait_up(url, server, log)
            admin_http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=60)
            clients = {}
            for ns in ("ns-a", "ns-b"):
                key = admin_http.post("/v1/keys", json={"scope": "compile", "namespace": ns}).json()["key"]
                clients[ns] = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
            for path in paths:
                body = path.read_bytes()
                for kind, ns, want in (("new", "ns-a", 201), ("other-ns", "ns-b", 201), ("own", "ns-b", 200)):
                    t0 = time.perf_counter()
                    r = clients[ns].post("/v1/models", content=body)
                    times[kind].append(time.perf_counter() - t0)
                    assert r.status_code == want, (kind, r.status_code, r.text)
        finally:
            server.terminate()
            server.wait(60)

        # The two steps a new upload takes and a duplicate skips, alone.
        limits = Settings(redis_url="redis://unused").archive_limits()
        store = FileBlobs(tmp / "blobs-alone")
        inspect_s, put_s = [], []
        for i, path in enumerate(paths):
            t0 = time.perf_counter()
            inspect_archive(str(path), limits)
            inspect_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                store.put("model", f"m{i}", f)
            put_s.append(time.perf_counter() - t0)
        times["inspect (in-process)"], times["blob put (in-process)"] = inspect_s, put_s

    results["seconds"] = {k: [round(v, 4) for v in vs] for k, vs in times.items()}
    results["median_s"] = {k: round(statistics.median(vs), 4) for k, vs in times.items()}
    results["spread_s"] = {k: [round(min(vs), 4), round(max(vs), 4)] for k, vs in times.items()}
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    med = results["median_s"]
    print(f"\nupload of {args.models} models of {statistics.median(sizes) / 2**20:.1f} MiB each, over loopback, "
          f"{os.cpu_count()} CPUs")
    print(f"{'upload':24s} {'median s':>9s} {'min s':>8s} {'max s':>8s} {'vs new':>7s}")
    for k in times:
        lo, hi = results["spread_s"][k]
        print(f"{k:24s} {med[k]:>9.3f} {lo:>8.3f} {hi:>8.3f} {med[k] / med['new']:>7.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
