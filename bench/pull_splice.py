"""The verified pull's ways, in alternating pulls against one API (issue 24): splice(2) from the socket into the file,
hashed from the page cache (client/transfer.py `_splice`), or the buffered path (`readinto` into reused 1 MiB
buffers, written and hashed from them); the digest verified, BLAKE3 (the default where the manifest signs one,
compiler/digests.py) or sha256 (`AOTC_PULL_DIGEST=sha256`); and one stream, or ranges over several connections at
once, the file hashed whole after (`ranges-N`: AOTC_PULL_STREAMS=N; until 2026-11-30 also `ranges`, then
AOTC_PULL_STREAMS=auto: half the cores, at most 8). One service (a file blob store, served with sendfile),
one package of random bytes, signed as a worker signs (both digests); each pull into an empty client cache, the
order of the ways rotating by round. Per way: the median rate, the client's CPU per GB (all its threads) and the API
process's; `x_rate` and `x_client_cpu` against the last way named.

    python bench/pull_splice.py --size-mb 130 --rounds 11 --ways splice,splice-sha256 --out pull.json
    python bench/pull_splice.py --size-mb 130 --rounds 11 --ways splice-sha256,buffered-sha256 --out pull.json
    python bench/pull_splice.py --size-mb 800 --rounds 7 --ways ranges-8,ranges-4,splice --out pull.json

`--trees BEFORE,AFTER` (checkouts, e.g. `git archive main | tar -x -C /tmp/main`) compares two clients' default
pull instead of the ways, against one API (this tree's): each round, per tree in rotating order, a child process
with that tree on its path makes `--per-child` pulls, each by a fresh `Client` (made outside the clock) into an
empty cache, `Client.pull(key)` timed as above; the child's CPU per pull is its own (the API's is not split). Also
per pull: how long `Client(...)` took to make, and a second pull by a fresh `Client` that the cache answers (the
record, the manifest and the keys asked for; nothing downloaded).

    python bench/pull_splice.py --size-mb 130 --rounds 6 --trees /tmp/main,. --out pull-trees.json

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import download  # noqa: E402 - after the path above, as the other scripts here
from client import Client, sdk, transfer  # noqa: E402
from compiler import digests  # noqa: E402

# way: (splice, AOTC_PULL_DIGEST: "" is the default, the fastest signed digest: BLAKE3; AOTC_PULL_STREAMS)
WAYS = {"splice": (True, "", "1"), "buffered": (False, "", "1"), "splice-sha256": (True, "sha256", "1"),
        "buffered-sha256": (False, "sha256", "1"), **{f"ranges-{n}": (True, "", str(n)) for n in (2, 4, 8, 16)}}


# One tree's pulls, in a child process with that tree first on its path: JSON [[wall s, CPU s], ...] on stdout.
CHILD = r"""
import json, shutil, sys, time
from pathlib import Path
from client import Client
url, key, cache, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
out = []
for _ in range(n):
    shutil.rmtree(cache, ignore_errors=True)
    t = time.perf_counter()
    with Client(url, cache_dir=cache, timeout=120) as c:
        made = time.perf_counter() - t
        t0, c0 = time.perf_counter(), time.process_time()
        c.pull(key)
        row = [time.perf_counter() - t0, time.process_time() - c0, made]
    with Client(url, cache_dir=cache, timeout=120) as c:
        t0 = time.perf_counter()
        c.pull(key)  # the cache's copy: its record, manifest and keys asked for, nothing downloaded
        out.append(row + [time.perf_counter() - t0])
