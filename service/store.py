"""The Redis store: models, blobs, jobs, the queue, artifacts and the worker registry.

Synchronous on purpose: the API runs these calls in its thread pool and the worker calls them directly, so
there is one implementation of every state transition. Key names come from service.keys only.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import redis

from service import keys

TERMINAL = ("succeeded", "failed", "cancelled")
_JSON_FIELDS = ("spec", "options", "toolchain", "factors", "error", "timings", "check")

# Single-flight submit: join the live job for this cache key, or create, index and enqueue a new one, atomically.
_SUBMIT = """
local existing = redis.call('GET', KEYS[1])
if existing then
  local st = redis.call('HGET', ARGV[3] .. existing, 'state')
  if st == 'queued' or st == 'running' then return {existing, 0} end
end
redis.call('HSET', KEYS[2], unpack(cjson.decode(ARGV[4])))
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('XADD', KEYS[4], '*', 'job', ARGV[1])
return {ARGV[1], 1}
"""

# Release the single-flight slot only if it still belongs to this job.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _dumps(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


class Store:
    def __init__(self, url: str, *, chunk_bytes: int = 64 * 2**20) -> None:
        self.url = url
        self.r = redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)
        self.raw = redis.Redis.from_url(url, decode_responses=False, health_check_interval=30)
        self.chunk_bytes = chunk_bytes
        self._submit = self.r.register_script(_SUBMIT)
        self._release = self.r.register_script(_RELEASE)

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
        manifest = {"size": size, "chunks": n, "sha256": digest.hexdigest()}
        self.r.hset(keys.blob(kind, blob_id), mapping=manifest)
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
            chunk = self.raw.get(keys.blob_chunk(kind, blob_id, n))
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
        ids = self.r.zrevrange(keys.MODELS_INDEX, 0, limit - 1)
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
        ids = self.r.zrange(keys.WORKERS_INDEX, 0, -1)
        if not ids:
            return []
        out, gone = [], []
        for wid, raw in zip(ids, self.r.mget([keys.worker(i) for i in ids])):
            (out.append(json.loads(raw)) if raw else gone.append(wid))
        if gone:
            self.r.zrem(keys.WORKERS_INDEX, *gone)
        return out

    # -- jobs and the queue -------------------------------------------------------------------------------------

    def ensure_group(self, target: str) -> None:
        try:
            self.r.xgroup_create(keys.queue(target), keys.QUEUE_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def submit_job(self, cache_key: str, target: str, fields: dict[str, Any]) -> tuple[str, bool]:
        """Create and enqueue a job for `cache_key`, or join the one already queued or running.

        Returns (job id, created). Atomic in Redis, so concurrent identical requests on any number of API
        processes make exactly one job.
        """
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
            **fields,
        }
        flat: list[str] = []
        for k, v in record.items():
            flat += [k, _dumps(v) if k in _JSON_FIELDS else str(v)]
        got, created = self._submit(
            keys=[keys.inflight(cache_key), keys.job(job_id), keys.JOBS_INDEX, keys.queue(target)],
            args=[job_id, now, keys.job(""), json.dumps(flat)],
        )
        if created:
            self.job_event(job_id, state="queued", stage="queued")
        return got, bool(created)

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        h = self.r.hgetall(keys.job(job_id))
        if not h:
            return None
        job: dict[str, Any] = dict(h)
        for k in _JSON_FIELDS:
            if k in job:
                job[k] = json.loads(job[k])
        for k in ("created", "started", "finished"):
            if k in job:
                job[k] = float(job[k])
        for k in ("attempts", "max_attempts"):
            if k in job:
                job[k] = int(job[k])
        job.pop("cancel", None)
        return job

    def update_job(self, job_id: str, **fields: Any) -> None:
        mapping = {k: _dumps(v) if k in _JSON_FIELDS else str(v) for k, v in fields.items() if v is not None}
        self.r.hset(keys.job(job_id), mapping=mapping)
        if "state" in fields or "stage" in fields:
            self.job_event(job_id, state=fields.get("state"), stage=fields.get("stage"))

    def job_event(self, job_id: str, **fields: Any) -> None:
        ev = {k: str(v) for k, v in fields.items() if v is not None}
        ev["ts"] = f"{time.time():.3f}"
        self.r.xadd(keys.job_events(job_id), ev, maxlen=500, approximate=True)

    def job_events(self, job_id: str, after: str = "0-0", block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
        res = self.r.xread({keys.job_events(job_id): after}, block=block_ms, count=100)
        return [(eid, ev) for _, entries in res for eid, ev in entries] if res else []

    def claim_attempt(self, job_id: str) -> int:
        """Count an attempt when a job is claimed, not when it ends: a job that crashes workers still stops."""
        return int(self.r.hincrby(keys.job(job_id), "attempts", 1))

    def finish_job(self, job_id: str, state: str, **fields: Any) -> None:
        assert state in TERMINAL
        job = self.get_job(job_id)
        self.update_job(job_id, state=state, stage=state, finished=time.time(), **fields)
        if job:
            self._release(keys=[keys.inflight(job["key"])], args=[job_id])
        if state == "failed":
            self.r.lpush(keys.DEADLETTER, job_id)
            self.r.ltrim(keys.DEADLETTER, 0, 9999)

    def request_cancel(self, job_id: str) -> None:
        self.r.hset(keys.job(job_id), "cancel", "1")

    def cancel_requested(self, job_id: str) -> bool:
        return self.r.hget(keys.job(job_id), "cancel") == "1"

    def list_jobs(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        ids = self.r.zrevrange(keys.JOBS_INDEX, 0, (limit * 4 if state else limit) - 1)
        jobs = [j for j in (self.get_job(i) for i in ids) if j and (state is None or j["state"] == state)]
        return jobs[:limit]

    def deadletter(self, limit: int = 50) -> list[dict[str, Any]]:
        return [j for j in (self.get_job(i) for i in self.r.lrange(keys.DEADLETTER, 0, limit - 1)) if j]

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
        ks = sorted(self.r.smembers(keys.artifacts_by_model(model_id)))
        if not ks:
            return []
        return [json.loads(v) for v in self.r.mget([keys.artifact(k) for k in ks]) if v]

    def list_artifacts(self, limit: int = 100) -> list[dict[str, Any]]:
        ks = self.r.zrevrange(keys.ARTIFACTS_INDEX, 0, limit - 1)
        return [a for a in (self.get_artifact(k) for k in ks) if a]
