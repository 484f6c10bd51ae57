"""A real S3-protocol server for the blob store tests: moto's standalone server on loopback, in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from procs import api, stop
from service.store.embedded import free_port

# moto accepts any credentials; boto3 needs some to sign with.
S3_ENV = {"AWS_ACCESS_KEY_ID": "aotc-test", "AWS_SECRET_ACCESS_KEY": "aotc-test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a moto S3 server; the AWS_* variables boto3 signs with are set in this process too."""
    port = free_port()
    log = Path(tmp_path_factory.mktemp("s3")) / "moto.log"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"moto exited: {log.read_text()[-2000:]}"
        try:
            api.get(url, timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "moto did not answer in 60 s"
            time.sleep(0.1)
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop(proc)
