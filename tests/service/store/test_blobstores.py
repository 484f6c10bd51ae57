"""Every blob store through the same tests: round trip, digest, byte ranges, and a writer killed with SIGKILL midway.

`redis` runs on the session's redis-server, `file` on a temp dir, `s3` against moto's S3 server on loopback.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from procs import ROOT
from service.store import Store, keys
from service.store.blobs import PIECE, BlobError, BlobStore
from service.store.blobstore import Announced, StorageOptions, announce, local_root, open_blob_store
from service.store.blobstore.files import FileBlobs
from service.store.blobstore.redis_chunks import RedisBlobs
from service.store.embedded import EmbeddedRedis

HERE = Path(__file__).resolve().parent
CHUNK = 300_000  # the redis store's chunks in these tests: not a divisor of PIECE, so reads straddle chunks


def open_spec(spec: dict[str, Any]) -> BlobStore:
    """A blob store from a JSON-able description (the killed writer below opens the same one)."""
    if spec["kind"] == "redis":
        r = redis.Redis.from_url(spec["redis_url"], decode_responses=True)
        return RedisBlobs(r, redis.Redis.from_url(spec["redis_url"]), CHUNK)
    if spec["kind"] == "file":
        return FileBlobs(Path(spec["root"]))
    from service.store.blobstore.s3 import S3Blobs

    return S3Blobs(spec["url"], endpoint_url=spec["endpoint"], part_bytes=5 * 2**20)


@pytest.fixture(params=["redis", "file", "s3"])
def spec(request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path: Path) -> dict[str, Any]:
    if request.param == "redis":
        return {"kind": "redis", "redis_url": redis_server.url}
    if request.param == "file":
        return {"kind": "file", "root": str(tmp_path / "blobs")}
    endpoint = request.getfixturevalue("s3_endpoint")
    return {"kind": "s3", "url": f"s3://aotc-test/{uuid.uuid4().hex[:8]}", "endpoint": endpoint}


@pytest.fixture
def blobs(spec: dict[str, Any]) -> Any:
    store = open_spec(spec)
    yield store
    store.close()


def _id() -> str:
    return uuid.uuid4().hex


def test_round_trip(blobs: BlobStore, tmp_path: Path) -> None:
    data = os.urandom(2 * PIECE + 12_345)
    blob = _id()
    assert not blobs.exists("artifact", blob) and blobs.manifest("artifact", blob) is None
    m = blobs.put("artifact", blob, io.BytesIO(data))
    assert m == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert blobs.exists("artifact", blob) and blobs.manifest("artifact", blob) == m
    pieces = list(blobs.iter_range("artifact", blob))
    assert b"".join(pieces) == data and max(map(len, pieces)) <= PIECE  # bounded pieces, whatever the size
    assert blobs.to_file("artifact", blob, tmp_path / "out") == m["sha256"]
    assert (tmp_path / "out").read_bytes() == data
    assert blobs.read("artifact", blob, len(data)) == data
    with pytest.raises(ValueError, match="limit"):
        blobs.read("artifact", blob, len(data) - 1)
    assert not blobs.exists("model", blob)  # kinds are apart

    blobs.delete("artifact", blob)
    assert not blobs.exists("artifact", blob) and blobs.manifest("artifact", blob) is None
    with pytest.raises(KeyError):
        blobs.iter_range("artifact", blob)
    blobs.delete("artifact", blob)  # absent: fine


def test_digest_and_replacing_a_blob(blobs: BlobStore) -> None:
    blob = _id()
    empty = blobs.put("model", blob, io.BytesIO(b""))
    assert empty == {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    assert b"".join(blobs.iter_range("model", blob)) == b""
    data = os.urandom(CHUNK * 2 + 7)
    m = blobs.put("model", blob, io.BytesIO(data))  # the same id again: the new bytes, the new digest
    assert m["sha256"] == hashlib.sha256(data).hexdigest() and blobs.manifest("model", blob) == m
    assert b"".join(blobs.iter_range("model", blob)) == data


def test_byte_ranges(blobs: BlobStore) -> None:
    data = os.urandom(3 * CHUNK + 999)
    blob = _id()
    blobs.put("sources", blob, io.BytesIO(data))
    size = len(data)
    for start, end in [(0, 1), (5, 17), (CHUNK - 3, CHUNK + 3), (CHUNK, 2 * CHUNK), (1, size - 1),
                       (size - 1, size), (0, size), (2 * CHUNK + 11, None), (size - 10, size + 100), (7, 7)]:
        got = b"".join(blobs.iter_range("sources", blob, start, end))
        assert got == data[start:end], (start, end)
    with pytest.raises(ValueError, match="bad blob id"):
        blobs.put("sources", "../escape", io.BytesIO(b"x"))


_WRITER = """
import io, json, os, sys, time
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests", sys.argv[3]]
from test_blobstores import open_spec
spec = json.loads(sys.argv[1])
class Stalls(io.RawIOBase):
    # Hands over `n` random bytes, then says so and never hands over more: the parent kills it there.
    def __init__(self, n):
        self.left = n
    def readable(self):
        return True
    def read(self, size=-1):
        if self.left <= 0:
            print("stalled", flush=True)
            time.sleep(3600)
        size = self.left if size is None or size < 0 else min(size, self.left)
        self.left -= size
        return os.urandom(size)
