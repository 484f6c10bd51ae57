"""The Redis store, shared by the API and the workers. `Store` composes one aggregate per concept:

    store.models      models.py      model records
    store.blobs       blobs.py       chunked files: models, packages, sources
    store.jobs        jobs.py        job records, events and state transitions (the Lua in scripts.py)
    store.queues      queues.py      the queue streams per target and priority, and reading them
    store.leases      leases.py      queue entries a worker holds: renew, drop, take back expired ones
    store.artifacts   artifacts.py   published artifacts and their reports
    store.workers     registry.py    live workers and their heartbeats
    store.caches      caches.py      the compile caches workers share, and the compile count

The reaper (reaper.py) settles the jobs of lost workers; keys.py names every key; embedded.py starts a local
redis-server. Synchronous on purpose: the API runs these calls in its thread pool and the worker calls them
directly, so there is one implementation of every state transition.
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from service.store.artifacts import Artifacts
from service.store.blobs import Blobs
from service.store.caches import Caches
from service.store.jobs import TERMINAL, Jobs
from service.store.leases import Lease, Leases
from service.store.models import Models
from service.store.queues import Queues
from service.store.registry import Registry

__all__ = ["TERMINAL", "Lease", "Store"]


class Store:
    def __init__(self, url: str, *, chunk_bytes: int = 64 * 2**20) -> None:
        self.url = url
        # A few quick retries ride over a blip; a Redis that stays down fails a call within about a second, so
        # the API answers 503 promptly and the worker's own backoff takes over. Reads block at most a few seconds
        # (queue polls, SSE), well under the socket timeout.
        conn = {"health_check_interval": 30, "socket_connect_timeout": 2.0, "socket_timeout": 10.0,
                "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3)}
        # redis-py types every reply as `bytes | str` whatever decode_responses says: replies of `r` are str,
        # those of `raw` bytes, and the aggregates' casts say so.
        self.r = redis.Redis.from_url(url, decode_responses=True, **conn)
        self.raw = redis.Redis.from_url(url, decode_responses=False, **conn)
        self.blobs = Blobs(self.r, self.raw, chunk_bytes)
        self.models = Models(self.r)
        self.queues = Queues(self.r)
        self.leases = Leases(self.r)
        self.jobs = Jobs(self.r, self.queues)
        self.artifacts = Artifacts(self.r, self.blobs)
        self.workers = Registry(self.r)
        self.caches = Caches(self.r)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def close(self) -> None:
        self.r.close()
        self.raw.close()
