"""One job's claim, in-process against a real Redis, without compiles: the ways a claim ends a job for good, and
the failure records they leave (compiler.errors.Failure) as the API shows them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import redis

from service.store import Lease, Store, keys
from worker.main import Worker
from worker.settings import WorkerSettings

INFO = {"host": "test", "device": "cpu", "device_name": "test", "toolchain": {"torch": "x"}}
FIELDS = {"model_id": "no-such-model", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {},
          "max_attempts": 3}


def _worker(store: Store, tmp_path: Path) -> Worker:
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = Worker(WorkerSettings(redis_url=store.url, poll_ms=100, work_dir=tmp_path), {**INFO, "target": target})
    w.store.queues.ensure(target)
    return w


def _run_next(w: Worker, **fields: Any) -> dict[str, Any]:
    """Submit a job, let the worker read and process it; returns the job record after."""
    job_id, _ = w.store.jobs.submit(uuid.uuid4().hex, w.target, {**FIELDS, **fields})
    msg = w.next_message()
    assert msg is not None and msg[1] == job_id
    w.runner.process(*msg)
    job = w.store.jobs.get(job_id)
    assert job is not None
    return job


def test_a_job_keyed_for_another_toolchain_fails_at_claim(store, tmp_path):
    w = _worker(store, tmp_path)
    job = _run_next(w, toolchain={"torch": "other"})
    assert job["state"] == "failed" and job["attempts"] == 1
    assert job["error"] == {"type": "ToolchainMismatch", "stage": "claim", "excerpt": "", "retryable": False,
                            "message": "job was keyed for toolchain {'torch': 'other'}, but this worker runs "
                                       "{'torch': 'x'}"}


def test_a_job_whose_model_is_gone_fails_at_fetch_without_a_retry(store, tmp_path):
    w = _worker(store, tmp_path)
    job = _run_next(w)
    assert job["state"] == "failed" and job["attempts"] == 1
    err = job["error"]
    assert (err["type"], err["stage"], err["retryable"]) == ("NotFound", "fetch", False)
    assert err["message"] == "model no-such-model is gone from the store"  # final: no "attempts left" suffix
    assert err["failures"] == [{"attempt": 1, "worker": w.id, "type": "NotFound", "stage": "fetch",
                                "message": "model no-such-model is gone from the store"}]


def test_a_job_claimed_past_its_attempts_gives_up_with_its_last_failure(store, tmp_path):
    w = _worker(store, tmp_path)
    job_id, _ = w.store.jobs.submit(uuid.uuid4().hex, w.target, {**FIELDS, "max_attempts": 1})
    # An odd history: attempt 1 was lost, and the job went back in line without the reaper failing it.
    [(lease, _)] = store.queues.read("gone", [keys.queue(w.target, "interactive")])
    assert store.jobs.start(job_id, lease) == ("running", 1)
    last = {"attempt": 1, "worker": "gone", "type": "WorkerLost", "stage": "fetch", "message": "worker lost: gone"}
    assert store.jobs.requeue(job_id, lease, expect_state="running", failures=[last])

    msg = w.next_message()
    assert msg is not None and msg[1] == job_id
    w.runner.process(*msg)
    job = store.jobs.get(job_id)
    assert job["state"] == "failed" and job["attempts"] == 2
    err = job["error"]
    assert (err["type"], err["stage"], err["excerpt"], err["retryable"]) == ("WorkerLost", "fetch", "", False)
    assert err["message"] == "gave up after 1 attempts; last: worker lost: gone"
    assert [f["attempt"] for f in err["failures"]] == [1, 2]
    assert job_id in store.r.lrange(keys.DEADLETTER, 0, 50)


def test_a_job_that_loses_redis_mid_run_is_handed_back_unspent_once_redis_answers(store, tmp_path, monkeypatch):
    w = _worker(store, tmp_path)
    job_id, _ = w.store.jobs.submit(uuid.uuid4().hex, w.target, FIELDS)

    def redis_goes_away(job: dict[str, Any], workdir: Path) -> Any:
        raise redis.ConnectionError("connection refused")

    renew, calls = w.store.leases.renew, []

    def renew_while_down(lease: Lease) -> bool:  # Redis answers again on the third try
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise redis.ConnectionError("connection refused")
        return renew(lease)

    monkeypatch.setattr(w.runner, "_compile_and_check", redis_goes_away)
    monkeypatch.setattr(w.store.leases, "renew", renew_while_down)
    msg = w.next_message()
    assert msg is not None and msg[1] == job_id
    w.runner.process(*msg)
    job = store.jobs.get(job_id)
    assert (job["state"], job["attempts"], job.get("worker")) == ("queued", 0, None)  # the attempt was refunded
    assert len(calls) == 3 and calls[-1] - calls[0] >= 1.0  # waited with backoff, not in a tight loop
    assert w.runner.current is None
