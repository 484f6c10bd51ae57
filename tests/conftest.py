"""Real parts for the tests: a redis-server on a free port, the API served by uvicorn over HTTP in its own
process, and a real worker process running the real compiler on the CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from procs import ADMIN_KEY, DISK_LOW_WATER_MB, MAX_UPLOAD_MB, ROOT, start_api, start_worker, stop, wait_workers
from service.store import Store
from service.store.embedded import EmbeddedRedis

# The SDK and the CLI the tests run (in this process or as subprocesses) authenticate with the admin key.
os.environ["AOTC_API_KEY"] = ADMIN_KEY
# Every service and worker the tests start inherits it (the disk-full tests set their own).
os.environ.setdefault("AOTC_DISK_LOW_WATER_MB", str(DISK_LOW_WATER_MB))
# A worker alone on its device lets the check time itself when the device lock is free (AOTC_TIMING_PASS=auto): a
# timing child per compile would add seconds to every compile of the suite. tests/worker/test_devlock.py holds the
# lock from another process to run the farm's path (the check untimed, then the timing pass).
os.environ.setdefault("AOTC_TIMING_PASS", "auto")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def store(redis_server: EmbeddedRedis) -> Iterator[Store]:
    s = Store(redis_server.url)
    yield s
    s.close()


@pytest.fixture(scope="session")
def service_env(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    data = tmp_path_factory.mktemp("aotc")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "AOTC_REDIS_URL": redis_server.url,
        "AOTC_DATA_DIR": str(data),
        "AOTC_WORK_DIR": str(data / "work"),
        "AOTC_MAX_UPLOAD_MB": str(MAX_UPLOAD_MB),
        "AOTC_DEVICE": "cpu",
        "AOTC_ADMIN_KEY": ADMIN_KEY,
        # A compile pauses while another worker's timing pass holds the device (AOTC_TIMING_PAUSE), 300 s at most;
        # test_devlock.py holds it through a whole job, as a pass that hangs would.
        "AOTC_TIMING_PAUSE_MAX_S": "5",
    }


@pytest.fixture(scope="session")
def api_url(service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = start_api(service_env, tmp_path_factory.mktemp("logs") / "api.log")
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def worker(service_env: dict[str, str], store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One real CPU worker for the session; yields its registry record."""
    proc = start_worker(service_env, tmp_path_factory.mktemp("logs") / "worker.log")
    live = wait_workers(store)
    yield live[0]
    stop(proc)


@pytest.fixture
def client(api_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    from client import Client

    with Client(api_url, cache_dir=tmp_path / "cache", timeout=120) as c:
        yield c
