"""Backoff, twice: waiting out a Redis that is down, and spacing a failed job's attempts.

The worker never exits because Redis is down: it retries with capped backoff, logging once when Redis goes away
and once when it is back. (redis-py's own Retry, set up in service.store, rides over blips of a second or so first.)

A job whose attempt failed with a retryable failure goes back in line, but no worker may take it before a delay
(`retry_delay`: exponential in the attempts, capped, with jitter) has passed: the queue holds it aside until then
(docs/queue.md, "Backoff")."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger("aotc.worker")
T = TypeVar("T")


def until_redis(fn: Callable[[], T], what: str, wait: Callable[[float], bool], *, cap_s: float = 10.0,
                recover: Callable[[], object] | None = None) -> T | None:
    """Call `fn`, retrying while Redis is unreachable: 0.5 s, doubling up to `cap_s`, ±20 % jitter.

    `wait(seconds)` sleeps between tries and returns True to give up, and then this returns None (a shutdown
    began, or the wait no longer makes sense). `recover` runs on a NOGROUP reply (Redis came back empty, without
    persistence) before the next try; without it that error is raised like any other."""
    delay, down_since = 0.5, None
    while True:
        try:
            out = fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if down_since is None:
                down_since = time.monotonic()
                log.warning("cannot reach Redis to %s (%s); retrying with backoff", what, e)
            if wait(delay * random.uniform(0.8, 1.2)):
                return None
            delay = min(delay * 2, cap_s)
            continue
        except redis.ResponseError as e:
            if recover is None or "NOGROUP" not in str(e):
                raise
            recover()
            continue
        if down_since is not None:
            log.info("Redis is back after %.1f s", time.monotonic() - down_since)
        return out


def retry_delay(attempt: int, base_s: float, cap_s: float, rand: Callable[[], float] = random.random) -> float:
    """Seconds a job waits after its attempt `attempt` (1, 2, ...) failed: base_s doubled per earlier attempt, at
    most cap_s, then "equal jitter" (half of it fixed, half random), so jobs that failed together do not come back
    together. 0 when base_s is 0 (retry at once)."""
    if base_s <= 0:
        return 0.0
    full = min(cap_s, base_s * 2.0 ** min(max(attempt - 1, 0), 60))
    return full / 2 + rand() * full / 2