print(json.dumps(out))
"""


def compare_trees(a: argparse.Namespace) -> None:
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    if len(trees) != 2 or not all((t / "client" / "sdk.py").exists() for t in trees):
        raise SystemExit(f"--trees wants two checkouts with client/sdk.py: {a.trees}")
    base = Path(tempfile.mkdtemp(prefix="aotc-pull-trees-"))
    lane = download.Lane("file", base)
    size = a.size_mb << 20
    runs: dict[str, list[list[float]]] = {str(t): [] for t in trees}
    try:
        lane.start_api()
        key, _ = lane.publish(size)
        for r in range(a.rounds):
            for t in trees[r % 2:] + trees[:r % 2]:
                env = {k: v for k, v in os.environ.items() if k not in (digests.ENV, sdk.STREAMS_ENV)}
                env["PYTHONPATH"] = str(t)
                p = subprocess.run([sys.executable, "-c", CHILD, lane.url, key, str(base / f"cache-{r}"),
                                    str(a.per_child)], env=env, cwd=t, capture_output=True, text=True, timeout=600)
                if p.returncode:
                    raise SystemExit(f"the pull from {t} failed:\n{p.stderr[-3000:]}")
                runs[str(t)] += json.loads(p.stdout)
    finally:
        lane.close()
        shutil.rmtree(base, ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for tree, rs in runs.items():
        rows[tree] = {"mb_s": round(size / statistics.median(x[0] for x in rs) / 1e6, 1),
                   "mb_s_pulls": [round(size / x[0] / 1e6, 1) for x in rs],
                   "client_cpu_s_per_gb": round(statistics.median(x[1] for x in rs) / size * 1e9, 3),
                   "client_made_ms": round(statistics.median(x[2] for x in rs) * 1e3, 2),
                   "cached_pull_ms": round(statistics.median(x[3] for x in rs) * 1e3, 2)}
    before, after = rows[str(trees[0])], rows[str(trees[1])]
    after["x_rate"] = round(after["mb_s"] / before["mb_s"], 3)
    print(f"{'tree':40} {'MB/s':>8} {'client CPU s/GB':>16} {'Client() ms':>11} {'cached pull ms':>14}   pulls MB/s")
    for tree, row in rows.items():
        print(f"{tree[-40:]:40} {row['mb_s']:8.0f} {row['client_cpu_s_per_gb']:16.3f} {row['client_made_ms']:11.2f} "
              f"{row['cached_pull_ms']:14.2f}   "
              f"{' '.join(str(round(x)) for x in row['mb_s_pulls'])}")
    print(f"after / before: {after['x_rate']}x")
    a.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                                 "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "size_bytes": size,
                                 "rounds": a.rounds, "per_child": a.per_child, "trees": rows,
                                 "blake3": digests.BLAKE3 in digests.available()}, indent=1))
    print(f"wrote {a.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=130, help="MiB of random bytes")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--ways", default="splice,splice-sha256", help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--trees", default="", help="BEFORE,AFTER: two checkouts' default pull, each in child processes")
    ap.add_argument("--per-child", type=int, default=3, help="pulls per child process with --trees")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.trees:
        return compare_trees(a)
    ways = {w: WAYS[w] for w in a.ways.split(",")}
    if not hasattr(os, "splice"):
        raise SystemExit("no os.splice here (Linux only): nothing to compare")
    base = Path(tempfile.mkdtemp(prefix="aotc-pull-splice-"))
    lane = download.Lane("file", base)
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    try:
        lane.start_api()
        assert lane.api is not None
        key, _ = lane.publish(a.size_mb << 20)
        size = a.size_mb << 20
        for r in range(a.rounds):
            names = list(ways)
            for way in names[r % len(names):] + names[:r % len(names)]:
                transfer.SPLICE, digest, streams = ways[way]
                os.environ[digests.ENV] = digest
                os.environ[sdk.STREAMS_ENV] = streams
                cache = base / f"client-{way}"
                shutil.rmtree(cache, ignore_errors=True)
                with Client(lane.url, cache_dir=cache, timeout=120) as c:
                    t0, c0, a0 = time.perf_counter(), time.process_time(), download._proc_cpu(lane.api.pid)
                    path = c.pull(key)
                    wall = time.perf_counter() - t0
                    runs[way].append({"s": wall, "client_cpu_s": time.process_time() - c0,
                                      "api_cpu_s": download._proc_cpu(lane.api.pid) - a0})
                    assert path.stat().st_size == size
    finally:
        lane.close()
        shutil.rmtree(base, ignore_errors=True)
    rows = {}
    for way, rs in runs.items():
        s = statistics.median(x["s"] for x in rs)
        rows[way] = {"mb_s": round(size / s / 1e6, 1),
                     "mb_s_rounds": [round(size / x["s"] / 1e6, 1) for x in rs],
                     "client_cpu_s_per_gb": round(statistics.median(x["client_cpu_s"] for x in rs) / size * 1e9, 3),
                     "api_cpu_s_per_gb": round(statistics.median(x["api_cpu_s"] for x in rs) / size * 1e9, 3)}
    base_row = rows[list(ways)[-1]]
    for row in list(rows.values())[:-1]:
        row["x_rate"] = round(row["mb_s"] / base_row["mb_s"], 2)
        row["x_client_cpu"] = round(row["client_cpu_s_per_gb"] / base_row["client_cpu_s_per_gb"], 2)
    print(f"{'way':16} {'MB/s':>8} {'client CPU s/GB':>16} {'API CPU s/GB':>13}   rounds MB/s")
    for way, row in rows.items():
        print(f"{way:16} {row['mb_s']:8.0f} {row['client_cpu_s_per_gb']:16.3f} {row['api_cpu_s_per_gb']:13.3f}   "
              f"{' '.join(str(round(x)) for x in row['mb_s_rounds'])}")
    result: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
                              "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(), "size_bytes": size,
                              "rounds": a.rounds, "ways": rows, "blake3": digests.BLAKE3 in digests.available()}
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
