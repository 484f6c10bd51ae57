"""A full disk is a clear 507, never a 500: the API's data dir (its upload spool and its file blob store) on a small
tmpfs of its own, filled by a test; an S3 endpoint that answers 507 InsufficientStorage. A re-upload of a model the
service holds succeeds on a full disk, since its body is hashed even where it cannot be written."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from diskfull import MB, SmallDisk
from modelzoo import MLP, export, seeded
from procs import Cluster, api, stop
from service.store.embedded import free_port

LOW_WATER_MB = 8
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallDisk]:
    d = SmallDisk(tmp_path_factory.mktemp("disk") / "data", 64)
    yield d
    d.close()


@pytest.fixture(scope="module")
def cluster(disk: SmallDisk, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Redis keeps its data off the small disk (in the cluster's own dir): here only the API's writes meet it.
    c = Cluster(tmp_path_factory.mktemp("full-disk"),
                env={"AOTC_DATA_DIR": str(disk.path), "AOTC_DISK_LOW_WATER_MB": str(LOW_WATER_MB)})
    yield c
    c.close()


def _model(tmp: Path, seed: int) -> bytes:
    """About 2.1 MB: big enough that the disk's few MB matter."""
    model = seeded(MLP, seed, d_in=256, hidden=2048, d_out=8)
    return export(model, (torch.randn(2, 256),), tmp / f"mlp{seed}.pt2").read_bytes()


def _chunked(body: bytes) -> Iterator[bytes]:
    """The body as a stream without Content-Length: nothing to check up front, the disk fills mid-write."""
    for at in range(0, len(body), 256 * 1024):
        yield body[at:at + 256 * 1024]


def _partial(disk: SmallDisk) -> list[str]:
    """What a refused upload could leave: files in the spool and in the blob store's temp dir."""
    return sorted(str(p) for d in (disk.path / "uploads", disk.path / "blobs" / ".tmp") if d.is_dir()
                  for p in d.iterdir())


