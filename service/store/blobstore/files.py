"""The `file://DIR` blob store: files on a local disk or a volume that the API and the workers share.

    DIR/.aotc-store-id              a random id, so a worker can tell that it sees the API's volume
    DIR/.tmp/                       writes in progress (temp names; older than a day: swept at start)
    DIR/{kind}/{id[:2]}/{id}.{sha256[:16]}.data   the bytes
    DIR/{kind}/{id[:2]}/{id}.json                 the manifest {size, sha256, data}, written last

A put writes the bytes to a temp name, fsyncs and renames them into place, then does the same for the manifest:
a writer killed at any point leaves nothing a reader can see, and the next put of the same id works. A reader
holds the data file open, so a concurrent replace or delete never changes the bytes under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from service.store.blobs import PIECE, BlobError, Manifest, Reads, check_id, clamp

_STALE_S = 24 * 3600  # a temp file this old belongs to a writer that died


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileBlobs(Reads):
    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.root = Path(root).resolve()
        self.url = f"file://{self.root}"
        if not self.root.is_dir():
            if not create:
                raise BlobError(f"blob store directory {self.root} does not exist here")
            self.root.mkdir(parents=True, exist_ok=True)
        self.tmp = self.root / ".tmp"
        self.tmp.mkdir(exist_ok=True)
        self.store_id = self._store_id()
        self._sweep()

    def _store_id(self) -> str:
        path = self.root / ".aotc-store-id"
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=self.tmp)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(8))
            with contextlib.suppress(FileExistsError):  # another process made it first: theirs stands
                os.link(tmp, path)
            os.unlink(tmp)
        return path.read_text().strip()

    def _sweep(self) -> None:
        cutoff = time.time() - _STALE_S
        for p in self.tmp.iterdir():
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()

    def _dir(self, kind: str, blob_id: str) -> Path:
        check_id(kind, blob_id)
        return self.root / kind / blob_id[:2]

    def _read_manifest(self, kind: str, blob_id: str) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self._dir(kind, blob_id) / f"{blob_id}.json").read_bytes()))
        except FileNotFoundError:
            return None

    def put(self, kind: str, blob_id: str, src: BinaryIO) -> Manifest:
        d = self._dir(kind, blob_id)
        d.mkdir(parents=True, exist_ok=True)
        old = self._read_manifest(kind, blob_id)
        fd, data_tmp = tempfile.mkstemp(dir=self.tmp, prefix=f"{kind}-{blob_id}.")
        manifest_tmp = None
        try:
            digest, size = hashlib.sha256(), 0
            with os.fdopen(fd, "wb") as f:
                while piece := src.read(4 * PIECE):
                    digest.update(piece)
                    f.write(piece)
                    size += len(piece)
                f.flush()
                os.fsync(f.fileno())
            sha = digest.hexdigest()
            data_name = f"{blob_id}.{sha[:16]}.data"
            os.replace(data_tmp, d / data_name)
            fd, manifest_tmp = tempfile.mkstemp(dir=self.tmp, prefix=f"{kind}-{blob_id}.", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"size": size, "sha256": sha, "data": data_name}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(manifest_tmp, d / f"{blob_id}.json")
            _fsync_dir(d)
        except BaseException:
            for p in (data_tmp, manifest_tmp):
                if p:
                    with contextlib.suppress(OSError):
                        os.unlink(p)
            raise
        if old and old.get("data") != data_name:  # the write this one replaces
            with contextlib.suppress(OSError):
                (d / old["data"]).unlink()
        return {"size": size, "sha256": sha}

    def manifest(self, kind: str, blob_id: str) -> Manifest | None:
        m = self._read_manifest(kind, blob_id)
        return None if m is None else {"size": int(m["size"]), "sha256": str(m["sha256"])}

    def path(self, kind: str, blob_id: str) -> Path | None:
        """Where a blob's bytes are, or None."""
        m = self._read_manifest(kind, blob_id)
        return None if m is None else self._dir(kind, blob_id) / m["data"]

    def iter_range(self, kind: str, blob_id: str, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        m = self._read_manifest(kind, blob_id)
        if m is None:
            raise KeyError(f"{kind}:{blob_id}")
        try:
            f = open(self._dir(kind, blob_id) / m["data"], "rb", buffering=0)  # closed by _pieces
        except FileNotFoundError:
            raise KeyError(f"{kind}:{blob_id}") from None
        start, end = clamp(int(m["size"]), start, end)
        return self._pieces(f, start, end)

    @staticmethod
    def _pieces(f: BinaryIO, pos: int, end: int) -> Iterator[bytes]:
        with f:
            fd = f.fileno()
            while pos < end:
                piece = os.pread(fd, min(PIECE, end - pos), pos)
                if not piece:
                    raise KeyError(f"{f.name}: shorter than its manifest")
                yield piece
                pos += len(piece)

    def delete(self, kind: str, blob_id: str) -> None:
        d = self._dir(kind, blob_id)
        m = self._read_manifest(kind, blob_id)
        if m is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (d / f"{blob_id}.json").unlink()
        with contextlib.suppress(FileNotFoundError):
            (d / m["data"]).unlink()
