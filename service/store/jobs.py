"""Jobs: their records, their event streams, and every transition of the state machine that service.store.scripts
draws. A worker or a reaper passes the lease it holds; a transition happens only while that lease is still held.

A job record is a Redis hash; the fields in JSON_FIELDS hold JSON, the rest plain strings. Failure records
(the `error` field, the `failures` list) come from compiler.errors.Failure. `namespace` is the namespace whose
request created the job (others join it); `get` leaves it out, since every view of a job shows `get`'s record and a
joining namespace must not learn who asked first: the worker reads it with `namespace_of`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from compiler.errors import Failure
from service.store import keys, scripts
from service.store.leases import Lease
from service.store.queues import Queues

TERMINAL = ("succeeded", "failed", "cancelled")
JSON_FIELDS = ("spec", "options", "toolchain", "factors", "error", "timings", "check", "failures")


def _flat(fields: dict[str, Any]) -> str:
    """Record fields as the scripts take them: JSON [field, value, ...], skipping None."""
    out: list[str] = []
    for k, v in fields.items():
        if v is not None:
            out += [k, canonical_json(v) if k in JSON_FIELDS else str(v)]
    return json.dumps(out)


def _ts() -> str:
    return f"{time.time():.3f}"


class Jobs:
    def __init__(self, r: redis.Redis, queues: Queues) -> None:
        self.r = r
        self.queues = queues
        self._submit = r.register_script(scripts.SUBMIT)
        self._start = r.register_script(scripts.START)
        self._finish = r.register_script(scripts.FINISH)
        self._requeue = r.register_script(scripts.REQUEUE)
        self._cancel = r.register_script(scripts.CANCEL)
        self._stage = r.register_script(scripts.STAGE)
        self._promote = r.register_script(scripts.PROMOTE)

    # -- records and events --------------------------------------------------------------------------------------

    def submit(self, cache_key: str, target: str, fields: dict[str, Any],
               priority: str = keys.PRIORITIES[0]) -> tuple[str, bool]:
        """Create and enqueue a job for `cache_key`, or join the one already queued or running.

        Returns (job id, created). Atomic in Redis, so concurrent identical requests on any number of API
        processes make exactly one job. An interactive request that joins a queued batch job moves it to the
        interactive queue; otherwise a request that joins a job keeps that job's priority.
        """
        if priority not in keys.PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}")
        self.queues.ensure(target)
        job_id = uuid.uuid4().hex
        now = time.time()
        record = {
            "id": job_id,
            "state": "queued",
            "stage": "queued",
            "key": cache_key,
            "target": target,
            "created": now,
            "attempts": 0,
            "priority": priority,
            **fields,
        }
        flat: list[str] = []
        for k, v in record.items():
            flat += [k, canonical_json(v) if k in JSON_FIELDS else str(v)]
        got, created = self._submit(
            keys=[keys.inflight(cache_key), keys.job(job_id), keys.JOBS_INDEX, keys.queue(target, priority),
                  keys.job_events(job_id)],
            args=[job_id, f"{now:.3f}", keys.job(""), json.dumps(flat), priority],
        )
        return got, bool(created)

    def get(self, job_id: str) -> dict[str, Any] | None:
        h = self.r.hgetall(keys.job(job_id))
        if not h:
            return None
        job: dict[str, Any] = dict(cast(dict[str, str], h))
        for k in JSON_FIELDS:
            if k in job:
                job[k] = json.loads(job[k])
        for k in ("created", "started", "finished", "not_before"):
            if k in job:
                job[k] = float(job[k])
        for k in ("attempts", "attempt", "max_attempts"):
            if k in job:
                job[k] = int(job[k])
        job["cancel_requested"] = job.pop("cancel", None) == "1"
        job.pop("namespace", None)  # the creator's: never in a view (the module's docstring)
        return job

    def namespace_of(self, job_id: str) -> str | None:
        """The namespace whose request created the job; None for a job queued before jobs recorded it."""
        return cast(str | None, self.r.hget(keys.job(job_id), "namespace"))

    def recent(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        """The newest jobs first (only those in `state`, among the newest few times `limit`, when given)."""
        ids = cast(list[str], self.r.zrevrange(keys.JOBS_INDEX, 0, (limit * 4 if state else limit) - 1))
        jobs = [j for j in (self.get(i) for i in ids) if j and (state is None or j["state"] == state)]
        return jobs[:limit]

    def deadletter(self, limit: int = 50) -> list[dict[str, Any]]:
        """Jobs that failed for good, the latest first."""
        ids = cast(list[str], self.r.lrange(keys.DEADLETTER, 0, limit - 1))
        return [j for j in (self.get(i) for i in ids) if j]

    def events(self, job_id: str, after: str = "0-0", block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
        res = cast(list[tuple[str, list[tuple[str, dict[str, str]]]]],
                   self.r.xread({keys.job_events(job_id): after}, block=block_ms, count=100))
        return [(eid, ev) for _, entries in res for eid, ev in entries] if res else []

    def cancel_requested(self, job_id: str) -> bool:
        return self.r.hget(keys.job(job_id), "cancel") == "1"

    # -- transitions ---------------------------------------------------------------------------------------------

    def start(self, job_id: str, lease: Lease) -> tuple[str, int]:
        """queued -> running, counting the attempt now (at claim, not at the end: a job that kills its workers
        still stops at max_attempts). Returns ('running', attempt), ('cancel', 0) for a job cancelled while
        queued, or (why, 0) when the entry was stale and has been dropped."""
        outcome, attempt = self._start(
            keys=[keys.job(job_id), keys.job_events(job_id), lease.stream],
            args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder, _ts()],
        )
        return str(outcome), int(attempt)

    def finish(self, job_id: str, state: str, *, lease: Lease | None = None, expect_state: str | None = None,
               cache_key: str | None = None, error: Failure | None = None, **fields: Any) -> bool:
        """End a job: record it, release its single-flight slot, dead-letter a failure, drop its queue entry.

        With a lease, only while the lease is held. `cache_key` saves a read when the caller has the record.
        Returns False when it did nothing (the job had already ended, was not in `expect_state`, or the lease was
        lost)."""
        assert state in TERMINAL
        job_key = cache_key or cast(str | None, self.r.hget(keys.job(job_id), "key")) or ""
        msg_id = lease.msg_id if lease else (self.r.hget(keys.job(job_id), "msg") or "")
        stream = lease.stream if lease else self._stream_of(job_id)
        event: list[str] = []
        if error is not None:
            fields["error"] = error.to_json()
            if error.message:
                event = ["reason", error.message[:500]]
        done = self._finish(
            keys=[keys.job(job_id), keys.job_events(job_id), stream, keys.inflight(job_key), keys.DEADLETTER],
            args=[keys.QUEUE_GROUP, msg_id, lease.holder if lease else "", expect_state or "", state, _ts(), job_id,
                  _flat(fields), json.dumps(event)],
        )
        return int(done) == 1

    def requeue(self, job_id: str, lease: Lease, *, refund: bool = False, expect_state: str | None = None,
                reason: str = "", delay_s: float = 0.0, **fields: Any) -> bool:
        """Put a held job back at the tail of its stream; `refund` gives back the attempt it was charged. With
        `delay_s`, no worker gets it before that many seconds have passed (it waits in `backoff`: promote_due)."""
        done = self._requeue(
            keys=[keys.job(job_id), keys.job_events(job_id), lease.stream, keys.BACKOFF],
            args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder, expect_state or "", "1" if refund else "0", _ts(),
                  job_id, _flat(fields), json.dumps(["reason", reason[:500]] if reason else []),
                  f"{max(delay_s, 0.0):.3f}"],
        )
        return int(done) == 1

    def promote_due(self, limit: int = 100) -> int:
        """Put the jobs whose retry backoff is over back in their streams (at most `limit`); returns how many.
        Workers call it before they read the queue."""
        queue_prefix = keys.queue("", "")[:-1]  # the script appends "{target}:{priority}", as keys.queue does
        return int(self._promote(keys=[keys.BACKOFF], args=[keys.job(""), queue_prefix, limit]))

    def retry_or_fail(self, job: dict[str, Any], lease: Lease, failure: Failure, *, delay_s: float = 0.0) -> str:
        """After a failed attempt: requeue when the failure is retryable and attempts are left (no worker takes it
        before `delay_s`, its backoff), else fail the job for good with the reason. `job` is the record as the
        attempt saw it. Returns 'requeued', 'failed' or 'stale' (the lease was lost meanwhile, so someone else
        decides)."""
        attempt = int(job.get("attempt") or job.get("attempts") or 0)
        max_attempts = int(job.get("max_attempts", 3))
        summary = {"type": failure.type, "message": failure.message, "stage": failure.stage}
        failures = [*(job.get("failures") or []), {"attempt": attempt, "worker": job.get("worker"), **summary}]
        worker = job.get("worker")
        if failure.retryable and attempt < max_attempts:
            ok = self.requeue(job["id"], lease, expect_state="running", reason=failure.message, failures=failures,
                              last_worker=worker, delay_s=delay_s)
            return "requeued" if ok else "stale"
        final = replace(failure, extra={**failure.extra, "attempts": attempt, "failures": failures})
        if failure.retryable:
            final = replace(final, message=f"{failure.message} (attempt {attempt} of {max_attempts}; no attempts left)")
        ok = self.finish(job["id"], "failed", lease=lease, expect_state="running", cache_key=job.get("key"),
                         error=final, failures=failures, last_worker=worker)
        return "failed" if ok else "stale"

    def set_stage(self, job_id: str, worker: str, stage: str) -> bool:
        """A stage change, recorded only while `worker` runs the job."""
        return int(self._stage(keys=[keys.job(job_id), keys.job_events(job_id)], args=[worker, stage, _ts()])) == 1

    def cancel(self, job_id: str) -> str | None:
        """Cancel a job: a queued one ends now; a running one is flagged and its worker kills the compile within
        seconds. Returns the job's state after the call (None: no such job)."""
        st = self._cancel(keys=[keys.job(job_id)])
        if st is None:
            return None
        if st == "queued":
            if self.finish(job_id, "cancelled", expect_state="queued",
                           error=Failure.cancelled("cancelled before it started")):
                return "cancelled"
            st = self.r.hget(keys.job(job_id), "state")  # a worker started it meanwhile: it sees the flag
        return str(st)

    def _stream_of(self, job_id: str) -> str:
        target, priority = cast(list[str | None], self.r.hmget(keys.job(job_id), ["target", "priority"]))
        return keys.queue(target or "", priority or keys.PRIORITIES[0])
