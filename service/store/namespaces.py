"""Namespaces: which models and jobs each namespace may see, and what it may still spend.

Bytes are stored by content, once: two namespaces that upload the same file share one model record, one blob,
one compile and one package. What belongs to a namespace is an index beside them:

    ns:{ns}:models      zset  model id -> when this namespace uploaded it
    ns:{ns}:model-ids   zset  the same ids at score 0, for short ids (a lex range, as models:ids)
    ns:{ns}:names       hash  model id -> the name this namespace gave it (another's name never shows)
    ns:{ns}:jobs        zset  job id -> when this namespace asked for it
    ns:{ns}:active      set   job ids this namespace may have queued or running; ended ones are pruned when
                              the quota is counted
    ns:{ns}:quota       hash  an admin's quotas for it (max_jobs, max_stored_gb); unset: the defaults
    ns:{ns}:reserved    zset  job slots compile requests have been admitted for and have not filled yet
    job:{id}:namespaces set   the namespaces that share the job

An artifact belongs to every namespace that holds its model: it is a function of the model's bytes, the shapes,
the target and the toolchain, all of which that namespace already has.

The job quota is admitted atomically (`admit`, the ADMIT script): a compile request reserves the jobs it may add
before it submits them, and each `add_job` fills one reservation in the same transaction that counts the job, so
concurrent requests never pass max_jobs together. A reservation left by an API process that died lapses by itself.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, cast

import redis

from service.store import keys, scripts
from service.store.models import ID_LEN, lex_range

GB = 2**30
ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class Quota:
    max_jobs: int  # queued plus running
    max_stored_bytes: int  # models uploaded plus artifacts of those models

    def to_json(self) -> dict[str, Any]:
        return {"max_jobs": self.max_jobs, "max_stored_gb": round(self.max_stored_bytes / GB, 6)}


@dataclass(frozen=True)
class Admission:
    """The answer of `admit`: whether the jobs were admitted, what the namespace had, and the reservations to fill
    (one per job wanted; empty when refused)."""

    admitted: bool
    active: int  # queued plus running jobs
    reserved: int  # jobs other requests are being admitted for
    reservations: tuple[str, ...] = ()


class Namespaces:
    RESERVATION_MS = 60_000  # a compile request submits its jobs within a second or two; a dead API's lapse then

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._admit = r.register_script(scripts.ADMIT)
        self._trim_jobs = r.register_script(scripts.TRIM_JOBS)

    # -- models --------------------------------------------------------------------------------------------------

    def add_model(self, ns: str, model_id: str, name: str, created: float | None = None) -> bool:
        """Put a model in a namespace; False when it was there already (its name and time are kept then)."""
        created = time.time() if created is None else created
        added = cast(int, self.r.zadd(keys.ns(ns, "models"), {model_id: created}, nx=True))
        if added:
            pipe = self.r.pipeline()
            pipe.zadd(keys.ns(ns, "model-ids"), {model_id: 0})
            pipe.hset(keys.ns(ns, "names"), model_id, name)
            pipe.zadd(keys.NAMESPACES, {ns: created}, nx=True)
            pipe.execute()
        return bool(added)

    def has_model(self, ns: str, model_id: str) -> bool:
        return self.r.zscore(keys.ns(ns, "models"), model_id) is not None

    def find_model(self, ns: str, prefix: str, limit: int = 2) -> list[str]:
        """This namespace's model ids that start with `prefix` (at most `limit`)."""
        if len(prefix) == ID_LEN:
            return [prefix] if self.has_model(ns, prefix) else []
        start, stop = lex_range(prefix)
        return cast(list[str], self.r.zrangebylex(keys.ns(ns, "model-ids"), start, stop, start=0, num=limit))

    def view(self, ns: str, model: dict[str, Any]) -> dict[str, Any]:
        """A model record as this namespace sees it: with its own name and upload time."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(keys.ns(ns, "names"), model["id"])
        pipe.zscore(keys.ns(ns, "models"), model["id"])
        name, created = pipe.execute()
        return {**model, **({"name": name} if name else {}), **({"created": created} if created else {})}

    def model_ids(self, ns: str, limit: int) -> list[str]:
        """This namespace's models, latest upload first."""
        return cast(list[str], self.r.zrevrange(keys.ns(ns, "models"), 0, limit - 1))

    def models(self, ns: str, limit: int) -> list[dict[str, Any]]:
        """This namespace's model records as it sees them (`view`), latest upload first, in two round trips."""
        held = cast(list[tuple[str, float]], self.r.zrevrange(keys.ns(ns, "models"), 0, limit - 1, withscores=True))
        if not held:
            return []
        ids = [i for i, _ in held]
        pipe = self.r.pipeline(transaction=False)
        pipe.mget([keys.model(i) for i in ids])
        pipe.hmget(keys.ns(ns, "names"), ids)
        raws, names = pipe.execute()
        return [{**json.loads(raw), **({"name": name} if name else {}), "created": created}
                for (_, created), raw, name in zip(held, raws, names, strict=True) if raw]

    # -- jobs ----------------------------------------------------------------------------------------------------

    def add_job(self, ns: str, job_id: str, reservation: str | None = None) -> bool:
        """Record that `ns` asked for `job_id`, filling `reservation` (from `admit`) in the same transaction; False
        when it had already."""
        pipe = self.r.pipeline()
        pipe.zadd(keys.ns(ns, "jobs"), {job_id: time.time()}, nx=True)
        pipe.sadd(keys.ns(ns, "active"), job_id)
        pipe.sadd(keys.job_namespaces(job_id), ns)
        pipe.zadd(keys.NAMESPACES, {ns: time.time()}, nx=True)
        if reservation is not None:
            pipe.zrem(keys.ns(ns, "reserved"), reservation)
        return bool(pipe.execute()[0])

    def admit(self, ns: str, wanted: int, max_jobs: int) -> Admission:
        """Reserve `wanted` jobs against `max_jobs`, atomically with every other request of the namespace."""
        token = secrets.token_hex(8)
        ok, active, reserved = cast(list[int], self._admit(
            keys=[keys.ns(ns, "active"), keys.ns(ns, "reserved")],
            args=[keys.job(""), wanted, max_jobs, self.RESERVATION_MS, token]))
        held = tuple(f"{token}:{i}" for i in range(1, wanted + 1)) if ok else ()
        return Admission(bool(ok), int(active), int(reserved), held)

    def release(self, ns: str, reservations: tuple[str, ...]) -> None:
        """Give back what `add_job` did not fill (a request that failed or joined fewer jobs); filled ones are gone."""
        if reservations:
            self.r.zrem(keys.ns(ns, "reserved"), *reservations)

    def trim_jobs(self, ns: str, keep: int, batch: int = 8, scan: int = 256) -> int:
        """Let go of the namespace's oldest ended jobs past `keep` (at most `batch` of them, among its `scan` oldest:
        queued and running ones, at most its job quota, are passed over); a job no namespace holds any more is
        deleted with its events. Each new job calls it, so what one namespace's jobs hold in Redis stays bounded
        however many it submits and cancels. Returns how many it let go of."""
        return int(cast(int, self._trim_jobs(
            keys=[keys.ns(ns, "jobs"), keys.JOBS_INDEX, keys.DEADLETTER, keys.METRICS_OBSERVED],
            args=[ns, keep, batch, scan, keys.job("")])))

    def has_job(self, ns: str, job_id: str) -> bool:
        return self.r.zscore(keys.ns(ns, "jobs"), job_id) is not None

    def job_ids(self, ns: str, limit: int) -> list[str]:
        return cast(list[str], self.r.zrevrange(keys.ns(ns, "jobs"), 0, limit - 1))

    def shared_with_others(self, ns: str, job_id: str) -> bool:
        """Whether namespaces other than `ns` asked for this job too."""
        holders = cast(set[str], self.r.smembers(keys.job_namespaces(job_id)))
        return bool(holders - {ns})

    def leave_job(self, ns: str, job_id: str) -> int:
        """Take `ns` off a job it shares; returns how many namespaces still hold it."""
        pipe = self.r.pipeline()
        pipe.srem(keys.job_namespaces(job_id), ns)
        pipe.zrem(keys.ns(ns, "jobs"), job_id)
        pipe.srem(keys.ns(ns, "active"), job_id)
        pipe.scard(keys.job_namespaces(job_id))
        return int(pipe.execute()[-1])

    def active_jobs(self, ns: str) -> int:
        """How many of this namespace's jobs are queued or running (ended ones leave the set here)."""
        ids = cast(set[str], self.r.smembers(keys.ns(ns, "active")))
        if not ids:
            return 0
        ordered = sorted(ids)
        pipe = self.r.pipeline(transaction=False)
        for job_id in ordered:
            pipe.hget(keys.job(job_id), "state")
        states = pipe.execute()
        ended = [j for j, s in zip(ordered, states, strict=True) if s not in ACTIVE]
        if ended:
            self.r.srem(keys.ns(ns, "active"), *ended)
        return len(ordered) - len(ended)

    # -- quotas --------------------------------------------------------------------------------------------------

    def quota(self, ns: str, default: Quota) -> Quota:
        raw = cast(dict[str, str], self.r.hgetall(keys.ns(ns, "quota")))
        return Quota(
            max_jobs=int(raw["max_jobs"]) if "max_jobs" in raw else default.max_jobs,
            max_stored_bytes=int(float(raw["max_stored_gb"]) * GB) if "max_stored_gb" in raw
            else default.max_stored_bytes)

    def set_quota(self, ns: str, *, max_jobs: int | None = None, max_stored_gb: float | None = None) -> None:
        fields: dict[str, float] = {}
        if max_jobs is not None:
            fields["max_jobs"] = max_jobs
        if max_stored_gb is not None:
            fields["max_stored_gb"] = float(max_stored_gb)
        if fields:
            pipe = self.r.pipeline()
            pipe.hset(keys.ns(ns, "quota"), mapping=cast(Any, fields))
            pipe.zadd(keys.NAMESPACES, {ns: time.time()}, nx=True)
            pipe.execute()

    def stored_bytes(self, ns: str, batch: int = 500) -> int:
        """What this namespace holds: its models' bytes plus the bytes of their artifacts still stored, and each
        weights blob those artifacts bind, once. Counted afresh (a few round trips per `batch` models), so
        evictions and shared content never leave it stale."""
        total, start = 0, 0
        digests: set[str] = set()
        while ids := cast(list[str], self.r.zrange(keys.ns(ns, "models"), start, start + batch - 1)):
            start += batch
            total += self._bytes_of(ids, digests)
        if digests:
            ds = sorted(digests)
            total += sum(int(b) for b in cast(list[str | None], self.r.hmget(keys.WEIGHTS_BYTES, ds)) if b)
        return total

    def _bytes_of(self, model_ids: list[str], digests: set[str]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for m in model_ids:
            pipe.get(keys.model(m))
            pipe.smembers(keys.artifacts_by_model(m))
        replies = pipe.execute()
        total = sum(json.loads(raw).get("size", 0) for raw in replies[::2] if raw)
        arts = sorted(a for members in replies[1::2] for a in members)
        if arts:
            total += sum(int(b) for b in cast(list[str | None], self.r.hmget(keys.ARTIFACTS_BYTES, arts)) if b)
            for raw in cast(list[str | None], self.r.mget([keys.artifact(a) for a in arts])):
                w = json.loads(raw).get("weights") if raw else None
                if isinstance(w, dict) and isinstance(w.get("sha256"), str):
                    digests.add(w["sha256"])
        return total

    def names(self) -> list[str]:
        return cast(list[str], self.r.zrange(keys.NAMESPACES, 0, -1))

    def usage(self, ns: str, default: Quota) -> dict[str, Any]:
        return {"namespace": ns, "jobs": self.active_jobs(ns), "stored_bytes": self.stored_bytes(ns),
                "models": int(self.r.zcard(keys.ns(ns, "models"))), "quota": self.quota(ns, default).to_json()}

