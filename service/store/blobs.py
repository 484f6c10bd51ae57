"""Blobs: files stored in Redis as chunks plus a manifest (size, chunk count, sha256).

Models, artifact packages and artifact sources are blobs. The manifest is written last, so a half-written blob
never shows, and a blob read back is checked against its manifest's digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import redis

from service.store import keys


class Blobs:
    def __init__(self, r: redis.Redis, raw: redis.Redis, chunk_bytes: int) -> None:
        self.r = r  # decoded replies (the manifest)
        self.raw = raw  # bytes replies (the chunks)
        self.chunk_bytes = chunk_bytes

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> dict[str, Any]:
        """Copy a file into Redis in chunks; returns the manifest, which is written last."""
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

    def manifest(self, kind: str, blob_id: str) -> dict[str, Any] | None:
        m = self.r.hgetall(keys.blob(kind, blob_id))
        if not m:
            return None
        return {"size": int(m["size"]), "chunks": int(m["chunks"]), "sha256": m["sha256"]}

    def chunks(self, kind: str, blob_id: str) -> Iterator[bytes]:
        """The blob's bytes, chunk by chunk (KeyError when it or a chunk is missing)."""
        m = self.manifest(kind, blob_id)
        if m is None:
            raise KeyError(blob_id)
        for n in range(m["chunks"]):
            chunk = cast(bytes | None, self.raw.get(keys.blob_chunk(kind, blob_id, n)))
            if chunk is None:
                raise KeyError(f"{kind}:{blob_id} chunk {n} is missing")
            yield chunk

    def to_file(self, kind: str, blob_id: str, dest: Path) -> str:
        """Write a blob to `dest` and return its sha256, checked against the manifest."""
        m = self.manifest(kind, blob_id)
        if m is None:
            raise KeyError(blob_id)
        digest = hashlib.sha256()
        with open(dest, "wb") as f:
            for chunk in self.chunks(kind, blob_id):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != m["sha256"]:
            raise ValueError(f"blob {kind}:{blob_id} is corrupt: sha256 {digest.hexdigest()} != {m['sha256']}")
        return str(m["sha256"])

    def read(self, kind: str, blob_id: str, limit: int) -> bytes | None:
        """A whole blob in memory (None when absent); ValueError when it is over `limit` bytes."""
        m = self.manifest(kind, blob_id)
        if m is None:
            return None
        if m["size"] > limit:
            raise ValueError(f"blob {kind}:{blob_id} is {m['size']} bytes, over the {limit}-byte limit")
        return b"".join(self.chunks(kind, blob_id))
