"""The upload's write path, and the disk it writes to: a full disk is a 507 that says so, never a 500.

An upload takes room twice on the API's disks: its body is spooled to a temp file under AOTC_DATA_DIR/uploads
(the archive checks read it there), then copied into the blob store, which for `file://` is a local dir too. So:

- **Before a byte is written**: when `Content-Length` says the body would leave less than AOTC_DISK_LOW_WATER_MB
  free on a disk it goes to (both copies counted where they share one), nothing is written.
- **While it is written**: every few MB the spool's disk is measured again, and a write that fails for want of
  room (ENOSPC, EDQUOT) stops the spooling; the partial file is deleted at once.
- **Either way the body is still read and hashed** to its end, without being written: the model id is its sha256,
  so a re-upload of a model whose bytes are stored (what `aotc compile` sends first) succeeds as it always does,
  with no room at all. Any other upload is then refused with DiskFull: a 507 naming the disk, its free space and
  the setting, with Retry-After.
- **The copy into the blob store**: measured again first; the store's own refusal (a full disk, an S3 507) is the
  same 507, naming the store.

Reading a body that will be refused costs the bandwidth of an upload; only the digest says whether it is one the
service already holds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from fastapi import Request

from compiler.errors import AotcError, PayloadTooLarge
from service.api.settings import Settings
from service.store.disk import MB, NoSpace, Space, is_disk_full, mb

SETTING = "AOTC_DISK_LOW_WATER_MB"
RECHECK_BYTES = 8 * MB  # how often the spool's disk is measured again while a body streams in


class DiskFull(AotcError):
    """A disk (or a blob store) of the service's has no room for what a request would write (507)."""

    status, code = 507, "disk_full"
    headers = {"Retry-After": "30"}


def low_water(settings: Settings) -> int:
    return settings.disk_low_water_mb * MB


def _reserve(settings: Settings) -> str:
    return f"{SETTING}={settings.disk_low_water_mb} keeps {mb(low_water(settings))} free"


def shortfall(settings: Settings, needs: list[tuple[Path, int]]) -> DiskFull | None:
    """DiskFull when writing `needs` (a path, bytes to write there) would leave less than the low-water mark free
    on a filesystem; paths on one filesystem add up. None when everything fits."""
    per_disk: dict[int, tuple[Space, int]] = {}
    for path, n in needs:
        space = Space.of(path)
        seen, total = per_disk.get(space.device, (space, 0))
        per_disk[space.device] = (seen, total + n)
    for space, need in per_disk.values():
        if space.free - need < low_water(settings):
            return DiskFull(
                f"no room for this upload: it needs {mb(need)} on the disk that holds {space.path}, which has "
                f"{mb(space.free)} free, and {_reserve(settings)}; free space there (or lower {SETTING}) and try "
                "again", setting=SETTING, free_bytes=space.free, needed_bytes=need,
                low_water_bytes=low_water(settings))
    return None


def full_disk(where: Path, settings: Settings, exc: BaseException, doing: str) -> DiskFull:
    """The 507 for a write that failed for want of room: a blob store's own words, or the disk's free space now."""
    if isinstance(exc, NoSpace):
        return DiskFull(f"{exc} while {doing}; free room in the store and try again", setting=SETTING)
    try:
        space = Space.of(where)
    except OSError:
        return DiskFull(f"the disk that holds {where} is full ({exc}) while {doing}; free space there and try "
                        f"again ({_reserve(settings)})", setting=SETTING)
    return DiskFull(f"the disk filled while {doing}: {space.describe()} ({_reserve(settings)}); free space there "
                    "and try again", setting=SETTING, free_bytes=space.free, low_water_bytes=low_water(settings))


@contextlib.contextmanager
def writing(where: Path, settings: Settings, doing: str) -> Iterator[None]:
    """Turn a failure for want of room inside the block into DiskFull (507); anything else passes through."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise full_disk(where, settings, e, doing) from e


class Spool:
    """An upload's body in a temp file under AOTC_DATA_DIR/uploads, hashed as it arrives. When the disk cannot
    take it, `refused` says why and `path` is None: the body was hashed to its end but nothing of it is kept."""

    def __init__(self, settings: Settings, blob_root: Path | None) -> None:
        self.settings = settings
        self.blob_root = blob_root
        self.dir = settings.data_dir / "uploads"
        self.digest = hashlib.sha256()
        self.size = 0
        self.path: Path | None = None
        self.refused: DiskFull | None = None

    def _needs(self, n: int) -> list[tuple[Path, int]]:
        """The room `n` bytes of upload take: the spooled copy, and the stored one in a file blob store."""
        return [(self.dir, n), *([(self.blob_root, n)] if self.blob_root is not None else [])]

    async def receive(self, request: Request, limit: int, declared: int | None) -> None:
        """Read the whole body (413 past `limit` bytes), hashing it, and spool it while the disk has room."""
        if declared is not None:
            self.refused = shortfall(self.settings, self._needs(declared))
        f: IO[bytes] | None = None
        if self.refused is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                fd, name = tempfile.mkstemp(dir=self.dir, suffix=".pt2")
            except OSError as e:
                if not is_disk_full(e):
                    raise
                self.refused = full_disk(self.dir, self.settings, e, "spooling the upload")
            else:
                self.path = Path(name)
                f = os.fdopen(fd, "wb")
        next_check = RECHECK_BYTES
        try:
            async for chunk in request.stream():
                self.size += len(chunk)
                if self.size > limit:
                    raise PayloadTooLarge(f"the upload is over the limit of {limit} bytes (AOTC_MAX_UPLOAD_MB)")
                self.digest.update(chunk)
                if f is None:
                    continue
                try:
                    f.write(chunk)
                    if self.size >= next_check:  # a body without Content-Length, or a disk others fill meanwhile
                        next_check = self.size + RECHECK_BYTES
                        if Space.of(self.dir).free < low_water(self.settings):
                            raise OSError(errno.ENOSPC, "below the low-water mark")
                except OSError as e:
                    if not is_disk_full(e):
                        raise
                    self.refused = full_disk(self.dir, self.settings, e, f"spooling the upload (after "
                                             f"{mb(self.size)} of it)")
                    self._drop(f)
                    f = None
            if f is not None:
                try:
                    f.close()  # flushes the last buffered bytes: the disk may refuse them only now
                except OSError as e:
                    if not is_disk_full(e):
                        raise
                    self.refused = full_disk(self.dir, self.settings, e, "spooling the upload")
                    self._drop(f)
                    f = None
        except BaseException:
            self._drop(f)
            raise

    def _drop(self, f: IO[bytes] | None) -> None:
        """Forget the partial file now, so its room is back before the rest of the body arrives."""
        with contextlib.suppress(OSError):
            if f is not None:
                f.close()
        self.discard()

    def room_to_store(self) -> None:
        """DiskFull when the stored copy would no longer fit above the low-water mark (others wrote meanwhile)."""
        if self.blob_root is not None and (short := shortfall(self.settings, [(self.blob_root, self.size)])):
            raise short

    def discard(self) -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None
