"""What a serving process spends importing the client before it can ask for a package: `from client.sdk import
Client` in fresh processes, checkouts alternating in rounds (`--tree`, e.g. main's against this one), and the
modules each loads of those that cost most (torch, the compile options' pydantic models). Prints a table of
medians and writes JSON.

    git worktree add /tmp/main-tree main    # or: git archive main | tar -x -C /tmp/main-tree
    python bench/client_import.py --tree /tmp/main-tree --tree . --rounds 10 --out bench/results/client-import.json

Each run is `python -c` in the tree's root (its own modules first on sys.path), after nothing but the interpreter's
own start; `import torch` is not part of it (a server imports torch anyway, and bench/ttfi.py has it apart).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = """
import sys, time, json
t = time.perf_counter()
from client.sdk import Client
ms = (time.perf_counter() - t) * 1e3
heavy = ("torch", "compiler.options", "compiler.cachekey", "pydantic", "cryptography", "httpx", "rich")
print(json.dumps({"ms": ms, "loaded": [m for m in heavy if m in sys.modules]}))
"""


def _path(tree: Path) -> str:
    """The tree first, then the caller's path (wheels installed with --target, as on a GPU host)."""
    return os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])


def once(tree: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": _path(tree), "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="a checkout's root (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="bench/results/client-import.json")
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in (a.tree or ["."])]
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    for _ in range(a.rounds):
        for t in trees:  # in turn, so that a slow moment of the host falls on every checkout alike
            runs[str(t)].append(once(t))
    rows = []
    for t, rs in runs.items():
        ms = [r["ms"] for r in rs]
        rows.append({"tree": t, "median_ms": round(statistics.median(ms), 1), "min_ms": round(min(ms), 1),
                     "max_ms": round(max(ms), 1), "loaded": rs[-1]["loaded"]})
    print(f"{'tree':40} {'median ms':>10} {'min':>8} {'max':>8}  loaded")
    for r in rows:
        print(f"{r['tree'][-40:]:40} {r['median_ms']:10.1f} {r['min_ms']:8.1f} {r['max_ms']:8.1f}  "
              + ", ".join(r["loaded"]))
    doc = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(), "host": platform.node(),
           "rounds": a.rounds, "rows": rows, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
