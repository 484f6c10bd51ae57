"""The `redis` blob store: a blob is chunks in Redis plus a manifest hash, written last.

Chunks are small (AOTC_CHUNK_MB, 4 MB by default) so that neither a write nor a read ever holds a whole blob. Each
write has its own generation: its chunks are written with an expiry and only a script that also writes the
manifest makes them permanent (BLOB_COMMIT), so a writer killed midway leaves nothing visible and nothing that
lasts, and a reader of the previous write never sees chunks of the next one. Blobs from before generations
(`blob:{kind}:{id}:{n}`, a manifest without `gen`) are read as they are.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

import redis

from service.store import keys, scripts
from service.store.blobs import PIECE, Manifest, Reads, check_id, clamp

PENDING_MS = 6 * 3600 * 1000  # how long a chunk of an unfinished write lives: far longer than any one upload


def read_full(src: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes, fewer only at the end of the stream (a raw stream may hand over less per read)."""
    data = src.read(n)
    if not data or len(data) == n:
        return data or b""
    parts = [data]
    got = len(data)
    while got < n:
        more = src.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class RedisBlobs(Reads):
    url = "redis"

    def __init__(self, r: redis.Redis, raw: redis.Redis, chunk_bytes: int) -> None:
        self.r = r  # decoded replies (the manifest)
        self.raw = raw  # bytes replies (the chunks)
        self.chunk_bytes = chunk_bytes
        self._commit = r.register_script(scripts.BLOB_COMMIT)
        self._delete = r.register_script(scripts.BLOB_DELETE)

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        check_id(kind, blob_id)
        gen = secrets.token_hex(6)
        prefix = keys.blob_chunk_prefix(kind, blob_id, gen)
        digest, size, n = hashlib.sha256(), 0, 0
        try:
            while chunk := read_full(src, self.chunk_bytes):
                self.raw.set(f"{prefix}{n}", chunk, px=PENDING_MS)
                n += 1
                digest.update(chunk)
                size += len(chunk)
            self._commit(keys=[keys.blob(kind, blob_id)],
                         args=[prefix, n, size, digest.hexdigest(), self.chunk_bytes, gen,
                               keys.blob_chunk_prefix(kind, blob_id)])
        except BaseException:
            self._discard(prefix, n + 1)
            raise
        return {"size": size, "sha256": digest.hexdigest()}

    def _discard(self, prefix: str, n: int) -> None:
        """Best effort: DEL works even when Redis is out of memory; what it misses expires by itself."""
        try:
            for start in range(0, n, 512):
                self.raw.delete(*(f"{prefix}{i}" for i in range(start, min(n, start + 512))))
        except redis.RedisError:
            pass

    def _layout(self, kind: str, blob_id: str) -> dict[str, Any] | None:
        m = cast(dict[str, str], self.r.hgetall(keys.blob(kind, blob_id)))
        if not m:
            return None
        size, chunks, gen = int(m["size"]), int(m["chunks"]), m.get("gen", "")
        prefix = keys.blob_chunk_prefix(kind, blob_id, gen)
        chunk_bytes = int(m.get("chunk_bytes") or 0)
        if not chunk_bytes:  # written before manifests said: every chunk but the last is as long as the first
            chunk_bytes = int(self.raw.strlen(f"{prefix}0")) if chunks > 1 else max(size, 1)
        return {"size": size, "sha256": m["sha256"], "prefix": prefix, "chunk_bytes": chunk_bytes}

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        lay = self._layout(kind, blob_id)
        return None if lay is None else {"size": lay["size"], "sha256": lay["sha256"]}

    def exists(self, kind: str, blob_id: str) -> bool:
        return bool(self.r.exists(keys.blob(kind, blob_id)))

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        lay = self._layout(kind, blob_id)
        if lay is None:
            raise KeyError(f"{kind}:{blob_id}")
        start, end = clamp(lay["size"], start, end)
        return self._pieces(f"{kind}:{blob_id}", lay["prefix"], lay["chunk_bytes"], start, end)

    def _pieces(self, name: str, prefix: str, chunk_bytes: int, pos: int, end: int) -> Iterator[bytes]:
        while pos < end:
            n, within = divmod(pos, chunk_bytes)
            take = min(PIECE, chunk_bytes - within, end - pos)
            piece = cast(bytes, self.raw.getrange(f"{prefix}{n}", within, within + take - 1))
            if len(piece) != take:
                raise KeyError(f"{name}: chunk {n} is missing")
            yield piece
            pos += take

    def delete(self, kind: str, blob_id: str) -> None:
        check_id(kind, blob_id)
        self._delete(keys=[keys.blob(kind, blob_id)], args=[keys.blob_chunk_prefix(kind, blob_id)])
