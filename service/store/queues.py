"""The queue: one Redis stream per concrete target and priority, read by workers through one consumer group.

A stream entry names a job; the worker that reads an entry holds it (a Lease, service.store.leases) until a job
transition drops it. Which stream a worker reads first is the worker's policy (worker.queue).
"""

from __future__ import annotations

from typing import Any, cast

import redis

from service.store import keys
from service.store.leases import Lease

# What XREADGROUP returns on the decoded client (redis-py types it loosely): [(stream, [(msg id, fields)])].
_Read = list[tuple[str, list[tuple[str, dict[str, str] | None]]]]


class Queues:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def ensure(self, target: str) -> list[str]:
        """Create the streams of a target (one per priority, most urgent first) with their consumer group."""
        streams = [keys.queue(target, p) for p in keys.PRIORITIES]
        for stream in streams:
            try:
                self.r.xgroup_create(stream, keys.QUEUE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self.r.sadd(keys.QUEUES, *streams)
        return streams

    def all(self) -> list[str]:
        """Every queue stream ever created, so a reaper anywhere can find expired leases."""
        return sorted(cast(set[str], self.r.smembers(keys.QUEUES)))

    def read(self, consumer: str, streams: list[str], block_ms: int | None = None) -> list[tuple[Lease, str]]:
        """Read at most one new entry from each of `streams` as `consumer`, who now holds them; waits up to
        `block_ms` when all are empty (None: returns at once). Returns (lease, job id) in the order of `streams`."""
        res = cast(_Read, self.r.xreadgroup(keys.QUEUE_GROUP, consumer, {s: ">" for s in streams}, count=1,
                                            block=block_ms))
        got = [(Lease(stream, entries[0][0], consumer), (entries[0][1] or {}).get("job", ""))
               for stream, entries in res or [] if entries]
        return sorted(got, key=lambda g: streams.index(g[0].stream))

    def oldest_waiting_ms(self, stream: str) -> float | None:
        """When (ms since the epoch) the oldest entry not yet handed to any worker was queued; None if none."""
        try:
            groups = self.r.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream yet
            return None
        last = next((g["last-delivered-id"] for g in groups if g["name"] == keys.QUEUE_GROUP), None)
        if last is None:
            return None
        nxt = cast(list[tuple[str, Any]], self.r.xrange(stream, min=f"({last}", count=1))
        return float(nxt[0][0].split("-")[0]) if nxt else None

    def forget_consumer(self, consumer: str, streams: list[str]) -> None:
        """Remove a worker's consumer name from its streams' group on a clean exit, where it holds nothing, so
        consumer lists do not grow with every worker ever started."""
        for stream in streams:
            if not self.r.xpending_range(stream, keys.QUEUE_GROUP, "-", "+", 1, consumername=consumer):
                self.r.xgroup_delconsumer(stream, keys.QUEUE_GROUP, consumer)
