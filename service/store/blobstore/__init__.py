"""The blob stores behind the `BlobStore` seam (service/store/blobs.py), and choosing one from AOTC_BLOB_STORE.

    redis_chunks.py   `redis`               chunks in the service's Redis
    files.py          `file:///DIR`         a local disk or a shared volume
    s3.py             `s3://bucket/prefix`  an S3-protocol object store; pulls are redirected to it

The API says which store it uses in Redis (`config:blob-store`, with the file store's id), so a worker started
without AOTC_BLOB_STORE uses the same one, and one started with a file store the API cannot see says so.
Blobs written to Redis before another store was chosen are still read from there (`WithRedisFallback`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import redis

from service.store import keys
from service.store.blobs import BlobError, BlobStore, Manifest, Reads
from service.store.blobstore.files import FileBlobs
from service.store.blobstore.redis_chunks import RedisBlobs
from service.store.blobstore.settings import StorageSettings

log = logging.getLogger("aotc.store")

__all__ = ["BlobError", "BlobStore", "StorageOptions", "local_root", "open_blob_store"]


@dataclass(frozen=True)
class StorageOptions:
    """What a process is told about storage (its settings' AOTC_BLOB_STORE, AOTC_CHUNK_MB, AOTC_STORE_MAX_GB,
    AOTC_WEIGHTS_GRACE_S and AOTC_S3_*). `blob_store=None`: the store the API announced in Redis, else `redis`."""

    blob_store: str | None = None
    chunk_bytes: int = 4 * 2**20
    max_artifact_bytes: int | None = None
    weights_grace_s: float = 600.0
    s3_endpoint_url: str | None = None
    s3_public_url: str | None = None
    s3_region: str | None = None
    s3_presign_s: int = 900

    @classmethod
    def from_settings(cls, s: StorageSettings) -> StorageOptions:
        """From an API's or a worker's settings (both are StorageSettings)."""
        return cls(
            blob_store=s.blob_store or None,
            chunk_bytes=s.chunk_mb * 2**20,
            max_artifact_bytes=int(s.store_max_gb * 2**30),
            weights_grace_s=s.weights_grace_s,
            s3_endpoint_url=s.s3_endpoint_url or None,
            s3_public_url=s.s3_public_url or None,
            s3_region=s.s3_region or None,
            s3_presign_s=s.s3_presign_s,
        )


def open_blob_store(url: str, r: redis.Redis, raw: redis.Redis, options: StorageOptions, *,
                    create: bool = True) -> BlobStore:
    """The store a URL names. Any store but `redis` still reads blobs written to Redis before it was chosen."""
    legacy = RedisBlobs(r, raw, options.chunk_bytes)
    if url == "redis":
        return legacy
    primary: BlobStore
    if url.startswith("file://"):
        primary = FileBlobs(Path(url.removeprefix("file://")), create=create)
    elif url.startswith("s3://"):
        from service.store.blobstore.s3 import S3Blobs

        primary = S3Blobs(url, endpoint_url=options.s3_endpoint_url, public_url=options.s3_public_url,
                          region=options.s3_region, presign_s=options.s3_presign_s)
    else:
        raise BlobError(f"AOTC_BLOB_STORE={url!r}: write `redis`, `file:///DIR` or `s3://bucket/prefix`")
    return WithRedisFallback(primary, legacy)


def announce(r: redis.Redis, store: BlobStore) -> None:
    """Say in Redis which store this API uses, for workers that were not told."""
    primary = store.primary if isinstance(store, WithRedisFallback) else store
    value = json.dumps({"url": primary.url, "id": getattr(primary, "store_id", None)})
    previous = r.getset(keys.BLOB_STORE, value)
    if previous and previous != value:
        log.warning("the blob store was %s and is now %s; blobs stored there are not moved", previous, value)


def announced(r: redis.Redis) -> dict[str, Any] | None:
    raw = r.get(keys.BLOB_STORE)
    return json.loads(raw) if raw else None


def local_root(store: BlobStore) -> Path | None:
    """The local dir a file store writes to (whose free space the API and the workers watch), else None. An
    announced store is opened to find out: that reads Redis."""
    if isinstance(store, Announced):
        store = store.store
    primary = store.primary if isinstance(store, WithRedisFallback) else store
    return primary.root if isinstance(primary, FileBlobs) else None


def check_same_volume(store: BlobStore, r: redis.Redis) -> str | None:
    """For a file store given to a worker: a warning when the API announced another volume than this one."""
    primary = store.primary if isinstance(store, WithRedisFallback) else store
    theirs = announced(r)
    if not isinstance(primary, FileBlobs) or not theirs or theirs.get("id") in (None, primary.store_id):
        return None
    return (f"this process stores blobs in {primary.url} but the API uses {theirs['url']}, another volume "
            "(a different .aotc-store-id): give both the same AOTC_BLOB_STORE, on a volume both see")


class WithRedisFallback(Reads):
    """Writes go to `primary`; reads of blobs it lacks try the Redis chunks they were written to before."""

    def __init__(self, primary: BlobStore, legacy: RedisBlobs) -> None:
        self.primary = primary
        self.legacy = legacy
        self.url = primary.url
        self.presigns = bool(getattr(primary, "presigns", False))

    def _holder(self, kind: str, blob_id: str) -> BlobStore | None:
        if self.primary.exists(kind, blob_id):
            return self.primary
        return self.legacy if self.legacy.exists(kind, blob_id) else None

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        return self.primary.put(kind, blob_id, src)

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        return self.primary.manifest(kind, blob_id) or self.legacy.manifest(kind, blob_id)

    def exists(self, kind: str, blob_id: str) -> bool:
        return self._holder(kind, blob_id) is not None

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        holder = self._holder(kind, blob_id)
        if holder is None:
            raise KeyError(f"{kind}:{blob_id}")
        return holder.iter_range(kind, blob_id, start, end)

    def delete(self, kind: str, blob_id: str) -> None:
        self.primary.delete(kind, blob_id)
        self.legacy.delete(kind, blob_id)

    def presign(self, kind: str, blob_id: str, *, filename: str) -> str | None:
        """Only for blobs the primary holds: those still in Redis are streamed by the API."""
        if not self.presigns or not self.primary.exists(kind, blob_id):
            return None
        return self.primary.presign(kind, blob_id, filename=filename)

    def close(self) -> None:
        self.primary.close()


class Announced(Reads):
    """The store the API announced, opened at first use: a worker may start before any API has said. No
    announcement (an API from before stores were chosen): `redis`. A file store that is not on this machine, or
    not the same volume, is an error that says so."""

    def __init__(self, r: redis.Redis, raw: redis.Redis, options: StorageOptions) -> None:
        self.r, self.raw, self.options = r, raw, options
        self._store: BlobStore | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def store(self) -> BlobStore:
        with self._lock:
            if self._store is None:
                said = announced(self.r)
                url = said["url"] if said else "redis"
                try:
                    store = open_blob_store(url, self.r, self.raw, self.options, create=False)
                except BlobError as e:
                    raise BlobError(f"the API stores blobs in {url}, which this process cannot use ({e}); "
                                    "set AOTC_BLOB_STORE to a store both reach") from None
                primary = store.primary if isinstance(store, WithRedisFallback) else store
                if said and isinstance(primary, FileBlobs) and said.get("id") not in (None, primary.store_id):
                    raise BlobError(f"the API stores blobs in {url}, and this machine's {url} is another volume "
                                    "(a different .aotc-store-id); share one volume or use AOTC_BLOB_STORE=s3://...")
                if not said:
                    # Not kept: a worker that looks (its disk watch does, before its first claim) while no API has
                    # announced yet would otherwise stay on Redis after the API announces a file store.
                    return store
                self._store = store
            return self._store

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        return self.store.put(kind, blob_id, src)

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        return self.store.manifest(kind, blob_id)

    def exists(self, kind: str, blob_id: str) -> bool:
        return self.store.exists(kind, blob_id)

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        return self.store.iter_range(kind, blob_id, start, end)

    def delete(self, kind: str, blob_id: str) -> None:
        self.store.delete(kind, blob_id)

    def presign(self, kind: str, blob_id: str, *, filename: str) -> str | None:
        return self.store.presign(kind, blob_id, filename=filename)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def open_local(blobs: BlobStore, kind: str, blob_id: str) -> BinaryIO | None:
    """A blob's bytes as a file open on this machine's disk, where the store keeps them there (the file store), else
    None: for an answer the kernel sends straight from the page cache (sendfile). Opened once: a delete or a
    rewrite after this leaves the open file whole."""
    store: Any = blobs.store if isinstance(blobs, Announced) else blobs
    if isinstance(store, WithRedisFallback):
        store = store._holder(kind, blob_id)
    path = store.path(kind, blob_id) if isinstance(store, FileBlobs) else None
    try:
        return open(path, "rb", buffering=0) if path is not None else None
    except FileNotFoundError:  # deleted meanwhile: the caller streams, and reports it gone
        return None
