"""Leases: how a worker holds a job.

A worker that reads a job from a queue stream (service.store.queues) holds it as a pending entry under its own
consumer name: that is its lease. The worker's heartbeat renews it every AOTC_HEARTBEAT_S, and only while the entry
is still its own. An entry idle for AOTC_LEASE_S belongs to a worker that was lost (killed, crashed, cut off from
Redis); the reaper (service.store.reaper) takes it back with `take_expired`. Every job transition a lease holder
makes checks the lease inside its script (service.store.scripts).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from service.store import keys, scripts


@dataclass(frozen=True)
class Lease:
    """A queue entry held by one consumer (a worker, or a reaper)."""

    stream: str
    msg_id: str
    holder: str


class Leases:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._renew = r.register_script(scripts.RENEW)

    def renew(self, lease: Lease) -> bool:
        """Reset a held entry's idle time. False: the lease is gone (a reaper took it, or the job ended)."""
        return int(self._renew(keys=[lease.stream], args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder])) == 1

    def drop(self, lease: Lease) -> None:
        """Acknowledge and delete a held entry that no job needs (its job is gone or has ended)."""
        pipe = self.r.pipeline()
        pipe.xack(lease.stream, keys.QUEUE_GROUP, lease.msg_id)
        pipe.xdel(lease.stream, lease.msg_id)
        pipe.execute()

    def take_expired(self, stream: str, idle_s: float, count: int = 16) -> Iterator[tuple[Lease, str | None]]:
        """Take every entry of `stream` idle longer than `idle_s`, as the reaper; yields (lease, job id).

        XAUTOCLAIM hands each entry to exactly one caller, so any number of reapers can run at once; the taker holds
        the entry for another whole lease, long enough to settle its job."""
        cursor: Any = "0-0"
        while True:
            cursor, claimed, *_ = self.r.xautoclaim(
                stream, keys.QUEUE_GROUP, keys.REAPER, int(idle_s * 1000), start_id=cursor, count=count
            )
            if any(msg_id is None for msg_id, _ in claimed):
                self._ack_deleted(stream)
            for msg_id, fields in claimed:
                if msg_id is not None:
                    yield Lease(stream, msg_id, keys.REAPER), (fields or {}).get("job")
            if cursor in ("0-0", b"0-0"):
                return

    def _ack_deleted(self, stream: str) -> None:
        """Redis 6.2 returns entries deleted while pending as nil, without their ids: find and acknowledge them."""
        for p in self.r.xpending_range(stream, keys.QUEUE_GROUP, "-", "+", 1000, consumername=keys.REAPER):
            msg_id = p["message_id"]
            if not self.r.xrange(stream, msg_id, msg_id):
                self.r.xack(stream, keys.QUEUE_GROUP, msg_id)
