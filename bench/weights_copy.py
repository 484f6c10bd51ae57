"""Where a weights blob's time onto a GPU goes, part by part, in fresh processes: `import compiler.weights`, the
header, the device allocations alone (`torch.empty` of every tensor), pinned buffers alone, then a whole load each
way: `copy_in` with 1, 4 and 8 lanes (pinned chunks, pread), and the old one pageable copy per tensor from the
mapping (AOTC_WEIGHTS_COPY=tensors). The blob is in the page cache (written just before, as a pull leaves it).
Prints a table of medians and writes JSON.

    python bench/weights_copy.py --mb 822 --rounds 3 --out bench/results/weights-copy.json   # a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("alloc", "pinned", "lanes-1", "lanes-4", "lanes-8", "tensors")


def child(path: str, way: str, device: str) -> dict[str, float]:
    import torch

    cuda = device.startswith("cuda")
    torch.empty(1, device=device)  # CUDA initialised before the clock, as Client.load's bind does
    t0 = time.perf_counter()
    from compiler import weights, weightsfile

    t1 = time.perf_counter()
    header = weightsfile.read_header_file(path)
    t2 = time.perf_counter()
    if way == "alloc":
        kept = [torch.empty(e.shape, dtype=getattr(torch, e.dtype), device=device) for e in header.entries.values()]
    elif way == "pinned":
        kept = [torch.empty(weights.COPY_CHUNK, dtype=torch.uint8, pin_memory=cuda) for _ in range(weights.COPY_LANES)]
    elif way == "tensors":
        os.environ[weights.COPY_SETTING] = "tensors"
        kept = list(weights.load(path, device).values())
    else:
        kept = list(weights.copy_in(path, header, torch.device(device), lanes=int(way.split("-")[1])).values())
    if cuda:
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    del kept
    return {"import_s": t1 - t0, "header_s": t2 - t1, "work_s": t3 - t2, "total_s": t3 - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=822, help="the blob's size: square fp32 matrices of 7168 (205 MB each)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "weights-copy.json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    import torch

    from compiler import weights

    side = 7168
    n = max(1, round(a.mb * 1e6 / (side * side * 4)))
    tmp = Path(tempfile.mkdtemp(prefix="aotc-wcopy-"))
    path = tmp / "w.safetensors"
    weights.save({f"layer{i}.weight": torch.randn(side, side) for i in range(n)} | {"bias": torch.randn(side)}, path)
    size = path.stat().st_size
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for r in range(a.rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            p = subprocess.run([sys.executable, __file__, "--child", str(path), way, a.device], capture_output=True,
                               text=True, env=env, timeout=300)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            runs[way].append(json.loads(p.stdout.strip().splitlines()[-1]))
    rows = []
    print(f"{'way':10} {'import s':>9} {'header s':>9} {'work s':>8} {'total s':>8} {'GB/s':>6}")
    for way, got in runs.items():
        row = {"way": way, **{k: round(statistics.median(g[k] for g in got), 4) for k in got[0]}}
        row["gb_s"] = round(size / 1e9 / row["work_s"], 2) if way not in ("alloc", "pinned") else None
        rows.append(row)
        print(f"{way:10} {row['import_s']:9.4f} {row['header_s']:9.4f} {row['work_s']:8.4f} {row['total_s']:8.4f} "
              f"{row['gb_s'] or '':>6}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "device": a.device,
                                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                 "cpus": os.cpu_count(), "bytes": size, "rounds": a.rounds, "rows": rows,
                                 "runs": runs}, indent=1) + "\n")
    print(f"wrote {a.out}")
    path.unlink()


if __name__ == "__main__":
    main()
