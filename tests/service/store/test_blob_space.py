"""Blob stores out of room: a file store on a full tmpfs raises ENOSPC and leaves nothing behind, and an S3 endpoint
that answers 507 InsufficientStorage (moto behind tests/service/full_s3.py) raises NoSpace, an ENOSPC OSError
naming the store, which the API answers with a 507 and a worker with a refunded hand-back."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from diskfull import MB, SmallDisk
from procs import stop
from service.store.blobstore.files import FileBlobs
from service.store.disk import NoSpace, is_disk_full
from service.store.embedded import free_port

PROXY = Path(__file__).resolve().parent.parent / "full_s3.py"


@pytest.fixture
def full_s3(s3_endpoint: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(the proxy's URL, the file whose presence makes it refuse writes)."""
    port, flag = free_port(), tmp_path / "FULL"
    proxy = subprocess.Popen([sys.executable, str(PROXY), s3_endpoint, str(port), str(flag)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and proxy.poll() is None, "the S3 proxy did not come up"
            time.sleep(0.1)
    yield url, flag
    stop(proxy)


def test_a_full_s3_store_raises_no_space_naming_the_store(full_s3: tuple[str, Path]) -> None:
    from service.store.blobstore.s3 import S3Blobs

    url, flag = full_s3
    store = S3Blobs(f"s3://aotc-space/{uuid.uuid4().hex[:8]}", endpoint_url=url, part_bytes=5 * MB)
    try:
        flag.touch()
        for size in (1000, 6 * MB):  # one PUT, and a multipart upload (boto3 wraps its failure differently)
            with pytest.raises(NoSpace) as caught:
                store.put("artifact", "a" * 32, io.BytesIO(os.urandom(size)))
            assert caught.value.errno == errno.ENOSPC and is_disk_full(caught.value)
            assert str(caught.value).startswith(f"the S3 store {store.url} is out of space: it refused artifact "
                                                "aaaaaaaaaaaa (")
            assert "InsufficientStorage: Insufficient storage to perform the operation" in str(caught.value)
        assert not store.exists("artifact", "a" * 32)
        flag.unlink()
        assert store.put("artifact", "a" * 32, io.BytesIO(b"fits"))["size"] == 4
    finally:
        store.close()


def test_a_full_file_store_raises_enospc_and_leaves_nothing(tmp_path: Path) -> None:
    disk = SmallDisk(tmp_path / "blobs", 16)
    try:
        store = FileBlobs(disk.path)
        disk.leave(MB)
        with pytest.raises(OSError) as caught:
            store.put("model", "b" * 64, io.BytesIO(os.urandom(2 * MB)))
        assert is_disk_full(caught.value)
        assert list((disk.path / ".tmp").iterdir()) == [] and not store.exists("model", "b" * 64)
        assert disk.free() >= MB - 64 * 1024  # the partial write's room is back
    finally:
        disk.close()
