"""What the sandbox's bounds cost a child's start, and what they hold against a hostile child.

1. Start-up: the median of --runs starts of a trivial child (/bin/true behind the sandbox, as worker.sandbox starts
   a compile: make its dir, confine it, spawn, wait, clean up), as the worker runs it and with each mechanism left
   out in turn (its cgroup, its tmpfs, its seccomp filter), and with --baseline, a tree of main's code, as main
   starts one (`--ro-bind / /`, rlimits only).
2. Bounds: the hostile programs of tests/worker/test_sandbox_bounds.py run in a sandbox as the worker makes it: three
   processes of 160 MiB each under a 256 MiB bound, six files of 24 MiB each under a 64 MiB bound, a fork bomb under
   a bound of 40 with a second sandbox starting 20 processes meanwhile. With --baseline, the same on main.

Needs root (cgroups, tmpfs, privileged bwrap). Prints a table and writes JSON:

    python bench/sandbox_cost.py --baseline /path/to/main-tree --out bench/results/sandbox-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _limits(**kw: int) -> Any:
    """worker.limits.Limits of whichever tree is imported (main's has no disk bound)."""
    from worker.limits import Limits

    known = {f.name for f in fields(Limits)}
    return Limits(**{k: v for k, v in kw.items() if k in known})


def _sandbox(base: Path) -> Any:
    from worker.isolation import setup
    from worker.settings import WorkerSettings

    return setup(WorkerSettings(work_dir=base / "work", data_dir=base / "data"), "cpu")


def _start_once(sb: Any, limits: Any, base: Path) -> float:
    jobdir = Path(tempfile.mkdtemp(dir=base))
    os.chmod(jobdir, 0o755)
    childdir = jobdir / "c"
    childdir.mkdir()
    t0 = time.perf_counter()
    if hasattr(sb, "cell"):
        with sb.cell(limits, "cpu") as cell:
            cell.scratch(childdir)
            (childdir / "tmp").mkdir()
            cell.sandbox.own(childdir)
            proc = cell.spawn(["/bin/true"], jobdir=jobdir, childdir=childdir, ro_files=(), hide=(),
                              stdin=subprocess.DEVNULL)
            rc = proc.wait()
    else:  # main's tree
        (childdir / "tmp").mkdir()
        sb.own(childdir)
        argv, kw = sb.command(["/bin/true"], jobdir=jobdir, childdir=childdir, device="cpu", limits=limits)
        rc = subprocess.run(argv, stdin=subprocess.DEVNULL, **kw).returncode
    seconds = time.perf_counter() - t0
    shutil.rmtree(jobdir)
    if rc != 0:
        raise RuntimeError(f"the trivial child failed: exit status {rc}")
    return seconds


def _starts(sb: Any, runs: int, base: Path) -> dict[str, Any]:
    limits = _limits(memory_bytes=16 << 30, cpu_s=36000, file_bytes=16 << 30, procs=4096, open_files=8192,
                     disk_bytes=16 << 30)
    _start_once(sb, limits, base)  # warm the page cache
    times = [_start_once(sb, limits, base) for _ in range(runs)]
    return {"median_ms": round(statistics.median(times) * 1000, 2), "min_ms": round(min(times) * 1000, 2),
            "max_ms": round(max(times) * 1000, 2), "runs": runs}


def _hostile(sb: Any, base: Path) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "worker"))
    import test_bounds as tb  # the same hostile programs as the test

    sb = replace(sb, pythonpath=(*sb.pythonpath, str(tb.HOSTILE)))
    out: dict[str, Any] = {}
    mem, said = tb._run(sb, base / "memory", tb.MEMORY, _limits(memory_bytes=256 << 20), {"procs": 3, "mb": 160})
    out["memory"] = {"bound_mib": 256, "asked_mib": 3 * 160,
                     "held_together_mib": sum(s.get("holding_mb", 0) for s in said),
                     "cgroup_peak_mib": (getattr(mem, "peaks", {}).get("memory_bytes") or 0) >> 20 or None,
                     "failure": mem.failure.message if mem.failure else None}
    disk, [d] = tb._run(sb, base / "disk", tb.DISK, _limits(file_bytes=64 << 20, disk_bytes=64 << 20),
                        {"files": 6, "mb": 24})
    out["disk"] = {"bound_mib": 64, "asked_mib": 6 * 24, "written_mib": d["written"] >> 20, "error": d["error"],
                   "failure": disk.failure.message if disk.failure else None}
    bomb: dict[str, Any] = {}
    t = threading.Thread(target=lambda: bomb.update(out=tb._run(sb, base / "bomb", tb.FORK_BOMB, _limits(procs=40))))
    t.start()
    try:
        while not (held := tb._said(base / "bomb" / "probe.log")) and t.is_alive():
            time.sleep(0.2)
        _, [second] = tb._run(sb, base / "second", tb.START, _limits(procs=40), {"procs": 20})
    finally:
        (base / "bomb" / "release").touch()
        t.join(180)
    outcome = bomb["out"][0]
    out["processes"] = {"bound": 40, "fork_bomb_forked": held[0]["forked"] if held else None,
                        "cgroup_peak": getattr(outcome, "peaks", {}).get("procs"),
                        "second_sandbox_started_of_20": second["started"],
                        "failure": outcome.failure.message if outcome.failure else None}
    return out


