"""Does `kill -9` of redis-server lose writes it acknowledged? The embedded Redis's settings (AOF on, appendfsync
everysec), writers as busy as they can be, a SIGKILL at a random moment, a restart from the AOF, then a count.

Each writer thread INCRs its own counter and counts the replies it got; after the restart a counter below that count
lost an acknowledged write (one above it was applied, its reply cut off by the kill). `aof_delayed_fsync` (INFO
persistence, read just before the kill) counts the times Redis wrote its AOF late because the disk was still busy
with the previous second's fsync: only then can a reply go out before its write reached the kernel
(docs/queue.md, "Persistence").

    python bench/aof_kill.py [--trials 10] [--writers 8] --out bench/results/aof-kill.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def trial(base: Path, writers: int, rng: random.Random) -> dict[str, Any]:
    import redis

    from service.store.embedded import EmbeddedRedis

    server = EmbeddedRedis(base).start()
    acked = [0] * writers
    go = threading.Event()

    def write(n: int) -> None:
        r = redis.Redis.from_url(server.url, socket_timeout=5)
        go.wait()
        try:
            while True:
                r.incr(f"counter:{n}")
                acked[n] += 1
        except redis.RedisError:
            return

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    go.set()
    time.sleep(rng.uniform(0.5, 2.5))
    delayed = int(redis.Redis.from_url(server.url).info("persistence")["aof_delayed_fsync"])
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    for t in threads:
        t.join()
    t0 = time.monotonic()
    server.start()  # the same port, password and AOF
    restart_s = time.monotonic() - t0
    r = redis.Redis.from_url(server.url, decode_responses=True)
    found = [int(r.get(f"counter:{n}") or 0) for n in range(writers)]
    server.stop()
    return {"acknowledged": sum(acked), "found": sum(found),
            "lost": sum(max(0, a - f) for a, f in zip(acked, found, strict=True)),
            "applied_unacknowledged": sum(max(0, f - a) for a, f in zip(acked, found, strict=True)),
            "aof_delayed_fsync": delayed, "restart_s": round(restart_s, 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/aof-kill.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.trials):
            rows.append({"trial": i + 1, **trial(Path(d) / f"redis-{i}", a.writers, rng)})
    cols = ["trial", "acknowledged", "found", "lost", "applied_unacknowledged", "aof_delayed_fsync", "restart_s"]
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    import redis

    from service.store.embedded import redis_server_binary

    summary = {"trials": a.trials, "writers": a.writers, "acknowledged": sum(r["acknowledged"] for r in rows),
               "lost": sum(r["lost"] for r in rows),
               "median_restart_s": statistics.median(r["restart_s"] for r in rows),
               "redis_server": redis_server_binary(), "redis_py": redis.__version__, "cpus": os.cpu_count(),
               "load_avg": os.getloadavg()}
    print(f"{summary['lost']} of {summary['acknowledged']} acknowledged writes lost over {a.trials} kill -9s; "
          f"median restart {summary['median_restart_s']} s")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"summary": summary, "trials": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
