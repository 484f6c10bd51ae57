"""A verify job that failed for the machine's reasons heals without a person: its verifier is killed mid-check
(`kill -9`, a lost worker) and the job, out of attempts, fails for good; the next worker that starts serving the
target natively queues it again, checks the package there and countersigns it. Real processes: a redis-server, the
API over HTTP (its reaper takes the dead verifier's lease), a builder and two verifiers running the real compiler on
the CPU levels (AOTC_BUILD_ONLY_TARGETS, as tests/e2e/test_countersign.py)."""

from __future__ import annotations

import json
import os
import platform
import signal
import time

import pytest
import torch

from compiler.signing import Signer
from modelzoo import MLP, export, seeded
from procs import Cluster, api, stop

pytestmark = [pytest.mark.slow, pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")]

V3 = "cpu-x86_64-v3"
LEVELS = [f"cpu-x86_64-v{n}" for n in range(1, 5)]
LEASE_S = 4.0


def test_a_verify_job_lost_with_its_worker_is_queued_again_by_the_next_verifier(tmp_path):
    from compiler.targets import detect_cpu_target

    if LEVELS.index(str(detect_cpu_target())) < LEVELS.index(V3):
        pytest.skip("this host cannot build or check a v3 package")
    lease = {"AOTC_LEASE_S": str(LEASE_S), "AOTC_REAP_INTERVAL_S": "0.5"}
    cluster = Cluster(tmp_path / "c", env=lease, worker_env={"AOTC_HEARTBEAT_S": "1"})
    try:
        builder = Signer.from_file(tmp_path / "keys" / "builder.pem", create=True)
        verifier = Signer.from_file(tmp_path / "keys" / "verifier.pem", create=True)
        # One attempt per verify job (the builder's setting: it queues them), so one lost worker fails it for good.
        proc, _ = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]), AOTC_BUILD_ONLY_TARGETS=json.dumps([V3]),
                                       AOTC_SIGNING_KEY_FILE=str(builder.path), AOTC_VERIFY_MAX_ATTEMPTS="1")
        model = seeded(MLP, 43)
        job = cluster.submit(cluster.upload(export(model, (torch.randn(4, 32),), tmp_path / "mlp.pt2")),
                             {"x": [4, 32]}, target=V3)
        done = cluster.wait_end(job["id"], timeout=600)
        assert done["state"] == "succeeded", done
        key = done["artifact"]
        stop(proc)
        (first,) = [j for j in cluster.store.jobs.recent(20) if j.get("kind") == "verify"]
        assert first["max_attempts"] == 1

        # A verifier that dies in the middle of its check: the API's reaper takes its lease, and with no attempt
        # left the verify job fails for good (WorkerLost), leaving the artifact not run on its target.
        doomed, doomed_id = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]),
                                                 AOTC_SIGNING_KEY_FILE=str(verifier.path))
        cluster.wait_for(first["id"], lambda j: j["state"] == "running" and j.get("stage") == "check", 300)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()
        failed = cluster.wait_end(first["id"], timeout=60)
        assert failed["state"] == "failed" and failed["error"]["type"] == "WorkerLost", failed
        assert doomed_id in failed["error"]["message"]
        meta = api.get(f"{cluster.url}/v1/artifacts/{key}/meta", timeout=30).json()
        assert meta["on_target"]["state"] == "unverified"

        # The next worker that serves v3 natively queues it again at its start, checks it and countersigns.
        t0 = time.monotonic()
        healthy_log = cluster.base / f"worker-{len(cluster.procs)}.log"  # as Cluster.start_worker names it
        healthy, healthy_id = cluster.start_worker(AOTC_WORKER_TARGETS=json.dumps([V3]),
                                                   AOTC_SIGNING_KEY_FILE=str(verifier.path))
        try:
            again = [j for j in cluster.store.jobs.recent(20) if j.get("kind") == "verify" and j["id"] != first["id"]]
            assert len(again) == 1, again
            done = cluster.wait_end(again[0]["id"], timeout=300)
        finally:
            stop(healthy)
        assert done["state"] == "succeeded" and done["worker"] == healthy_id, done
        assert done["artifact"] == key and done["max_attempts"] == 10  # the verifier's own setting (the default)
        mark = api.get(f"{cluster.url}/v1/artifacts/{key}/meta", timeout=30).json()["on_target"]
        assert mark["state"] == "verified" and mark["by"] == verifier.kid and mark["worker"] == healthy_id, mark
        log = healthy_log.read_text(errors="replace")
        assert f"its verify job {first['id']} failed for the machine's reasons (WorkerLost" in log, log[-3000:]
        print(f"\nverify job lost with its worker, failed for good; queued again by the next verifier and "
              f"countersigned {time.monotonic() - t0:.1f} s after it started")
    finally:
        cluster.close()
