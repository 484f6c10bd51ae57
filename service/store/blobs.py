"""Blobs: the bytes of models, artifact packages and artifact sources, in a blob store (a seam, `BlobStore`).

Redis keeps the records, the index and the queue; the bytes go where AOTC_BLOB_STORE says
(service/store/blobstore/):

    redis              chunks in Redis (small ones, written with an expiry until the manifest, written last, names them)
    file:///DIR        files on a local disk or a shared volume (temp name, fsync, rename; the manifest beside them)
    s3://bucket/prefix an S3-protocol object store (AWS, SeaweedFS, Garage, MinIO); pulls go straight to it through
                       presigned URLs

Every store answers the same calls. A blob is visible once its manifest ({size, sha256}) is written, and the
manifest is always written last, so a writer killed midway leaves nothing a reader can see, and the next put of the
same id works. Reads come in pieces of at most `PIECE` bytes, so memory stays bounded whatever a blob's size.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol, TypedDict, runtime_checkable

PIECE = 1 << 19  # the most a read hands over at once: memory per stream is a few pieces, not a whole blob
KINDS = ("model", "artifact", "sources", "weights")
_ID_CHARS = set(string.ascii_letters + string.digits + "._-")


class Manifest(TypedDict):
    size: int
    sha256: str


class BlobError(Exception):
    """A blob store that cannot be used as configured (a missing directory, an unreachable bucket)."""


@runtime_checkable
class BlobStore(Protocol):
    """Where the bytes live. `kind` is one of KINDS; ids are hex digests or cache keys (`[0-9a-zA-Z._-]`)."""

    @property
    def url(self) -> str:
        """What AOTC_BLOB_STORE would say to name this store."""
        ...

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        """Copy `src` in, hashing it; the manifest is written last, so a half-written blob never shows."""
        ...

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        ...

    def exists(self, kind: str, blob_id: str) -> bool:
        ...

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """Bytes [start, end) of the blob, in pieces of at most PIECE bytes. KeyError when the blob is absent (or
        goes missing midway: a reader then stops short, and the client's sha256 check catches it)."""
        ...

    def delete(self, kind: str, blob_id: str) -> None:
        """Remove a blob (the manifest first, so it stops showing at once); absent blobs are fine."""
        ...

    def presign(self, kind: str, blob_id: str, *, filename: str) -> str | None:
        """A URL that serves the blob without the API (a presigned S3 GET), or None: the API streams it."""
        ...

    def to_file(self, kind: str, blob_id: str, dest: Path) -> str:
        """Write a blob to `dest`, checked against its manifest's sha256 (returned)."""
        ...

    def read(self, kind: str, blob_id: str, limit: int) -> bytes | None:
        """A whole blob in memory (None when absent); ValueError when it is over `limit` bytes."""
        ...

    def close(self) -> None:
        ...


class Reads:
    """The calls every store builds the same way from `manifest` and `iter_range`."""

    presigns = False  # whether `presign` hands out URLs (S3) or always None

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        raise NotImplementedError

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        raise NotImplementedError

    def exists(self, kind: str, blob_id: str) -> bool:
        return self.manifest(kind, blob_id) is not None

    def presign(self, kind: str, blob_id: str, *, filename: str) -> str | None:
        return None

    def to_file(self, kind: str, blob_id: str, dest: Path) -> str:
        m = self.manifest(kind, blob_id)
        if m is None:
            raise KeyError(f"{kind}:{blob_id}")
        digest = hashlib.sha256()
        with open(dest, "wb") as f:
            for piece in self.iter_range(kind, blob_id, 0, m["size"]):
                digest.update(piece)
                f.write(piece)
        if digest.hexdigest() != m["sha256"]:
            raise ValueError(f"blob {kind}:{blob_id} is corrupt: sha256 {digest.hexdigest()} != {m['sha256']}")
        return m["sha256"]

    def read(self, kind: str, blob_id: str, limit: int) -> bytes | None:
        m = self.manifest(kind, blob_id)
        if m is None:
            return None
        if m["size"] > limit:
            raise ValueError(f"blob {kind}:{blob_id} is {m['size']} bytes, over the {limit}-byte limit")
        return b"".join(self.iter_range(kind, blob_id, 0, m["size"]))

    def close(self) -> None:
        pass


def check_id(kind: str, blob_id: str) -> None:
    """Ids become file names and object keys: only what aotc itself makes (hex digests, cache keys) passes."""
    if kind not in KINDS:
        raise ValueError(f"unknown blob kind {kind!r}")
    if not blob_id or blob_id[0] == "." or len(blob_id) > 200 or not set(blob_id) <= _ID_CHARS:
        raise ValueError(f"bad blob id {blob_id!r}")


def clamp(size: int, start: int, end: int | None) -> tuple[int, int]:
    """[start, end) within a blob of `size` bytes."""
    end = size if end is None else min(end, size)
    return max(0, start), end