open_spec(spec).put("artifact", spec["blob"], Stalls(spec["before_stall"]))
"""


def test_a_writer_killed_midway_leaves_nothing_visible(spec: dict[str, Any], tmp_path: Path) -> None:
    blob = _id()
    before_stall = 6 * 2**20 if spec["kind"] == "s3" else 3 * CHUNK + 5  # S3: past one 5 MB multipart part
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, json.dumps({**spec, "blob": blob, "before_stall": before_stall}),
         str(ROOT), str(HERE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() == b"stalled", (line, proc.stderr.read() if proc.stderr else b"")
        blobs = open_spec(spec)
        if spec["kind"] == "redis":  # its chunks are in Redis, none of them for good
            chunks = list(blobs.r.scan_iter(keys.blob(  # type: ignore[attr-defined]
                "artifact", blob) + ":*"))
            assert len(chunks) == 3 and all(blobs.r.pttl(k) > 0 for k in chunks)  # type: ignore[attr-defined]
        if spec["kind"] == "s3":  # wait for the first part to be in: the kill then lands mid-upload
            deadline = time.monotonic() + 30
            while not blobs.s3.list_multipart_uploads(Bucket="aotc-test").get("Uploads"):  # type: ignore[attr-defined]
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not blobs.exists("artifact", blob) and blobs.manifest("artifact", blob) is None
    with pytest.raises(KeyError):
        blobs.iter_range("artifact", blob)
    if spec["kind"] == "file":  # its bytes sit under a temp name only
        assert list((Path(spec["root"]) / ".tmp").glob(f"artifact-{blob}.*"))
        assert not (Path(spec["root"]) / "artifact").exists() or not list(
            (Path(spec["root"]) / "artifact").rglob(f"{blob}*"))

    data = os.urandom(CHUNK + 1)  # the next put of the same id works
    assert blobs.put("artifact", blob, io.BytesIO(data))["sha256"] == hashlib.sha256(data).hexdigest()
    assert b"".join(blobs.iter_range("artifact", blob)) == data
    blobs.close()


def test_blobs_written_to_redis_before_stay_readable(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """Switching AOTC_BLOB_STORE from redis to a file store keeps what Redis holds readable, including blobs in the
    layout from before chunks had a generation (a manifest without `gen` or `chunk_bytes`)."""
    store = Store(redis_server.url, storage=StorageOptions(blob_store=f"file://{tmp_path}/blobs"))
    old_id, data = _id(), os.urandom(150_000)
    store.raw.set(keys.blob_chunk("model", old_id, 0), data[:100_000])
    store.raw.set(keys.blob_chunk("model", old_id, 1), data[100_000:])
    store.r.hset(keys.blob("model", old_id), mapping={"size": len(data), "chunks": 2,
                                                        "sha256": hashlib.sha256(data).hexdigest()})
    assert store.blobs.exists("model", old_id)
    assert b"".join(store.blobs.iter_range("model", old_id, 99_990, 100_010)) == data[99_990:100_010]
    assert store.blobs.to_file("model", old_id, tmp_path / "m") == hashlib.sha256(data).hexdigest()
    new_id = _id()
    store.blobs.put("model", new_id, io.BytesIO(b"new"))
    assert not store.r.exists(keys.blob("model", new_id))  # new blobs go to the file store
    assert (tmp_path / "blobs" / "model" / new_id[:2] / f"{new_id}.json").exists()
    store.blobs.delete("model", old_id)
    assert not store.blobs.exists("model", old_id) and not store.raw.exists(keys.blob_chunk("model", old_id, 0))
    store.close()


def test_a_worker_without_a_setting_uses_the_store_the_api_announced(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        api = Store(server.url, storage=StorageOptions(blob_store=f"file://{tmp_path}/shared"))
        worker = Store(server.url)  # AOTC_BLOB_STORE unset: resolved at first use, after the API said
        api.check_redis(announce=True)
        api.blobs.put("model", "m1", io.BytesIO(b"hello"))
        assert isinstance(worker.blobs, Announced)
        assert worker.blobs.read("model", "m1", 100) == b"hello"
        assert worker.blobs.url == f"file://{tmp_path}/shared"

        # The same path on another machine is another volume: its .aotc-store-id differs, and the worker says so.
        other = FileBlobs(tmp_path / "elsewhere")
        server_r = api.r
        server_r.set(keys.BLOB_STORE, json.dumps({"url": other.url, "id": "not-" + other.store_id}))
        late = Store(server.url)
        with pytest.raises(BlobError, match="another volume"):
            late.blobs.exists("model", "m1")
        # A store the worker cannot see at all.
        server_r.set(keys.BLOB_STORE, json.dumps({"url": f"file://{tmp_path}/missing", "id": "x"}))
        with pytest.raises(BlobError, match="does not exist here"):
            Store(server.url).blobs.exists("model", "m1")
        # Explicitly told another volume than the API's: a warning at start.
        announce(server_r, api.blobs)
        mine = Store(server.url, storage=StorageOptions(blob_store=other.url))
        assert any("another volume" in w for w in mine.check_redis())
        for s in (api, worker, late, mine):
            s.close()


def test_a_worker_that_looks_before_the_api_announced_follows_the_announcement(tmp_path: Path) -> None:
    """A worker's disk watch asks for its blob store's dir before its first claim, which can be before any API has
    started: that answer (Redis, no dir) must not stick once the API announces a file store."""
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        worker = Store(server.url)
        assert local_root(worker.blobs) is None  # nothing announced yet: Redis
        api = Store(server.url, storage=StorageOptions(blob_store=f"file://{tmp_path}/shared"))
        api.check_redis(announce=True)
        api.blobs.put("model", "m1", io.BytesIO(b"hello"))
        assert local_root(worker.blobs) == (tmp_path / "shared").resolve()
        assert worker.blobs.read("model", "m1", 100) == b"hello"
        for s in (api, worker):
            s.close()


def test_unknown_store_url_names_the_setting(redis_server: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(redis_server.url)
    with pytest.raises(BlobError, match="AOTC_BLOB_STORE"):
        open_blob_store("ftp://x", r, r, StorageOptions())
