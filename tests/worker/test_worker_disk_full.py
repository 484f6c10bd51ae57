"""ENOSPC on a worker is the machine's fault, not the job's, with real processes: the worker's work dir on a small
tmpfs of its own (tests/diskfull.py), filled while a compile runs. The job goes back with its attempt refunded,
the worker says why it claims nothing (which path, its free bytes, the setting), and once the disk is freed it
serves the same job by itself. A child that only claims a full disk gets its job handed back a bounded number of
times, and the worker, whose disk has room, stays healthy."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from diskfull import MB, SmallDisk
from modelzoo import MLP, export, seeded
from procs import ROOT, Cluster, api, stop
from worker.disk import DiskWatch
from worker.health import Health
from worker.isolation import setup
from worker.settings import WorkerSettings

pytestmark = pytest.mark.slow

LOW_WATER_MB = 16  # more than a compile of the small model below leaves in its work dir
COMPILING = ("load", "capture", "autograd", "lowering", "fusion")

# Makes `import torch` in aotc's compile and check children (never in the worker) fail as a full disk would, while
# the disk has plenty of room: the child's word alone.
SITECUSTOMIZE = '''
import errno
import sys


def _in_child():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"worker.child" in f.read().split(b"\\0")
    except OSError:
        return False


class _NoSpace:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise OSError(errno.ENOSPC, "No space left on device", "/planted/by/test_disk_full")
        return None


if _in_child():
    sys.meta_path.insert(0, _NoSpace())
'''


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    d = SmallDisk(tmp_path / "work", 768)  # room for a warm-up's precompiled headers (280 MB), if none are built
    yield d
    d.close()


def _submit(cluster: Cluster, tmp_path: Path, seed: int) -> dict[str, Any]:
    model = export(seeded(MLP, seed, d_in=4, hidden=8, d_out=4), (torch.randn(2, 4),), tmp_path / f"m{seed}.pt2")
    return cluster.submit(cluster.upload(model), {"x": [2, 4]})


def _hand_backs(cluster: Cluster, job_id: str) -> list[str]:
    return [ev["reason"] for _, ev in cluster.store.jobs.events(job_id) if ev.get("reason", "").startswith("handed")]


def test_a_disk_that_fills_during_a_compile_hands_the_job_back_and_the_worker_recovers_by_itself(
        disk: SmallDisk, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "svc", worker_env={"AOTC_WORK_DIR": str(disk.path),
                                                    "AOTC_DISK_LOW_WATER_MB": str(LOW_WATER_MB)})
    try:
        proc, wid = cluster.start_worker()
        job = _submit(cluster, tmp_path, 0)
        running = cluster.wait_for(job["id"], lambda j: j["state"] == "running" and j["stage"] in COMPILING)
        assert running["attempts"] == 1
        disk.fill()  # someone else fills the disk while the compile child works

        w = cluster.wait_worker(wid, healthy=False)
        reason = w["unhealthy_reason"]
        assert reason.startswith(f"disk full: {disk.path} has ") and " free of 768.0 MB, below " in reason
        assert f"below AOTC_DISK_LOW_WATER_MB={LOW_WATER_MB} ({LOW_WATER_MB:.1f} MB), so this worker claims no jobs " \
               "until there is room there" in reason
        # The job's own words are for an admin's view only: /readyz answers anyone, key or not.
        assert "ran out of disk space" not in reason
        assert w["last_disk_full"].startswith("the ") and "ran out of disk space on this worker" in w["last_disk_full"]

        # Handed back once, its attempt refunded, and not claimed again while the disk is full.
        queued = cluster.wait_for(job["id"], lambda j: j["state"] == "queued")
        assert (queued["attempts"], queued.get("failures"), queued["disk_full_refunds"]) == (0, None, "1")
        [handed] = _hand_backs(cluster, job["id"])
        assert handed.startswith(f"handed back by {wid} (the ") and "ran out of disk space on this worker" in handed
        ready = api.get(f"{cluster.url}/readyz", timeout=10).json()
        assert ready["degraded"] is True and [u["id"] for u in ready["unhealthy_workers"]] == [wid]
        assert ready["unhealthy_workers"][0]["reason"] == reason and "last_disk_full" not in json.dumps(ready)
        time.sleep(5)
        assert cluster.job(job["id"])["state"] == "queued" and cluster.job(job["id"])["attempts"] == 0
        assert cluster.workers()[wid]["healthy"] is False and proc.poll() is None

        # Room again: the worker sees it by itself and serves the same job, without a new request.
        disk.empty()
        back = cluster.wait_worker(wid, healthy=True, timeout=30)
        assert back["unhealthy_reason"] is None
        done = cluster.wait_end(job["id"], timeout=300)
        assert done["state"] == "succeeded", done.get("error")
        assert (done["attempts"], done["worker"], done.get("failures")) == (1, wid, None)
        assert api.get(f"{cluster.url}/readyz", timeout=10).json()["degraded"] is False
    finally:
        cluster.close()


def test_a_child_that_only_says_the_disk_is_full_is_refunded_a_bounded_number_of_times(tmp_path: Path) -> None:
    """Every child raises ENOSPC in `import torch` though the disk has room: each attempt is handed back refunded
    until the job has been refunded max_attempts times, then charged; the job ends, failed as DiskFull, and the
    worker, whose disks it measures itself, never stops serving."""
    planted = tmp_path / "enospc"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(SITECUSTOMIZE)
    cluster = Cluster(tmp_path / "svc", env={"AOTC_JOB_MAX_ATTEMPTS": "2"},
                      worker_env={"AOTC_RETRY_BACKOFF_S": "0", "AOTC_DISK_LOW_WATER_MB": "1"})
    try:
        proc, wid = cluster.start_worker(PYTHONPATH=os.pathsep.join([str(ROOT), str(planted)]))
        job = _submit(cluster, tmp_path, 1)
        done = cluster.wait_end(job["id"], timeout=240)
        assert done["state"] == "failed"
        err = done["error"]
        assert err["type"] == "DiskFull" and err["attempts"] == 2
        assert err["message"].startswith("the compile ran out of disk space on this worker, not through the job's "
                                         "fault: its output says ")
        assert "No space left on device" in err["message"] and err["message"].endswith("(attempt 2 of 2; no attempts "
                                                                                       "left)")
        assert done["disk_full_refunds"] == "2" and len(_hand_backs(cluster, job["id"])) == 2
        assert [f["type"] for f in done["failures"]] == ["DiskFull", "DiskFull"]
        w = cluster.workers()[wid]
        assert w["healthy"] is True and w["early_crashes"] == 0  # not a broken toolchain either
    finally:
        stop(proc)
        cluster.close()


def test_the_disk_watch_and_the_judgement_of_a_child_on_a_real_full_disk(disk: SmallDisk, tmp_path: Path) -> None:
    """In-process, with real children (unconfined) writing to the small disk: a full disk makes the worker
    unhealthy with the path and its free bytes; a child that dies of it fails as DiskFull (not BrokenEnvironment);
    the worker's own ENOSPC too; room again makes it healthy."""
    sandbox = setup(WorkerSettings(sandbox="off", work_dir=disk.path, data_dir=tmp_path / "data"), "cpu")
    health = Health(3, DiskWatch(lambda: [disk.path], 4))
    assert health.check_disk() and health.describe()["healthy"] is True

    disk.leave(MB)  # a little room, below the mark
    assert not health.check_disk()
    described = health.describe()
    assert described["healthy"] is False and described["unhealthy_since"] is not None
    assert described["unhealthy_reason"].startswith(f"disk full: {disk.path} has 1.0 MB free of 768.0 MB, below "
                                                    "AOTC_DISK_LOW_WATER_MB=4 (4.0 MB)")

    disk.leave(4096)  # one page: the worker writes the child's task, and the child finds no room for a byte
    out = health.run_child({"kind": "probe", "device": "cpu"}, disk.path / "probe", sandbox=sandbox, device="cpu",
                           timeout_s=120)
    assert out.failure is not None and out.failure.type == "DiskFull" and out.failure.retryable
    assert out.failure.message.startswith("the probe ran out of disk space on this worker")
    assert f"{disk.path} has " in out.failure.message and "(AOTC_DISK_LOW_WATER_MB=4)" in out.failure.message
    assert health.early_crashes == 0  # a full disk is not a broken toolchain

    disk.fill()
    with pytest.raises(OSError) as caught:
        (disk.path / "model.pt2").write_bytes(os.urandom(MB))
    assert caught.value.errno == errno.ENOSPC
    own = health.disk_failure("fetch", caught.value)
    assert own.type == "DiskFull" and own.message.startswith("the fetch ran out of disk space on this worker, not "
                                                             "through the job's fault: OSError: [Errno 28] No space")
    assert not health.check_disk() and health.describe()["last_disk_full"].startswith("the fetch ran out of disk")
    assert "ran out of disk" not in health.describe()["unhealthy_reason"]

    disk.empty()
    assert health.check_disk() and health.describe() == {"healthy": True, "unhealthy_reason": None,
                                                         "unhealthy_since": None, "early_crashes": 0,
                                                         "last_disk_full": None}
