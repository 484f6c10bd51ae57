"""Waiting out a Redis that is down. The worker never exits for that: it retries with capped backoff, logging
once when Redis goes away and once when it is back. (redis-py's own Retry, set up in service.store, rides over
blips of a second or so first.)"""

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
