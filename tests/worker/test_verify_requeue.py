"""Which failed verify jobs a starting verifier queues again (worker.job.requeue_failed_verifies), on records in a
real Redis of its own: only those that failed for the machine's reasons, whose artifact is still not run on a target
the worker serves natively. A failed check, an artifact verified meanwhile or gone, another target, or a compile job
stays as it is. (tests/e2e/test_countersign.py runs the whole path with a killed verifier.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from compiler import cachekey
from compiler.errors import Failure
from service.store import Store, keys
from service.store.embedded import EmbeddedRedis
from worker.job import requeue_failed_verifies, submit_verify

V3, V2 = "cpu-x86_64-v3", "cpu-x86_64-v2"
LOST = Failure("WorkerLost", "worker w-1 stopped renewing its lease while the job was in stage 'check'", "check")
CRASHED = Failure("Crashed", "the check child was killed by SIGKILL", "check")
CHECK_FAILED = Failure("CheckFailed", "output 0 differs from eager by 3.1 (tolerance 1e-4)", "check")


@pytest.fixture
def store(tmp_path) -> Iterator[Store]:
    with EmbeddedRedis(tmp_path / "redis", die_with_parent=False) as r:
        s = Store(r.url)
        yield s
        s.close()


def _artifact(store: Store, tmp_path, target: str, mark: dict[str, Any]) -> dict[str, Any]:
    model_id = uuid.uuid4().hex * 2
    spec = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    factors = cachekey.factors(model_id, spec, target, {"torch": "2.13.0"}, {})
    key = cachekey.cache_key(factors)
    package = tmp_path / f"{key}.pt2"
    package.write_bytes(b"package " + key.encode())
    record = {"key": key, "factors": factors, "model_id": model_id, "target": target, "spec": spec, "options": {},
              "on_target": mark}
    store.artifacts.put(record, package)
    return record


def _failed_verify(store: Store, art: dict[str, Any], failure: Failure) -> str:
    job_id, _ = submit_verify(store, art["key"], art["target"], {
        "model_id": art["model_id"], "spec": art["spec"], "options": {}, "toolchain": {"torch": "2.13.0"},
        "factors": art["factors"], "max_attempts": 1, "priority": "interactive"})
    assert store.jobs.finish(job_id, "failed", error=failure)
    return job_id


def test_only_verify_jobs_the_machine_failed_on_an_unverified_artifact_are_queued_again(store, tmp_path):
    unverified = {"state": "unverified", "built_on": "cpu-x86_64-v4"}
    lost = _artifact(store, tmp_path, V3, unverified)
    crashed = _artifact(store, tmp_path, V3, unverified)
    refused = _artifact(store, tmp_path, V3, {**unverified, "state": "failed", "why": CHECK_FAILED.message})
    verified = _artifact(store, tmp_path, V3, {**unverified, "state": "verified", "by": "k"})
    elsewhere = _artifact(store, tmp_path, V2, unverified)
    gone = _artifact(store, tmp_path, V3, unverified)
    old = {name: _failed_verify(store, art, failure) for name, art, failure in [
        ("lost", lost, LOST), ("crashed", crashed, CRASHED), ("refused", refused, CHECK_FAILED),
        ("verified", verified, LOST), ("elsewhere", elsewhere, LOST), ("gone", gone, LOST)]}
    store.r.delete(keys.artifact(gone["key"]))  # evicted meanwhile
    compile_job, _ = store.jobs.submit(uuid.uuid4().hex, V3, {"model_id": "m", "spec": [], "options": {},
                                                              "toolchain": {}, "factors": {"target": V3}})
    assert store.jobs.finish(compile_job, "failed", error=LOST)

    queued = requeue_failed_verifies(store, [V3], max_attempts=10)
    jobs = {j["artifact"]: j for j in (store.jobs.get(i) for i in queued) if j}
    assert set(jobs) == {lost["key"], crashed["key"]}, jobs
    for art in (lost, crashed):
        job = jobs[art["key"]]
        assert job["kind"] == "verify" and job["state"] == "queued" and job["max_attempts"] == 10
        assert job["spec"] == art["spec"] and job["factors"] == art["factors"] and job["priority"] == "interactive"
        assert job["id"] not in old.values()
    # Queued once: a second verifier starting while they wait joins them instead of queuing more.
    time.sleep(0.01)
    assert requeue_failed_verifies(store, [V3], max_attempts=10) == []
