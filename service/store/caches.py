"""What workers share to compile faster, and the count of compiles actually run.

The shared caches are max-autotune's matmul/conv timings (worker.tuning) and Inductor's own remote caches; the
compile count proves a cache hit in tests (a hit compiles nothing).
"""

from __future__ import annotations

from typing import Any

import redis

from service.store import keys


class Caches:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def summary(self) -> dict[str, Any]:
        """Max-autotune timings per (namespace, target, system), and how many entries Inductor's remote caches
        hold. Counting scans the keyspace (SCAN, never KEYS). A table of before namespaces (no compile reads it any
        more; `clear` drops it) shows namespace null."""
        prefix = keys.gemm_tuning("", "", "")[: -len("::")]
        gemm = []
        for k in sorted(self.r.scan_iter(match=keys.GEMM_TUNING_PATTERN, count=1000)):
            name = k.decode() if isinstance(k, bytes) else str(k)
            parts = name[len(prefix):].split(":")  # a namespace, a target and a system hash have no ':'
            ns = parts[0] if len(parts) == 3 else None
            gemm.append({"namespace": ns, "target": parts[-2] if len(parts) >= 2 else "", "system": parts[-1],
                         "entries": int(self.r.hlen(name))})
        inductor = sum(1 for _ in self.r.scan_iter(match=keys.INDUCTOR_PATTERN, count=1000))
        return {"gemm_timings": gemm, "inductor_entries": inductor}

    def clear(self) -> dict[str, int]:
        """Drop every shared timing and Inductor remote-cache entry. Artifacts stay; later compiles start cold."""
        removed = {"gemm_timings": 0, "inductor_entries": 0}
        for what, pattern in (("gemm_timings", keys.GEMM_TUNING_PATTERN), ("inductor_entries", keys.INDUCTOR_PATTERN)):
            batch: list[Any] = []
            for k in self.r.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    removed[what] += int(self.r.unlink(*batch))
                    batch = []
            if batch:
                removed[what] += int(self.r.unlink(*batch))
        return removed

    def compiles(self) -> int:
        """How many compiles workers have run."""
        return int(self.r.get(keys.COMPILES) or 0)

    def record_compile(self) -> int:
        return int(self.r.incr(keys.COMPILES))