@pytest.fixture(scope="module")
def models(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A model the service holds (uploaded while there was room) and one it does not."""
    tmp = tmp_path_factory.mktemp("models")
    stored, new = _model(tmp, 1), _model(tmp, 2)
    first = api.post(f"{cluster.url}/v1/models", content=stored, timeout=60)
    assert first.status_code == 201, first.text
    return stored, new


@pytest.fixture
def full(disk: SmallDisk) -> Iterator[SmallDisk]:
    yield disk
    disk.empty()


def test_an_upload_that_would_pass_the_low_water_mark_is_refused_before_a_byte_is_written(
        cluster: Cluster, models: tuple[bytes, bytes], full: SmallDisk) -> None:
    stored, new = models
    # Room for the upload itself, but not for it twice (spool and blob store share this disk) above the mark.
    full.leave(10 * MB)
    before = full.free()
    refused = api.post(f"{cluster.url}/v1/models", content=new, timeout=60)
    assert refused.status_code == 507, refused.text
    err = refused.json()["error"]
    assert err["code"] == "disk_full" and err["setting"] == "AOTC_DISK_LOW_WATER_MB"
    assert refused.headers["retry-after"] == "30"
    assert f"{full.path}/uploads, which has {before / MB:.1f} MB free" in err["message"]
    assert f"AOTC_DISK_LOW_WATER_MB={LOW_WATER_MB} keeps {LOW_WATER_MB:.1f} MB free" in err["message"]
    assert err["free_bytes"] == before and err["needed_bytes"] == 2 * len(new)
    assert full.free() == before and _partial(full) == []
    assert api.get(f"{cluster.url}/v1/models/{hashlib.sha256(new).hexdigest()}").status_code == 404
    # What it already holds still uploads (the CLI's first step), refused nothing.
    assert api.post(f"{cluster.url}/v1/models", content=stored, timeout=60).status_code == 200


def test_on_a_full_disk_a_stored_model_re_uploads_and_a_new_one_is_a_507(
        cluster: Cluster, models: tuple[bytes, bytes], full: SmallDisk) -> None:
    stored, new = models
    full.fill()
    # With Content-Length (refused up front, hashed without a write) and without (the first write fails).
    for body in (stored, _chunked(stored)):
        again = api.post(f"{cluster.url}/v1/models", content=body, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["id"] == hashlib.sha256(stored).hexdigest()
    for body in (new, _chunked(new)):
        refused = api.post(f"{cluster.url}/v1/models", content=body, timeout=60)
        assert refused.status_code == 507, refused.text
        assert refused.json()["error"]["code"] == "disk_full" and refused.headers["retry-after"] == "30"
        assert "0 bytes free" in refused.json()["error"]["message"]
        assert "AOTC_DISK_LOW_WATER_MB" in refused.json()["error"]["message"]
    assert _partial(full) == []
    full.empty()
    assert api.post(f"{cluster.url}/v1/models", content=new, timeout=60).status_code == 201


def test_a_disk_that_fills_during_the_write_is_a_507_and_the_partial_file_goes(
        cluster: Cluster, models: tuple[bytes, bytes], full: SmallDisk, tmp_path: Path) -> None:
    other = _model(tmp_path, 4)
    full.leave(1 * MB)  # less than the model: no Content-Length, so the write itself meets the full disk
    midway = api.post(f"{cluster.url}/v1/models", content=_chunked(other), timeout=60)
    assert midway.status_code == 507, midway.text
    message = midway.json()["error"]["message"]
    assert message.startswith("the disk filled while spooling the upload (after ")
    assert f"{full.path}/uploads has " in message and "free of 64.0 MB" in message
    assert f"(AOTC_DISK_LOW_WATER_MB={LOW_WATER_MB} keeps {LOW_WATER_MB:.1f} MB free)" in message
    assert _partial(full) == [] and full.free() >= 1 * MB - 64 * 1024  # its room is back
    assert api.get(f"{cluster.url}/v1/models/{hashlib.sha256(other).hexdigest()}").status_code == 404


def test_a_full_s3_store_is_a_507_naming_the_store(s3_endpoint: str, tmp_path: Path) -> None:
    """moto stands behind a proxy that answers every write with S3's 507 InsufficientStorage while a file says so."""
    port, full = free_port(), tmp_path / "FULL"
    proxy = subprocess.Popen([sys.executable, str(HERE.parent / "full_s3.py"), s3_endpoint, str(port), str(full)])
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proxy.poll() is None, "the S3 proxy did not come up"
                time.sleep(0.1)
        c = Cluster(tmp_path, env={"AOTC_BLOB_STORE": "s3://aotc-full/m", "AOTC_S3_ENDPOINT_URL": endpoint})
        url = c.url
        try:
            body = _model(tmp_path, 3)
            full.touch()
            refused = api.post(f"{url}/v1/models", content=body, timeout=60)
            assert refused.status_code == 507, refused.text
            err = refused.json()["error"]
            assert err["code"] == "disk_full" and refused.headers["retry-after"] == "30"
            assert err["message"].startswith("the S3 store s3://aotc-full/m/ is out of space: it refused model ")
            assert "InsufficientStorage: Insufficient storage to perform the operation" in err["message"]
            full.unlink()
            assert api.post(f"{url}/v1/models", content=body, timeout=60).status_code == 201
        finally:
            c.close()
    finally:
        stop(proxy)


def test_a_redis_that_cannot_write_its_aof_is_a_507(tmp_path: Path) -> None:
    """The whole data dir on the small disk, as `make serve` keeps it (the embedded Redis's AOF too): once the AOF
    cannot be written, Redis refuses writes (MISCONF), which is a 507 that says so, not a 503 to retry in 2 s."""
    small = SmallDisk(tmp_path / "data", 64)
    cluster = Cluster(small.path, env={"AOTC_DISK_LOW_WATER_MB": "0"})
    try:
        assert api.post(f"{cluster.url}/v1/keys", json={"scope": "pull", "namespace": "a"}).status_code == 201
        small.fill()
        deadline = time.monotonic() + 30
        while True:  # Redis learns that its AOF cannot be written at its next write of it (each second)
            r = api.post(f"{cluster.url}/v1/keys", json={"scope": "pull", "namespace": "a"})
            if r.status_code != 201 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "insufficient_storage" and r.headers["retry-after"] == "30"
        assert err["message"].startswith("Redis refuses writes: it cannot write to its disk (MISCONF ")
        assert "No space left on device" in err["message"]
        small.empty()
        deadline = time.monotonic() + 30
        while (r := api.post(f"{cluster.url}/v1/keys", json={"scope": "pull", "namespace": "a"})).status_code != 201:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)
    finally:
        cluster.close()
        small.close()
