"""The API's side of storage: where its blobs go (AOTC_BLOB_STORE; by default a folder under AOTC_DATA_DIR) and what
it checks and settles when it starts."""

from __future__ import annotations

import dataclasses
import logging

import redis

from service.api.settings import Settings
from service.store import StorageOptions, Store
from service.store.memory import is_out_of_memory, oom_message

log = logging.getLogger("aotc.api")


def storage_options(settings: Settings) -> StorageOptions:
    options = StorageOptions.from_settings(settings)
    if not options.blob_store:
        options = dataclasses.replace(options, blob_store=f"file://{(settings.data_dir / 'blobs').resolve()}")
    return options


def on_start(store: Store) -> None:
    """Refuse a Redis that may evict keys by itself (RedisPolicyError); announce the blob store to workers; count
    artifacts from before the cache was bounded, and evict what a lowered AOTC_STORE_MAX_GB no longer holds. A Redis
    that is down or full now is not fatal: routes answer 503 or 507 until it is back, and the next start does the
    rest."""
    try:
        for warning in store.check_redis(announce=True):
            log.warning("%s", warning)
        if n := store.artifacts.adopt():
            log.info("counted %d artifact(s) stored before the artifact cache was bounded", n)
        store.artifacts.make_room()
        log.info("blobs are stored in %s; artifacts hold %d bytes (AOTC_STORE_MAX_GB: %s bytes)", store.blobs.url,
                 store.artifacts.total_bytes(), store.artifacts.max_bytes)
    except (redis.ConnectionError, redis.TimeoutError) as e:
        log.warning("cannot reach Redis at start (%s): its eviction policy is not checked", e)
    except redis.ResponseError as e:
        if not is_out_of_memory(e):
            raise
        log.warning("%s", oom_message(store.r))
