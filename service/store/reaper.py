"""The reaper: takes back the leases of lost workers and settles their jobs.

An entry idle longer than AOTC_LEASE_S belongs to a worker that was lost (killed, crashed, cut off from Redis).
The reaper takes such entries with XAUTOCLAIM (service.store.leases), which hands each one to exactly one caller,
so any number of reapers (every API process and every worker runs one) can run at once: a reaper that took an
entry owns it for another whole lease, long enough to requeue or fail the job. A job whose worker was lost is put
back in line (the failure is recorded as "worker lost"), or fails for good once it has used its attempts.

A lease's idle time is Redis's: the time since the entry was delivered or last renewed, by Redis's clock, and the
AOF keeps that instant, so it runs on while Redis is down. A worker cannot renew through a dead Redis, and after a
Redis restart every lease held through the outage would look expired at once, although its worker is compiling on.
So the reaper takes nothing until Redis has been up for a lease (`uptime_in_seconds`, whole seconds): every live
worker has renewed by then (a heartbeat is under half a lease), and an entry still idle belongs to a worker that is
gone.
"""

from __future__ import annotations

import logging
import time

import redis

from compiler.errors import Failure
from service.store import Store
from service.store.leases import Lease

log = logging.getLogger("aotc.reaper")


def reap(store: Store, stream: str, lease_s: float) -> list[tuple[str, str]]:
    """Take back every lease on `stream` idle longer than `lease_s`; returns (job id, what happened)."""
    return [(job_id or "?", _settle(store, lease, job_id, lease_s))
            for lease, job_id in store.leases.take_expired(stream, lease_s)]


def _settle(store: Store, lease: Lease, job_id: str | None, lease_s: float) -> str:
    job = store.jobs.get(job_id) if job_id else None
    if not job_id or job is None or job["state"] not in ("queued", "running"):
        store.leases.drop(lease)
        return "dropped"
    if job["state"] == "queued":
        # Read but never started (its reader died between the read and the start): no attempt was counted.
        store.jobs.requeue(job_id, lease, expect_state="queued")
        return "requeued"
    failure = Failure.worker_lost(job.get("worker") or "unknown", job.get("stage") or "running", lease_s)
    log.warning("job %s: %s", job_id, failure.message)
    if store.jobs.cancel_requested(job_id):
        store.jobs.finish(job_id, "cancelled", lease=lease, expect_state="running", last_worker=job.get("worker"),
                          error=Failure.cancelled("cancelled; its worker was lost meanwhile"))
        return "cancelled"
    return store.jobs.retry_or_fail(job, lease, failure)


def redis_uptime_s(store: Store) -> float | None:
    """How long this Redis has run; None when it will not say (INFO disabled, as some hosted Redis do)."""
    try:
        return float(store.r.info("server")["uptime_in_seconds"])
    except (redis.ResponseError, KeyError, ValueError):
        return None


def reap_all(store: Store, lease_s: float, streams: list[str] | None = None) -> list[tuple[str, str]]:
    """Reap every queue stream (or the given ones); nothing while Redis has been up for less than a lease."""
    uptime = redis_uptime_s(store)
    if uptime is not None and uptime + 1 < lease_s:  # Redis counts whole seconds
        return []
    done: list[tuple[str, str]] = []
    for stream in streams if streams is not None else store.queues.all():
        try:
            done += reap(store, stream, lease_s)
        except Exception as e:  # a stream without its group (e.g. Redis restarted without persistence)
            if "NOGROUP" not in str(e):
                raise
    return done


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
