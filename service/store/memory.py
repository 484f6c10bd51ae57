"""Redis's memory: the eviction policy aotc needs, and telling an out-of-memory Redis apart.

aotc evicts artifacts itself (service/store/artifacts.py) and nothing else may go: Redis must run with
`maxmemory-policy noeviction`, where a full Redis refuses writes (`OOM command not allowed`) instead of dropping
models, job records or queue entries. The API answers such a refusal with a 507 that says so, whatever the route.
"""

from __future__ import annotations

from typing import Any, cast

import redis

from service.store import keys


class RedisPolicyError(RuntimeError):
    """Redis may drop keys on its own; aotc refuses to start on it."""


def check_eviction_policy(r: redis.Redis) -> str | None:
    """Raise RedisPolicyError unless `maxmemory-policy` is `noeviction`. Returns a warning when CONFIG is disabled
    (renamed away, as some managed Redis services do) and the policy cannot be read."""
    try:
        policy = cast(dict[str, str], r.config_get("maxmemory-policy")).get("maxmemory-policy")
    except redis.ResponseError as e:
        return (f"cannot read Redis's maxmemory-policy (CONFIG GET is disabled: {e}); aotc needs "
                "`maxmemory-policy noeviction`, so make sure it is set")
    if policy is not None and policy != "noeviction":
        raise RedisPolicyError(
            f"Redis's maxmemory-policy is {policy!r}: Redis would silently drop models, job records and queue "
            "entries when it fills up. Set `maxmemory-policy noeviction` (redis.conf, or CONFIG SET "
            "maxmemory-policy noeviction); aotc evicts artifacts itself, within AOTC_STORE_MAX_GB")
    return None


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write because it is full (also when the write was inside a script)."""
    return isinstance(exc, redis.exceptions.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and "OOM command not allowed" in str(exc))


def out_of_memory(r: redis.Redis) -> str | None:
    """A message when Redis refuses writes for lack of memory (a tiny probe write), else None."""
    try:
        r.set(keys.PROBE, "1", px=1000)
        return None
    except redis.ResponseError as e:
        if not is_out_of_memory(e):
            raise
    return oom_message(r)


def oom_message(r: redis.Redis) -> str:
    used = ""
    try:
        info: dict[str, Any] = r.info("memory")
        used = f" ({info.get('used_memory_human')} used of maxmemory {info.get('maxmemory_human')})"
    except redis.RedisError:
        pass
    return (f"Redis is out of memory{used} and refuses writes: uploads, compile requests and workers' heartbeats "
            "fail until it has room. Raise Redis's maxmemory, or lower AOTC_STORE_MAX_GB (with AOTC_BLOB_STORE="
            "redis the artifacts' bytes live in Redis), or move blobs out of Redis (AOTC_BLOB_STORE=file://... or "
            "s3://...)")