def measure(runs: int, variants: bool) -> dict[str, Any]:
    """In this process, with whichever tree is first on sys.path."""
    base = Path(tempfile.mkdtemp(prefix="sandbox-cost-", dir="/var/tmp"))
    try:
        sb = _sandbox(base)
        starts = {"as the worker runs it": _starts(sb, runs, base)}
        if variants:
            b = sb.bounds
            for name, bounds in (("without its cgroup", replace(b, cgroups=None)),
                                 ("without its tmpfs", replace(b, tmpfs=False)),
                                 ("without seccomp", replace(b, seccomp=None)),
                                 ("without all three", replace(b, cgroups=None, tmpfs=False, seccomp=None))):
                starts[name] = _starts(replace(sb, bounds=bounds), runs, base)
        return {"describe": sb.describe(), "starts": starts, "hostile": _hostile(sb, base)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--baseline", type=Path, help="a tree of main's code, measured the same way")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sandbox-cost.json")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)  # the baseline's subprocess
    a = ap.parse_args()
    if a.measure_only:
        print(json.dumps(measure(a.runs, variants=False)))
        return 0
    sys.path.insert(0, str(ROOT))
    result: dict[str, Any] = {"host": os.uname().nodename, "cpus": os.cpu_count(), "runs": a.runs,
                              "this tree": measure(a.runs, variants=True)}
    if a.baseline:
        env = {**os.environ, "PYTHONPATH": str(a.baseline.resolve())}
        r = subprocess.run([sys.executable, __file__, "--measure-only", "--runs", str(a.runs)], env=env,
                           cwd=a.baseline, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"the baseline failed:\n{r.stderr[-3000:]}")
        result["baseline (main)"] = json.loads(r.stdout.splitlines()[-1])
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {a.out}")
    return 0


def _print(result: dict[str, Any]) -> None:
    print(f"start of a trivial child: median of {result['runs']} ({result['cpus']} CPUs)")
    print(f"{'TREE / SETUP':<44} {'MEDIAN ms':>10} {'MIN ms':>8} {'MAX ms':>8}")
    base_ms = None
    if "baseline (main)" in result:
        s = result["baseline (main)"]["starts"]["as the worker runs it"]
        base_ms = s["median_ms"]
        print(f"{'main: --ro-bind / /, rlimits':<44} {s['median_ms']:>10} {s['min_ms']:>8} {s['max_ms']:>8}")
    for name, s in result["this tree"]["starts"].items():
        extra = f"  (+{s['median_ms'] - base_ms:.1f} ms vs main)" if base_ms is not None and name.startswith("as") \
            else ""
        print(f"{'this tree: ' + name:<44} {s['median_ms']:>10} {s['min_ms']:>8} {s['max_ms']:>8}{extra}")
    print("\nhostile child")
    print(f"{'TREE':<10} {'BOUND':<34} {'ASKED':>8} {'REACHED':>8}  NOTE")
    for tree in ("baseline (main)", "this tree"):
        if tree not in result:
            continue
        h = result[tree]["hostile"]
        label = "main" if tree.startswith("baseline") else "this"
        m, d, p = h["memory"], h["disk"], h["processes"]
        print(f"{label:<10} {'memory 256 MiB, 3 processes':<34} {m['asked_mib']:>8} {m['held_together_mib']:>8}"
              f"  MiB held together; cgroup peak {m['cgroup_peak_mib']} MiB")
        print(f"{label:<10} {'disk 64 MiB, 6 files':<34} {d['asked_mib']:>8} {d['written_mib']:>8}  MiB written; "
              f"{d['error']}")
        print(f"{label:<10} {'processes 40, a fork bomb':<34} {'-':>8} {p['fork_bomb_forked']!s:>8}  forked; "
              f"cgroup peak {p['cgroup_peak']}; a second sandbox started {p['second_sandbox_started_of_20']} of 20")


if __name__ == "__main__":
    sys.exit(main())
