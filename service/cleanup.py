"""What a killed `aotc-server` leaves behind, removed when it starts again, before its API and workers run.

- temp uploads: `AOTC_DATA_DIR/uploads/*`, an upload's body on its way to the store (tens to hundreds of MB);
- blob chunks that no manifest names: a blob write cut short. The blob store's own `cleanup_incomplete()` does it
  where it has one; otherwise, with the embedded Redis only (nobody else can be writing to it then), chunk keys
  that still carry the expiry of an unfinished write, and chunks of the old layout without a manifest, are
  deleted (SCAN, never KEYS);
- job work dirs, `WORK_DIR/<job id>-<attempt>`, of jobs that are not running, and `WORK_DIR/warmup-<pid>` of
  workers that are gone: what a worker killed mid-job could not remove. aotc-server does this for the work dirs
  of its own local workers, before it starts them; a worker never touches a folder it did not make, so
  standalone `aotc-worker`s are left alone.

Blob writes are atomic already (the manifest is written last), so none of this was ever visible: it only takes
disk and memory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, cast

from service.store import Store, keys

log = logging.getLogger("aotc.cleanup")
WORK_DIR_NAME = re.compile(r"^([0-9a-f]{32})-\d+$")
WARMUP_DIR_NAME = re.compile(r"^warmup-(\d+)$")  # a worker's warm-up compile, named for its pid


def remove_temp_uploads(data_dir: Path) -> int:
    """Delete every file in DATA_DIR/uploads; returns the bytes freed. Call it only while no API runs there."""
    freed = 0
    for p in (Path(data_dir) / "uploads").glob("*"):
        try:
            if p.is_file():
                freed += p.stat().st_size
                p.unlink()
        except OSError as e:
            log.warning("could not remove %s: %s", p, e)
    return freed


def remove_stale_work_dirs(store: Store, work_dir: Path) -> list[str]:
    """Delete WORK_DIR/<job>-<attempt> folders whose job is not running; returns their names. Other entries
    (Inductor's cache, the temp dir with AOTInductor's precompiled headers) stay."""
    removed: list[str] = []
    root = Path(work_dir)
    if not root.is_dir():
        return removed
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        if m := WORK_DIR_NAME.match(d.name):
            job = store.jobs.get(m.group(1))
            if job is not None and job.get("state") == "running":
                continue  # its worker may be alive elsewhere; it removes the folder itself when done
        elif not ((w := WARMUP_DIR_NAME.match(d.name)) and not _alive(int(w.group(1)))):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_incomplete_blobs(store: Store, batch: int = 1000) -> int:
    """Delete blob chunks no manifest names; returns how many keys went. Only while no blob write can be under
    way (aotc-server's own embedded Redis, before its API and workers start)."""
    blobs: Any = store.blobs
    cleanup = getattr(blobs, "cleanup_incomplete", None)
    if callable(cleanup):
        return int(cleanup() or 0)
    prefix = keys.blob("", "")[:-1]  # "aotc:blob:"
    removed = 0
    pending: list[str] = []
    for key in store.r.scan_iter(match=f"{prefix}*", count=batch):
        pending.append(str(key))
        if len(pending) >= batch:
            removed += _sweep(store, prefix, pending)
            pending = []
    if pending:
        removed += _sweep(store, prefix, pending)
    return removed


def _sweep(store: Store, prefix: str, names: list[str]) -> int:
    # A chunk key ends in its number: blob:{kind}:{id}:{n}, or blob:{kind}:{id}:{gen}:{n} for a write with a
    # generation, whose chunks expire until the manifest that names them is written. Manifests never expire.
    chunks = [(k, k[len(prefix):].split(":")) for k in names]
    chunks = [(k, parts) for k, parts in chunks if len(parts) >= 3 and parts[-1].isdigit()]
    if not chunks:
        return 0
    pipe = store.r.pipeline(transaction=False)
    for k, parts in chunks:
        pipe.pttl(k)
        pipe.exists(keys.blob(parts[0], parts[1]))
    replies = cast(list[int], pipe.execute())
    doomed = [k for n, (k, parts) in enumerate(chunks)
              if replies[2 * n] > 0  # an unfinished write's chunk
              or (len(parts) == 3 and replies[2 * n] == -1 and not replies[2 * n + 1])]  # old layout, no manifest
    if doomed:
        store.r.delete(*doomed)
    return len(doomed)
