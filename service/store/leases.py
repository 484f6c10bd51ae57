"""Leases and the reaper.

A worker that reads a job from a queue stream holds it as a pending entry under its own consumer name: that is
its lease. The worker's heartbeat renews it (Store.renew_lease) every AOTC_HEARTBEAT_S; an entry idle for
AOTC_LEASE_S belongs to a worker that was lost (killed, crashed, cut off from Redis).

The reaper finds such entries with XAUTOCLAIM, which hands each one to exactly one caller, so any number of
reapers (every API process and every worker runs one) can run at once: a reaper that claimed an entry owns it
for another whole lease, long enough to requeue or fail the job. A job whose worker was lost is put back in line
(the failure is recorded as "worker lost"), or fails for good once it has used its attempts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from service.store import keys

if TYPE_CHECKING:
    from service.store import Store

log = logging.getLogger("aotc.reaper")


@dataclass(frozen=True)
class Lease:
    """A queue entry held by one consumer (a worker, or a reaper)."""

    stream: str
    msg_id: str
    holder: str


def worker_lost(job: dict[str, Any], lease_s: float) -> dict[str, Any]:
    worker = job.get("worker") or "unknown"
    stage = job.get("stage") or "running"
    return {
        "type": "WorkerLost",
        "message": f"worker lost: {worker} stopped renewing its lease during {stage} "
        f"(no heartbeat for {lease_s:g} s; killed, crashed or cut off from Redis)",
        "stage": stage,
        "retryable": True,
        "excerpt": "",
        "worker": worker,
    }


def reap(store: Store, stream: str, lease_s: float, count: int = 16) -> list[tuple[str, str]]:
    """Take back every lease on `stream` idle longer than `lease_s`; returns (job id, what happened)."""
    done: list[tuple[str, str]] = []
    cursor = "0-0"
    while True:
        cursor, claimed, *_ = store.r.xautoclaim(
            stream, keys.QUEUE_GROUP, keys.REAPER, int(lease_s * 1000), start_id=cursor, count=count
        )
        if any(msg_id is None for msg_id, _ in claimed):
            _ack_deleted(store, stream)
        for msg_id, fields in claimed:
            if msg_id is None:
                continue
            lease = Lease(stream, msg_id, keys.REAPER)
            job_id = (fields or {}).get("job")
            done.append((job_id or "?", _settle(store, lease, job_id, lease_s)))
        if cursor in ("0-0", b"0-0"):
            return done


def _settle(store: Store, lease: Lease, job_id: str | None, lease_s: float) -> str:
    job = store.get_job(job_id) if job_id else None
    if not job_id or job is None or job["state"] not in ("queued", "running"):
        store.drop_entry(lease)
        return "dropped"
    if job["state"] == "queued":
        # Read but never started (its reader died between the read and the start): no attempt was counted.
        store.requeue_job(job_id, lease, expect_state="queued")
        return "requeued"
    failure = worker_lost(job, lease_s)
    log.warning("job %s: %s", job_id, failure["message"])
    if store.cancel_requested(job_id):
        store.finish_job(job_id, "cancelled", lease=lease, expect_state="running", last_worker=job.get("worker"),
                         error={"type": "Cancelled", "message": "cancelled; its worker was lost meanwhile"})
        return "cancelled"
    return store.retry_or_fail(job, lease, failure)


def _ack_deleted(store: Store, stream: str) -> None:
    """Redis 6.2 returns entries deleted while pending as nil, without their ids: find and acknowledge them."""
    for p in store.r.xpending_range(stream, keys.QUEUE_GROUP, "-", "+", 1000, consumername=keys.REAPER):
        msg_id = p["message_id"]
        if not store.r.xrange(stream, msg_id, msg_id):
            store.r.xack(stream, keys.QUEUE_GROUP, msg_id)


def reap_all(store: Store, lease_s: float, streams: list[str] | None = None) -> list[tuple[str, str]]:
    """Reap every queue stream (or the given ones)."""
    done: list[tuple[str, str]] = []
    for stream in streams if streams is not None else sorted(cast(set[str], store.r.smembers(keys.QUEUES))):
        try:
            done += reap(store, stream, lease_s)
        except Exception as e:  # a stream without its group (e.g. Redis restarted without persistence)
            if "NOGROUP" not in str(e):
                raise
    return done


def forget_consumer(store: Store, streams: list[str], consumer: str) -> None:
    """Remove a worker's consumer name from its streams' group on a clean exit, where it holds nothing, so
    consumer lists do not grow with every worker ever started."""
    for stream in streams:
        if not store.r.xpending_range(stream, keys.QUEUE_GROUP, "-", "+", 1, consumername=consumer):
            store.r.xgroup_delconsumer(stream, keys.QUEUE_GROUP, consumer)


class Reaper:
    """Runs reap_all at most every `interval_s`; cheap to call from a loop."""

    def __init__(self, store: Store, lease_s: float, interval_s: float) -> None:
        self.store, self.lease_s, self.interval_s = store, lease_s, interval_s
        self._next = 0.0

    def maybe_run(self) -> list[tuple[str, str]]:
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self.interval_s
        done = reap_all(self.store, self.lease_s)
        for job_id, what in done:
            log.info("reaper: job %s %s", job_id, what)
        return done
