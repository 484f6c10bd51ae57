"""Lanes for bench/train.py (issue 23): one GPU per lane, or a share of the cores for a CPU smoke test.

`train.py --lanes N` (or `--gpus 0,1,2,3`) is the parent. It splits the models across the lanes by a rough cost
(largest first, each to the lane with the least so far), splits its cores into N contiguous shares, and starts one
`train.py --lane K` per lane with CUDA_VISIBLE_DEVICES set to the lane's GPU. The lane pins itself to its cores
before it imports torch, so its service (embedded Redis, API, workers), their compile and check children and its
timing processes inherit both: one lane's compiles cannot take another lane's cores or GPU.

Each lane writes its own file in the lanes dir (its rows, the models not timed yet, and what it is doing now) and
then merges every lane's file into --out under a lock. The merged JSON is train.py's schema, plus `lane` per row,
`conditions` per timed row, and `lanes`; it is rewritten whenever any lane writes, so a run cut off keeps what it
finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Rough minutes of compile + check + timing per model on an H100 with two jobs per GPU, read off bench/README.md's
# training sections (compiles 165-213 s each, mobilenet_v3_large's the slowest; checks 241 s DistilBERT and 299 s
# ViT-S; BERT and GPT-2 are larger). Only for balancing the lanes: a wrong guess costs balance, not correctness.
COST = {"mobilenet_v3_large": 10, "efficientnet_b0": 10, "hf_bert_base": 10, "hf_gpt2": 10, "convnext_tiny": 9,
        "timm_vit_small_patch16_224": 9, "resnet50": 8, "hf_distilbert": 8, "train_mlp": 1, "conv_bn": 2,
        "mlp_deep": 1, "hf_roberta_base": 10, "swin_t": 9}


def plan(names: list[str], n: int) -> list[list[str]]:
    """The models of each lane: largest cost first, each to the lane with the least cost so far (ties: the lower
    lane). Within a lane the order stays largest first, the order its models are queued in."""
    lanes: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    default = sorted(COST.values())[len(COST) // 2]
    for name in sorted(names, key=lambda m: -COST.get(m, default)):
        k = min(range(n), key=lambda i: (load[i], i))
        lanes[k].append(name)
        load[k] += COST.get(name, default)
    return lanes


def split_cpus(cpus: list[int], n: int) -> list[list[int]]:
    """`cpus` in n contiguous shares, as even as they go (the first shares take the remainder)."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        raise SystemExit(f"{n} lanes need at least {n} cores; this process may use {len(cpus)}")
    size, extra = divmod(len(cpus), n)
    out, i = [], 0
    for k in range(n):
        j = i + size + (1 if k < extra else 0)
        out.append(cpus[i:j])
        i = j
    return out


def cpu_spec(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (taskset's and bench.py's form)."""
    xs = sorted(cpus)
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(f"{xs[i]}" if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(parts)


def lane_file(lane_dir: Path, k: int) -> Path:
    return lane_dir / f"lane-{k}.json"


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):  # not written yet
        return None


def write_atomic(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def lanes_of(lane_dir: Path) -> list[dict[str, Any]]:
    files = sorted(lane_dir.glob("lane-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [doc for doc in map(_read, files) if doc is not None]


def others(lane_dir: Path, k: int) -> dict[str, Any]:
    """What every other lane is doing now, as it last wrote it: {lane: status}."""
    return {str(doc["lane"]): doc.get("status") for doc in lanes_of(lane_dir) if doc.get("lane") != k}


def merge(lane_dir: Path, out: Path) -> dict[str, Any]:
    """Every lane's file and the rows an earlier run finished (prev.json, from --append) into `out`, under a lock
    (lanes merge whenever they write)."""
    with open(lane_dir / "merge.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prev = _read(lane_dir / "prev.json") or {"rows": [], "untimed": []}
        docs = lanes_of(lane_dir)
        rows = [*prev["rows"], *(r for d in docs for r in d.get("rows", []))]
        untimed = [r for d in docs for r in d.get("untimed", [])]
        seen = {r["model"] for r in rows} | {r["model"] for r in untimed}
        untimed += [r for r in prev.get("untimed", []) if r["model"] not in seen]  # an earlier run's checks
        first = docs[0] if docs else prev.get("meta", {})  # nothing left to run: the earlier run's
        merged = {**{k: first.get(k) for k in ("device", "amp", "torch", "host", "cpu_count", "workers", "gpu")},
                  "rows": rows, "untimed": untimed,
                  "lanes": [{k: d.get(k) for k in ("lane", "gpu_index", "gpu", "cpus", "models", "status")}
                            for d in docs]}
        write_atomic(out, merged)
        return merged


def start(a: Any, script: str, names: list[str], cover: list[str], base: Path, lane_dir: Path,
          gpus: list[str | None], extra: list[str]) -> list[tuple[int, subprocess.Popen[bytes], list[str]]]:
    """One `train.py --lane K` per lane, on its GPU (CUDA_VISIBLE_DEVICES) and its share of this process's cores."""
    n = len(gpus)
    shares = split_cpus(sorted(os.sched_getaffinity(0)), n)
    timed, covered = plan(names, n), plan(cover, n) if cover else [[] for _ in range(n)]
    procs = []
    for k, (gpu, cpus) in enumerate(zip(gpus, shares, strict=True)):
        if not timed[k] and not covered[k]:
            continue
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        argv = [sys.executable, script, "--lane", str(k), "--lane-dir", str(lane_dir), "--lane-cpus", cpu_spec(cpus),
                "--zoo", ",".join(timed[k]), "--coverage", ",".join(covered[k]), "--base", str(base / f"lane-{k}"),
                "--out", str(a.out), "--device", "cpu" if gpu is None else "cuda:0", *extra]
        if gpu is not None:
            argv += ["--lane-gpu", gpu]
        print(f"lane {k}: gpu {gpu if gpu is not None else '-'}, cores {cpu_spec(cpus)}, models "
              f"{','.join(timed[k])}{' + coverage ' + ','.join(covered[k]) if covered[k] else ''}", flush=True)
        procs.append((k, subprocess.Popen(argv, env=env), timed[k] + covered[k]))
        time.sleep(1)  # the lanes' services pick free ports: one at a time
    return procs


def follow(procs: list[tuple[int, subprocess.Popen[bytes], list[str]]], lane_dir: Path, out: Path,
           every_s: float = 30) -> int:
    """Until every lane has ended: merge, and print a line per lane when its status changes. The number of lanes
    that failed (a lane's rows are kept either way)."""
    said: dict[int, str] = {}
    t0 = time.monotonic()
    while True:
        running = [k for k, p, _ in procs if p.poll() is None]
        with contextlib.suppress(OSError, ValueError, KeyError):
            merged = merge(lane_dir, out)
            for lane in merged["lanes"]:
                line = json.dumps(lane.get("status"), default=str)
                if said.get(lane["lane"]) != line:
                    said[lane["lane"]] = line
                    print(f"[{time.monotonic() - t0:6.0f} s] lane {lane['lane']}: {line}", flush=True)
        if not running:
            break
        time.sleep(every_s if every_s else 1)
    failed = [k for k, p, _ in procs if p.returncode != 0]
    for k in failed:
        print(f"lane {k} exited with {dict((j, p.returncode) for j, p, _ in procs)[k]}", flush=True)
    return len(failed)
