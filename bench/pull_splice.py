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

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=130, help="MiB of random bytes")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--ways", default="splice,splice-sha256", help=f"comma-separated, of {', '.join(WAYS)}")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
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
