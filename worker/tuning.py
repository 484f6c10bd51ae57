"""Share max-autotune's matmul/conv timings between workers through the service's Redis.

With mode=max-autotune Inductor benchmarks every candidate kernel of every matmul and convolution, most of
such a compile's time, and keeps the timings in a local file only (compiler.compat.caches explains the layout).
A worker with a fresh disk, or a second worker, would time them all again. Around each compile the child:

- pull: merges the timings other workers published for this target and system into the local file, so
  Inductor's own lookup finds them and benchmarks only what nobody has measured yet;
- push: publishes the timings the compile measured (HSETNX: the first measurement of a choice stands).

Values are JSON numbers checked on the way in: a bad entry can at worst make Inductor pick a slower (still
correct) kernel, never run anything. Runs inside the compile child, which has torch; this module does not
import it.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import redis

from service.store import keys

log = logging.getLogger("aotc.worker.tuning")

Entry = tuple[str, str, str, str]
MAX_ENTRIES = 200_000  # a hash this large is not pulled (it would cost more than it saves)


def _decode(field: bytes | str, value: bytes | str) -> tuple[Entry, float] | None:
    try:
        parts = json.loads(field)
        ms = float(value)
    except (ValueError, UnicodeDecodeError):
        return None
    if (not isinstance(parts, list) or len(parts) != 4 or not all(isinstance(p, str) for p in parts)
            or not math.isfinite(ms) or ms < 0):
        return None
    return (parts[0], parts[1], parts[2], parts[3]), ms


class GemmTimingShare:
    def __init__(self, redis_url: str, target: str) -> None:
        from compiler.compat import caches

        self.r = redis.Redis.from_url(redis_url, socket_timeout=10)
        self.file = caches.gemm_timings_file()
        self.key = keys.gemm_tuning(target, self.file[1]) if self.file else None
        self.stats: dict[str, Any] = {"shared": 0, "measured": 0, "published": 0}
        self._before: set[Entry] = set()

    def pull(self) -> None:
        """Merge what others measured into the local file. Never fails a compile: Redis trouble is noted."""
        from compiler.compat import caches

        if not self.file or not self.key:
            self.stats["note"] = "this torch keeps max-autotune timings differently: not shared"
            return
        try:
            size = int(self.r.hlen(self.key))
            remote: dict[Entry, float] = {}
            if size <= MAX_ENTRIES:
                for f, v in self.r.hgetall(self.key).items():
                    if (d := _decode(f, v)) is not None:
                        remote[d[0]] = d[1]
            else:
                self.stats["note"] = f"{size} shared timings exceed {MAX_ENTRIES}: not pulled"
            self.stats["shared"] = caches.merge_gemm_timings(self.file[0], remote)
        except redis.RedisError as e:
            self.stats["note"] = f"pull failed: {type(e).__name__}: {e}"
        self._before = set(caches.read_gemm_timings(self.file[0]))

    def push(self) -> None:
        """Publish the timings this compile measured (those not in the file before it ran)."""
        from compiler.compat import caches

        if not self.file or not self.key:
            return
        new = {e: ms for e, ms in caches.read_gemm_timings(self.file[0]).items() if e not in self._before}
        self.stats["measured"] = len(new)
        if not new:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for e, ms in new.items():
                pipe.hsetnx(self.key, json.dumps(list(e)), repr(ms))
            self.stats["published"] = sum(1 for added in pipe.execute() if added)
        except redis.RedisError as e:
            self.stats["note"] = f"push failed: {type(e).__name__}: {e}"
