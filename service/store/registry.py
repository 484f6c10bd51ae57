"""The worker registry: each live worker's record, kept alive by its heartbeat and gone when heartbeats stop.

A live worker whose last heartbeat is older than half its record's lifetime (`late`) has missed a heartbeat or
more: it is stuck, cut off or dying, and drops out of `live` unless one comes soon (/metrics counts it unhealthy).
A worker that heartbeats but says `healthy: false` (`broken`: its compile children keep failing before their work
starts, worker.health) claims no jobs; /readyz and /v1/workers name it with its `unhealthy_reason`.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys


class Registry:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def heartbeat(self, record: dict[str, Any], ttl_s: float) -> None:
        """Register or refresh a worker; its record expires `ttl_s` after the last heartbeat."""
        record = {**record, "heartbeat": time.time(), "ttl_s": ttl_s}
        pipe = self.r.pipeline()
        pipe.set(keys.worker(record["id"]), canonical_json(record), px=int(ttl_s * 1000))
        pipe.zadd(keys.WORKERS_INDEX, {record["id"]: record["heartbeat"]})
        pipe.execute()

    def remove(self, worker_id: str) -> None:
        self.r.delete(keys.worker(worker_id))
        self.r.zrem(keys.WORKERS_INDEX, worker_id)

    def live(self) -> list[dict[str, Any]]:
        """The records of the workers whose heartbeat is recent; prunes the index of the others."""
        ids = cast(list[str], self.r.zrange(keys.WORKERS_INDEX, 0, -1))
        if not ids:
            return []
        out: list[dict[str, Any]] = []
        gone: list[str] = []
        for wid, raw in zip(ids, cast(list[str | None], self.r.mget([keys.worker(i) for i in ids])), strict=True):
            (out.append(json.loads(raw)) if raw else gone.append(wid))
        if gone:
            self.r.zrem(keys.WORKERS_INDEX, *gone)
        return out


def late(record: dict[str, Any], now: float | None = None) -> bool:
    """The worker missed a heartbeat or more: its last one is older than half its record's lifetime."""
    ttl = float(record.get("ttl_s") or 0)
    return bool(ttl) and (now if now is not None else time.time()) - float(record.get("heartbeat") or 0) > ttl / 2


def broken(record: dict[str, Any]) -> bool:
    """The worker says it is unhealthy (worker.health): it heartbeats but claims no jobs."""
    return record.get("healthy") is False
