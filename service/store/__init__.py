"""The Redis store, shared by the API and the workers. `Store` composes one aggregate per concept:

    store.models      models.py      model records
    store.blobs       blobs.py       the bytes of models, packages and sources, in a blob store (blobstore/)
    store.jobs        jobs.py        job records, events and state transitions (the Lua in scripts.py)
    store.queues      queues.py      the queue streams per target and priority, and reading them
    store.leases      leases.py      queue entries a worker holds: renew, drop, take back expired ones
    store.artifacts   artifacts.py   published artifacts and their reports; the bounded cache that evicts them
    store.workers     registry.py    live workers and their heartbeats
    store.caches      caches.py      the compile caches workers share, and the compile count
    store.signing     signing.py     the public keys workers sign artifact manifests with; their revocation
    store.apikeys     apikeys.py     API keys (hashes only), their scopes and namespaces
    store.namespaces  namespaces.py  what each namespace sees (models, jobs) and its quotas
    store.names       names.py       the registry: names, versions and tags per namespace; the models they pin

The reaper (reaper.py) settles the jobs of lost workers; keys.py names every key; memory.py checks Redis's eviction
policy and tells an out-of-memory Redis apart; embedded.py starts a local redis-server. Synchronous on purpose:
the API runs these calls in its thread pool and the worker calls them directly, so there is one implementation of
every state transition.
"""

from __future__ import annotations

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from service.store.apikeys import ApiKeys
from service.store.artifacts import Artifacts
from service.store.blobs import BlobStore
from service.store.blobstore import Announced, StorageOptions, check_same_volume, open_blob_store
from service.store.blobstore import announce as announce_store
from service.store.caches import Caches
from service.store.jobs import TERMINAL, Jobs
from service.store.leases import Lease, Leases
from service.store.memory import check_eviction_policy
from service.store.models import Models
from service.store.names import Names
from service.store.namespaces import Namespaces
from service.store.queues import Queues
from service.store.registry import Registry
from service.store.signing import SigningKeys

__all__ = ["TERMINAL", "Lease", "StorageOptions", "Store"]


class Store:
    def __init__(self, url: str, *, storage: StorageOptions | None = None) -> None:
        """`storage`: where blobs go and the artifact cache's bound; by default the store the API announced (else
        Redis), unbounded."""
        self.url = url
        storage = storage or StorageOptions()
        # A few quick retries ride over a blip; a Redis that stays down fails a call within about a second, so
        # the API answers 503 promptly and the worker's own backoff takes over. Reads block at most a few seconds
        # (queue polls, SSE), well under the socket timeout.
        conn = {"health_check_interval": 30, "socket_connect_timeout": 2.0, "socket_timeout": 10.0,
                "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3)}
        # redis-py types every reply as `bytes | str` whatever decode_responses says: replies of `r` are str,
        # those of `raw` bytes, and the aggregates' casts say so.
        self.r = redis.Redis.from_url(url, decode_responses=True, **conn)
        self.raw = redis.Redis.from_url(url, decode_responses=False, **conn)
        self.blobs: BlobStore = (open_blob_store(storage.blob_store, self.r, self.raw, storage) if storage.blob_store
                                 else Announced(self.r, self.raw, storage))
        self.models = Models(self.r)
        self.queues = Queues(self.r)
        self.leases = Leases(self.r)
        self.jobs = Jobs(self.r, self.queues)
        self.artifacts = Artifacts(self.r, self.blobs, storage.max_artifact_bytes,
                                   weights_grace_s=storage.weights_grace_s)
        self.workers = Registry(self.r)
        self.caches = Caches(self.r)
        self.signing = SigningKeys(self.r)
        self.apikeys = ApiKeys(self.r)
        self.namespaces = Namespaces(self.r)
        self.names = Names(self.r)

    def ping(self) -> bool:
        return bool(self.r.ping())

    def check_redis(self, *, announce: bool = False) -> list[str]:
        """At start: raise RedisPolicyError unless Redis runs with `maxmemory-policy noeviction`. With `announce`
        (the API), say in Redis which blob store this is; else (a worker) warn about a file blob store on another
        volume than the API's. Returns warnings (CONFIG disabled; that volume)."""
        warnings = [check_eviction_policy(self.r)]
        if announce:
            announce_store(self.r, self.blobs)
        else:
            warnings.append(check_same_volume(self.blobs, self.r))
        return [w for w in warnings if w]

    def close(self) -> None:
        self.blobs.close()
        self.r.close()
        self.raw.close()
