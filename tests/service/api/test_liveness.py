"""/healthz is liveness: it fails, naming why, when an API process is wedged (service/api/liveness.py), and never
because Redis is down (tests/service/api/test_redis_supervised.py shows that half)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx

from procs import Cluster, api
from service.store import Store

STALL_S = 2.0


def _answer(url: str) -> tuple[int, dict]:
    try:
        r = api.get(url, timeout=5)
    except httpx.TransportError as e:
        return 0, {"transport": repr(e)}
    return r.status_code, r.json()


def _until(url: str, status: int, timeout: float) -> dict:
    deadline, seen = time.monotonic() + timeout, (0, {})
    while time.monotonic() < deadline:
        seen = _answer(url)
        if seen[0] == status:
            return seen[1]
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s; the last answer: {seen}")


def _artifact_with_sources(store: Store, tmp_path: Path) -> tuple[str, Path]:
    """A report-only artifact whose sources are in the API's file blob store; its key and its sources' manifest."""
    zipped = tmp_path / "sources.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("code/wrapper.cpp", "// generated\n")
    key = "ab" * 16
    record = {"key": key, "factors": {"model": "cd" * 32}, "model_id": "cd" * 32, "target": "cpu-x86_64-avx2",
              "spec": {"inputs": []}, "options": {}}
    blob = store.artifacts.put(record, None, report={"stages": {}}, sources=zipped)["blob"]
    return key, tmp_path / "data" / "blobs" / "sources" / blob[:2] / f"{blob}.json"


def test_a_thread_pool_stuck_on_a_hung_disk_fails_healthz_and_readyz_naming_it_then_recovers(tmp_path):
    # The blob store's files on a disk that hangs, as a hard NFS mount does when its server goes away: the
    # sources' manifest becomes a FIFO, whose open() blocks until a writer comes. Every request that reads it holds
    # one thread of the API's pool until then.
    cluster = Cluster(tmp_path / "data", env={"AOTC_LIVENESS_STALL_S": str(STALL_S)})
    pool = cf.ThreadPoolExecutor(60)
    try:
        url = cluster.url
        assert _answer(f"{url}/healthz") == (200, {"ok": True})
        store = Store(cluster.redis.url)
        try:
            key, manifest = _artifact_with_sources(store, tmp_path)
        finally:
            store.close()
        assert api.get(f"{url}/v1/artifacts/{key}/source").status_code == 200
        saved = manifest.read_bytes()
        manifest.unlink()
        os.mkfifo(manifest)

        def read_sources() -> None:
            try:
                api.get(f"{url}/v1/artifacts/{key}/source", timeout=3)
            except httpx.TransportError:
                pass  # the client gives up; the server's thread stays stuck in open()

        t0 = time.monotonic()
        for _ in range(48):  # more than the pool's 40 threads
            pool.submit(read_sources)
        wedged = _until(f"{url}/healthz", 503, 30)
        took = time.monotonic() - t0
        assert wedged["error"]["code"] == "wedged", wedged
        message = wedged["error"]["message"]
        assert "every one of the 40 threads of this API process's pool has been held by the same requests" \
            in message and f"AOTC_LIVENESS_STALL_S={STALL_S:g}" in message, message
        ready = _answer(f"{url}/readyz")
        assert ready[0] == 503 and ready[1]["error"]["code"] == "not_ready", ready
        assert "pool" in ready[1]["error"]["message"], ready

        # The disk comes back: the stuck opens return (a writer opens the FIFO and closes it), and the manifest is
        # a file again for the requests still waiting for a thread.
        stuck = tmp_path / "stuck-fifo"
        os.link(manifest, stuck)
        spare = manifest.with_suffix(".restored")
        spare.write_bytes(saved)
        os.replace(spare, manifest)
        os.close(os.open(stuck, os.O_WRONLY | os.O_NONBLOCK))
        assert _until(f"{url}/healthz", 200, 30) == {"ok": True}
        assert _until(f"{url}/readyz", 200, 10)["ok"] is True
        assert api.get(f"{url}/v1/artifacts/{key}/source").status_code == 200
        print(f"\n/healthz 503 (thread pool stuck) {took:.1f} s after the disk hung (AOTC_LIVENESS_STALL_S="
              f"{STALL_S:g}), 200 again once it came back: {wedged}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        cluster.close()


def test_a_background_task_that_ended_or_stopped_making_progress_is_named():
    from service.api.liveness import Liveness

    async def crashes(done: Callable[[], None]) -> None:
        done()
        raise RuntimeError("a bug in the reaper")

    async def hangs(done: Callable[[], None]) -> None:
        done()
        await asyncio.Event().wait()  # a round that never finishes

    async def well(done: Callable[[], None]) -> None:
        while True:
            done()
            await asyncio.sleep(0.05)

    async def main() -> tuple[list[str], list[str]]:
        liveness = Liveness(stall_s=0.2)
        try:
            liveness.start("reaper", crashes, every_s=0.1)
            liveness.start("sweeper", hangs, every_s=0.1)
            liveness.start("monitor", well, every_s=0.1)
            await asyncio.sleep(0.05)
            early = liveness.problems()
            await asyncio.sleep(0.5)
            return early, liveness.problems()
        finally:
            await liveness.stop()

    early, late = asyncio.run(main())
    assert early == ["the reaper task has ended (it raised RuntimeError('a bug in the reaper')); restart this API "
                     "process"]
    assert len(late) == 2 and late[0] == early[0], late
    assert re.fullmatch(r"the sweeper task has made no progress for 0\.\d s \(AOTC_LIVENESS_STALL_S=0\.2\)",
                        late[1]), late


def test_a_watched_task_may_idle_but_not_end():
    """The event reader waits as long as no one streams (Liveness.watch): idle is well, ended is wedged."""
    from service.api.liveness import Liveness

    async def main() -> tuple[list[str], list[str]]:
        liveness = Liveness(stall_s=0.05)
        idle = asyncio.Event()
        reader = asyncio.create_task(idle.wait())
        liveness.watch("event reader", reader)
        try:
            await asyncio.sleep(0.3)  # far past the stall time, with no progress reported
            quiet = liveness.problems()
            reader.cancel()
            await asyncio.sleep(0)
            return quiet, liveness.problems()
        finally:
            await liveness.stop()

    quiet, ended = asyncio.run(main())
    assert quiet == []
    assert ended == ["the event reader task has ended (it was cancelled); restart this API process"]
