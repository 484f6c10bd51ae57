"""The Redis store: models, blobs, jobs, the queue, artifacts and the worker registry.

Synchronous on purpose: the API runs these calls in its thread pool and the worker calls them directly, so
there is one implementation of every state transition. Key names come from service.store.keys only.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import redis

from compiler.cachekey import canonical_json
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from service.store import keys, scripts as jobstate
from service.store.leases import Lease

TERMINAL = ("succeeded", "failed", "cancelled")
_JSON_FIELDS = ("spec", "options", "toolchain", "factors", "error", "timings", "check", "failures")

# Single-flight submit: join the live job for this cache key, or create, index and enqueue a new one, atomically.
_SUBMIT = """
local existing = redis.call('GET', KEYS[1])
if existing then
  local job = ARGV[3] .. existing
  local st = redis.call('HGET', job, 'state')
  if st == 'queued' and ARGV[5] == 'interactive' and redis.call('HGET', job, 'priority') == 'batch' then
    -- An interactive request joins a batch job still in line: the job moves to the interactive queue. Its batch
    -- entry stays (it may already be in a worker's hands); whichever entry is started first runs the job, and
    -- START drops the other as a duplicate.
    local id = redis.call('XADD', KEYS[4], '*', 'job', existing)
    redis.call('HSET', job, 'priority', 'interactive', 'msg', id)
    redis.call('XADD', job .. ':events', 'MAXLEN', '~', 500, '*', 'state', 'queued', 'stage', 'queued',
               'priority', 'interactive', 'ts', ARGV[2])
    return {existing, 0}
  end
  if st == 'queued' or st == 'running' then return {existing, 0} end
end
redis.call('HSET', KEYS[2], unpack(cjson.decode(ARGV[4])))
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], 'msg', redis.call('XADD', KEYS[4], '*', 'job', ARGV[1]))
redis.call('XADD', KEYS[5], 'MAXLEN', '~', 500, '*', 'state', 'queued', 'stage', 'queued', 'ts', ARGV[2])
return {ARGV[1], 1}
"""

_dumps = canonical_json


def _flat(fields: dict[str, Any]) -> str:
    out: list[str] = []
    for k, v in fields.items():
        if v is not None:
            out += [k, _dumps(v) if k in _JSON_FIELDS else str(v)]
    return json.dumps(out)


class Store:
    def __init__(self, url: str, *, chunk_bytes: int = 64 * 2**20) -> None:
        self.url = url
        # A few quick retries ride over a blip; a Redis that stays down fails a call within about a second, so
        # the API answers 503 promptly and the worker's own backoff takes over. Reads block at most a few seconds
        # (queue polls, SSE), well under the socket timeout.
        conn = {"health_check_interval": 30, "socket_connect_timeout": 2.0, "socket_timeout": 10.0,
                "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3)}
        # redis-py types every reply as `bytes | str` whatever decode_responses says: replies of `r` are str,
        # those of `raw` bytes, and the casts below say so.
        self.r = redis.Redis.from_url(url, decode_responses=True, **conn)
        self.raw = redis.Redis.from_url(url, decode_responses=False, **conn)
        self.chunk_bytes = chunk_bytes
        self._submit = self.r.register_script(_SUBMIT)
        self._start = self.r.register_script(jobstate.START)
        self._finish = self.r.register_script(jobstate.FINISH)
        self._requeue = self.r.register_script(jobstate.REQUEUE)
        self._renew = self.r.register_script(jobstate.RENEW)
        self._cancel = self.r.register_script(jobstate.CANCEL)
        self._stage = self.r.register_script(jobstate.STAGE)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()
        self.raw.close()

    # -- blobs ---------------------------------------------------------------------------------------------

    def put_blob(self, kind: str, blob_id: str, src: BinaryIO) -> dict[str, Any]:
        """Copy a file into Redis in chunks; the manifest is written last, so a half-written blob never shows."""
        digest, size, n = hashlib.sha256(), 0, 0
        while True:
            chunk = src.read(self.chunk_bytes)
            if not chunk:
                break
            self.raw.set(keys.blob_chunk(kind, blob_id, n), chunk)
            digest.update(chunk)
            size += len(chunk)
            n += 1
        manifest: dict[str, Any] = {"size": size, "chunks": n, "sha256": digest.hexdigest()}
        self.r.hset(keys.blob(kind, blob_id), mapping=cast(dict[Any, Any], manifest))
        return manifest

    def blob_manifest(self, kind: str, blob_id: str) -> dict[str, Any] | None:
        m = self.r.hgetall(keys.blob(kind, blob_id))
        if not m:
            return None
        return {"size": int(m["size"]), "chunks": int(m["chunks"]), "sha256": m["sha256"]}

    def iter_blob(self, kind: str, blob_id: str) -> Iterator[bytes]:
        m = self.blob_manifest(kind, blob_id)
        if m is None:
            raise KeyError(blob_id)
        for n in range(m["chunks"]):
            chunk = cast(bytes | None, self.raw.get(keys.blob_chunk(kind, blob_id, n)))
            if chunk is None:
                raise KeyError(f"{kind}:{blob_id} chunk {n} is missing")
            yield chunk

    def blob_to_file(self, kind: str, blob_id: str, dest: Path) -> str:
        """Write a blob to `dest` and return its sha256, checked against the manifest."""
        m = self.blob_manifest(kind, blob_id)
        if m is None:
            raise KeyError(blob_id)
        digest = hashlib.sha256()
        with open(dest, "wb") as f:
            for chunk in self.iter_blob(kind, blob_id):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != m["sha256"]:
            raise ValueError(f"blob {kind}:{blob_id} is corrupt: sha256 {digest.hexdigest()} != {m['sha256']}")
        return m["sha256"]

    # -- models ----------------------------------------------------------------------------------------------

    def put_model(self, record: dict[str, Any]) -> None:
        self.r.set(keys.model(record["id"]), _dumps(record))
        self.r.zadd(keys.MODELS_INDEX, {record["id"]: record["created"]})

    def get_model(self, model_id: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.model(model_id))
        return json.loads(raw) if raw else None

    def find_models(self, prefix: str, limit: int = 2) -> list[str]:
        """Model ids starting with `prefix` (at most `limit`), so people can use the short ids the CLI prints."""
        if len(prefix) == 64:
            return [prefix] if self.r.exists(keys.model(prefix)) else []
        found: list[str] = []
        for member, _ in self.r.zscan_iter(keys.MODELS_INDEX, match=f"{prefix}*"):
            found.append(member)
            if len(found) >= limit:
                break
        return found

    def list_models(self, limit: int = 100) -> list[dict[str, Any]]:
        ids = cast(list[str], self.r.zrevrange(keys.MODELS_INDEX, 0, limit - 1))
        return [m for m in (self.get_model(i) for i in ids) if m]

    # -- workers ----------------------------------------------------------------------------------------------

    def heartbeat_worker(self, record: dict[str, Any], ttl_s: float) -> None:
        record = {**record, "heartbeat": time.time()}
        pipe = self.r.pipeline()
        pipe.set(keys.worker(record["id"]), _dumps(record), px=int(ttl_s * 1000))
        pipe.zadd(keys.WORKERS_INDEX, {record["id"]: record["heartbeat"]})
        pipe.execute()

    def remove_worker(self, worker_id: str) -> None:
        self.r.delete(keys.worker(worker_id))
        self.r.zrem(keys.WORKERS_INDEX, worker_id)

    def live_workers(self) -> list[dict[str, Any]]:
        ids = cast(list[str], self.r.zrange(keys.WORKERS_INDEX, 0, -1))
        if not ids:
            return []
        out: list[dict[str, Any]] = []
        gone: list[str] = []
        for wid, raw in zip(ids, cast(list[str | None], self.r.mget([keys.worker(i) for i in ids]))):
            (out.append(json.loads(raw)) if raw else gone.append(wid))
        if gone:
            self.r.zrem(keys.WORKERS_INDEX, *gone)
        return out

    # -- jobs and the queue -------------------------------------------------------------------------------------

    def ensure_group(self, target: str) -> list[str]:
        """Create the queue streams of a target (one per priority) with their consumer group; returns them."""
        streams = [keys.queue(target, p) for p in keys.PRIORITIES]
        for stream in streams:
            try:
                self.r.xgroup_create(stream, keys.QUEUE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
        self.r.sadd(keys.QUEUES, *streams)
        return streams

    def submit_job(self, cache_key: str, target: str, fields: dict[str, Any],
                   priority: str = keys.PRIORITIES[0]) -> tuple[str, bool]:
        """Create and enqueue a job for `cache_key`, or join the one already queued or running.

        Returns (job id, created). Atomic in Redis, so concurrent identical requests on any number of API
        processes make exactly one job. An interactive request that joins a queued batch job moves it to the
        interactive queue; otherwise a request that joins a job keeps that job's priority.
        """
        if priority not in keys.PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}")
        self.ensure_group(target)
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
            flat += [k, _dumps(v) if k in _JSON_FIELDS else str(v)]
        got, created = self._submit(
            keys=[keys.inflight(cache_key), keys.job(job_id), keys.JOBS_INDEX, keys.queue(target, priority),
                  keys.job_events(job_id)],
            args=[job_id, f"{now:.3f}", keys.job(""), json.dumps(flat), priority],
        )
        return got, bool(created)

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        h = self.r.hgetall(keys.job(job_id))
        if not h:
            return None
        job: dict[str, Any] = dict(cast(dict[str, str], h))
        for k in _JSON_FIELDS:
            if k in job:
                job[k] = json.loads(job[k])
        for k in ("created", "started", "finished"):
            if k in job:
                job[k] = float(job[k])
        for k in ("attempts", "attempt", "max_attempts"):
            if k in job:
                job[k] = int(job[k])
        job["cancel_requested"] = job.pop("cancel", None) == "1"
        return job

    def update_job(self, job_id: str, **fields: Any) -> None:
        mapping = {k: _dumps(v) if k in _JSON_FIELDS else str(v) for k, v in fields.items() if v is not None}
        self.r.hset(keys.job(job_id), mapping=cast(dict[Any, Any], mapping))
        if "state" in fields or "stage" in fields:
            self.job_event(job_id, state=fields.get("state"), stage=fields.get("stage"))

    def job_event(self, job_id: str, **fields: Any) -> None:
        ev = {k: str(v) for k, v in fields.items() if v is not None}
        ev["ts"] = f"{time.time():.3f}"
        self.r.xadd(keys.job_events(job_id), cast(dict[Any, Any], ev), maxlen=500, approximate=True)

    def job_events(self, job_id: str, after: str = "0-0", block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
        res = cast(list[tuple[str, list[tuple[str, dict[str, str]]]]],
                   self.r.xread({keys.job_events(job_id): after}, block=block_ms, count=100))
        return [(eid, ev) for _, entries in res for eid, ev in entries] if res else []

    # State transitions (service.store.scripts draws the machine). A worker or a reaper passes the lease it holds;
    # the transition happens only while that lease is still held.

    def start_job(self, job_id: str, lease: Lease) -> tuple[str, int]:
        """queued -> running, counting the attempt now (at claim, not at the end: a job that kills its workers
        still stops at max_attempts). Returns ('running', attempt), ('cancel', 0) for a job cancelled while
        queued, or (why, 0) when the entry was stale and has been dropped."""
        outcome, attempt = self._start(
            keys=[keys.job(job_id), keys.job_events(job_id), lease.stream],
            args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder, f"{time.time():.3f}"],
        )
        return str(outcome), int(attempt)

    def finish_job(self, job_id: str, state: str, *, lease: Lease | None = None, expect_state: str | None = None,
                   **fields: Any) -> bool:
        """End a job: record it, release its single-flight slot, dead-letter a failure, drop its queue entry.

        With a lease, only while the lease is held. Returns False when it did nothing (the job had already
        ended, was not in `expect_state`, or the lease was lost)."""
        assert state in TERMINAL
        job_key = fields.pop("_cache_key", None) or cast(str | None, self.r.hget(keys.job(job_id), "key")) or ""
        msg_id = lease.msg_id if lease else (self.r.hget(keys.job(job_id), "msg") or "")
        stream = lease.stream if lease else self._stream_of(job_id)
        event: list[str] = []
        if isinstance(fields.get("error"), dict) and fields["error"].get("message"):
            event = ["reason", str(fields["error"]["message"])[:500]]
        done = self._finish(
            keys=[keys.job(job_id), keys.job_events(job_id), stream, keys.inflight(job_key), keys.DEADLETTER],
            args=[keys.QUEUE_GROUP, msg_id, lease.holder if lease else "", expect_state or "", state,
                  f"{time.time():.3f}", job_id, _flat(fields), json.dumps(event)],
        )
        return int(done) == 1

    def requeue_job(self, job_id: str, lease: Lease, *, refund: bool = False, expect_state: str | None = None,
                    reason: str = "", **fields: Any) -> bool:
        """Put a held job back at the tail of its stream; `refund` gives back the attempt it was charged."""
        done = self._requeue(
            keys=[keys.job(job_id), keys.job_events(job_id), lease.stream],
            args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder, expect_state or "", "1" if refund else "0",
                  f"{time.time():.3f}", job_id, _flat(fields), json.dumps(["reason", reason[:500]] if reason else [])],
        )
        return int(done) == 1

    def retry_or_fail(self, job: dict[str, Any], lease: Lease, failure: dict[str, Any]) -> str:
        """After a failed attempt: requeue when the failure is retryable and attempts are left, else fail the job
        for good with the reason. `job` is the record as the attempt saw it. Returns 'requeued', 'failed' or
        'stale' (the lease was lost meanwhile, so someone else decides)."""
        attempt = int(job.get("attempt") or job.get("attempts") or 0)
        max_attempts = int(job.get("max_attempts", 3))
        summary = {k: failure.get(k) for k in ("type", "message", "stage")}
        failures = [*(job.get("failures") or []), {"attempt": attempt, "worker": job.get("worker"), **summary}]
        worker = job.get("worker")
        if failure.get("retryable") and attempt < max_attempts:
            ok = self.requeue_job(job["id"], lease, expect_state="running", reason=failure.get("message", ""),
                                  failures=failures, last_worker=worker)
            return "requeued" if ok else "stale"
        final = {**failure, "attempts": attempt, "failures": failures}
        if failure.get("retryable"):
            final["message"] = f"{failure.get('message')} (attempt {attempt} of {max_attempts}; no attempts left)"
        ok = self.finish_job(job["id"], "failed", lease=lease, expect_state="running", _cache_key=job.get("key"),
                             error=final, failures=failures, last_worker=worker)
        return "failed" if ok else "stale"

    def renew_lease(self, lease: Lease) -> bool:
        """Reset a held entry's idle time. False: the lease is gone (a reaper took it, or the job ended)."""
        return int(self._renew(keys=[lease.stream], args=[keys.QUEUE_GROUP, lease.msg_id, lease.holder])) == 1

    def drop_entry(self, lease: Lease) -> None:
        pipe = self.r.pipeline()
        pipe.xack(lease.stream, keys.QUEUE_GROUP, lease.msg_id)
        pipe.xdel(lease.stream, lease.msg_id)
        pipe.execute()

    def set_stage(self, job_id: str, worker: str, stage: str) -> bool:
        """A stage change, recorded only while `worker` runs the job."""
        return int(self._stage(keys=[keys.job(job_id), keys.job_events(job_id)],
                               args=[worker, stage, f"{time.time():.3f}"])) == 1

    def _stream_of(self, job_id: str) -> str:
        target, priority = cast(list[str | None], self.r.hmget(keys.job(job_id), ["target", "priority"]))
        return keys.queue(target or "", priority or keys.PRIORITIES[0])

    def request_cancel(self, job_id: str) -> str | None:
        """Cancel a job: a queued one ends now; a running one is flagged and its worker kills the compile within
        seconds. Returns the job's state after the call (None: no such job)."""
        st = self._cancel(keys=[keys.job(job_id)])
        if st is None:
            return None
        if st == "queued":
            if self.finish_job(job_id, "cancelled", expect_state="queued",
                               error={"type": "Cancelled", "message": "cancelled before it started"}):
                return "cancelled"
            st = self.r.hget(keys.job(job_id), "state")  # a worker started it meanwhile: it sees the flag
        return str(st)

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

    def cancel_requested(self, job_id: str) -> bool:
        return self.r.hget(keys.job(job_id), "cancel") == "1"

    def list_jobs(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        ids = cast(list[str], self.r.zrevrange(keys.JOBS_INDEX, 0, (limit * 4 if state else limit) - 1))
        jobs = [j for j in (self.get_job(i) for i in ids) if j and (state is None or j["state"] == state)]
        return jobs[:limit]

    def deadletter(self, limit: int = 50) -> list[dict[str, Any]]:
        ids = cast(list[str], self.r.lrange(keys.DEADLETTER, 0, limit - 1))
        return [j for j in (self.get_job(i) for i in ids) if j]

    def compile_caches(self) -> dict[str, Any]:
        """What workers share to compile faster: max-autotune timings per (target, system), and how many entries
        Inductor's remote caches hold. Counting scans the keyspace (SCAN, never KEYS)."""
        prefix = keys.gemm_tuning("", "")[: -len(":")]
        gemm = []
        for k in sorted(self.r.scan_iter(match=keys.GEMM_TUNING_PATTERN, count=1000)):
            name = k.decode() if isinstance(k, bytes) else str(k)
            target, _, system = name[len(prefix):].rpartition(":")
            gemm.append({"target": target, "system": system, "entries": int(self.r.hlen(name))})
        inductor = sum(1 for _ in self.r.scan_iter(match=keys.INDUCTOR_PATTERN, count=1000))
        return {"gemm_timings": gemm, "inductor_entries": inductor}

    def clear_compile_caches(self) -> dict[str, int]:
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

    def count_compiles(self) -> int:
        return int(self.r.get(keys.COMPILES) or 0)

    def incr_compiles(self) -> int:
        return int(self.r.incr(keys.COMPILES))

    # -- artifacts ---------------------------------------------------------------------------------------------

    def put_artifact(self, record: dict[str, Any], package: Path | None, *, report: dict[str, Any] | None = None,
                     sources: Path | None = None) -> dict[str, Any]:
        """Publish an artifact: blobs first, record last, so a reader never sees a record without its bytes.

        `report` (the stage report) and `sources` (a zip of the graphs and generated code) are stored before the
        record too. `package=None` publishes a report-only record (mode=training): "package" is false and there
        are no bytes to pull. Idempotent: a job that ran twice finds its own result and stores nothing again.
        """
        key = record["key"]
        existing = self.get_artifact(key)
        if existing:
            return existing
        if report is not None:
            self.r.set(keys.report(key), _dumps(report))
        if sources is not None:
            with open(sources, "rb") as f:
                self.put_blob("sources", key, f)
        if package is None:
            record = {**record, "package": False, "size": 0, "sha256": None, "created": time.time()}
        else:
            with open(package, "rb") as f:
                manifest = self.put_blob("artifact", key, f)
            record = {**record, "package": True, "size": manifest["size"], "sha256": manifest["sha256"],
                      "created": time.time()}
        pipe = self.r.pipeline()
        pipe.set(keys.artifact(key), _dumps(record), nx=True)
        pipe.zadd(keys.ARTIFACTS_INDEX, {key: record["created"]})
        pipe.sadd(keys.artifacts_by_model(record["factors"]["model"]), key)
        pipe.execute()
        return self.get_artifact(key) or record

    def get_artifact(self, key: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.artifact(key))
        return json.loads(raw) if raw else None

    def get_report(self, key: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.report(key))
        return json.loads(raw) if raw else None

    def read_blob(self, kind: str, blob_id: str, limit: int) -> bytes | None:
        """A whole blob in memory (None when absent); ValueError when it is over `limit` bytes."""
        m = self.blob_manifest(kind, blob_id)
        if m is None:
            return None
        if m["size"] > limit:
            raise ValueError(f"blob {kind}:{blob_id} is {m['size']} bytes, over the {limit}-byte limit")
        return b"".join(self.iter_blob(kind, blob_id))

    def artifacts_for_model(self, model_id: str) -> list[dict[str, Any]]:
        ks = sorted(cast(set[str], self.r.smembers(keys.artifacts_by_model(model_id))))
        if not ks:
            return []
        return [json.loads(v) for v in self.r.mget([keys.artifact(k) for k in ks]) if v]

    def list_artifacts(self, limit: int = 100) -> list[dict[str, Any]]:
        ks = cast(list[str], self.r.zrevrange(keys.ARTIFACTS_INDEX, 0, limit - 1))
        return [a for a in (self.get_artifact(k) for k in ks) if a]
