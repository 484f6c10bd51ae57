"""Job transitions, leases and the reaper against a real Redis, without compiles.

Each test uses its own made-up target, so its queue streams are its own and no real worker reads them.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from compiler.errors import Failure
from procs import api
from service.store import Lease, Store, keys
from service.store.reaper import reap_all


def _target() -> str:
    return f"cpu-test-{uuid.uuid4().hex[:8]}"


def _submit(store: Store, target: str, priority: str = "interactive", max_attempts: int = 3) -> str:
    job_id, created = store.jobs.submit(uuid.uuid4().hex, target, {
        "model_id": "m", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {},
        "max_attempts": max_attempts}, priority=priority)
    assert created
    return job_id


def _take(store: Store, target: str, worker: str, priority: str = "interactive") -> tuple[Lease, str]:
    """Read the next entry as `worker` would, and start its job."""
    [(lease, job_id)] = store.queues.read(worker, [keys.queue(target, priority)])
    assert store.jobs.start(job_id, lease)[0] == "running"
    return lease, job_id


def _pending(store: Store, stream: str) -> int:
    return int(store.r.xpending(stream, keys.QUEUE_GROUP)["pending"])


def test_many_reapers_at_once_requeue_each_lost_job_exactly_once(store):
    target = _target()
    jobs = [_submit(store, target) for _ in range(6)]
    for _ in jobs:
        _take(store, target, "dead-worker")
    time.sleep(0.3)  # every lease is now older than the 0.2 s lease below

    results: list[tuple[str, str]] = []
    barrier = threading.Barrier(8)

    def reaper() -> None:
        barrier.wait()
        results.extend(reap_all(store, 0.2, store.queues.ensure(target)))

    threads = [threading.Thread(target=reaper) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(j for j, what in results if what == "requeued") == sorted(jobs)
    stream = keys.queue(target, "interactive")
    assert store.r.xlen(stream) == len(jobs)  # the old entries are gone, one new entry per job
    assert _pending(store, stream) == 0
    for job_id in jobs:
        job = store.jobs.get(job_id)
        assert job["state"] == "queued" and job["attempts"] == 1 and job["last_worker"] == "dead-worker"
        assert [f["type"] for f in job["failures"]] == ["WorkerLost"]
        assert job["failures"][0]["message"].startswith("worker lost: dead-worker stopped renewing its lease")
    # Nothing is left to reap: the requeued entries have not been delivered to anyone.
    assert reap_all(store, 0.0, store.queues.ensure(target)) == []


def test_a_job_that_keeps_losing_its_worker_fails_for_good_saying_so(store, api_url):
    target = _target()
    job_id = _submit(store, target, max_attempts=2)
    for attempt in (1, 2):
        _take(store, target, f"doomed-{attempt}")
        time.sleep(0.15)
        assert reap_all(store, 0.1, store.queues.ensure(target)) == [(job_id, "requeued" if attempt == 1 else "failed")]
    job = store.jobs.get(job_id)
    assert job["state"] == "failed" and job["attempts"] == 2
    assert job["error"]["type"] == "WorkerLost"
    assert job["error"]["message"].startswith("worker lost: doomed-2 stopped renewing its lease during fetch")
    assert job["error"]["message"].endswith("(attempt 2 of 2; no attempts left)")
    assert [f["worker"] for f in job["error"]["failures"]] == ["doomed-1", "doomed-2"]
    # The record the API shows: a retryable failure that used the job's attempts still says it was retryable.
    assert {k: job["error"][k] for k in ("stage", "excerpt", "retryable", "worker", "attempts")} == {
        "stage": "fetch", "excerpt": "", "retryable": True, "worker": "doomed-2", "attempts": 2}
    assert job_id in store.r.lrange(keys.DEADLETTER, 0, 50)
    assert store.r.get(keys.inflight(job["key"])) is None  # a new request makes a new job
    assert store.r.xlen(keys.queue(target, "interactive")) == 0

    dead = api.get(f"{api_url}/v1/jobs/deadletter", params={"limit": 200}).json()["jobs"]
    assert job_id in [j["id"] for j in dead]


def test_a_worker_whose_lease_was_taken_can_no_longer_touch_the_job(store):
    target = _target()
    job_id = _submit(store, target)
    lease, _ = _take(store, target, "slow-worker")
    assert store.leases.renew(lease)
    time.sleep(0.15)
    assert reap_all(store, 0.1, store.queues.ensure(target)) == [(job_id, "requeued")]
    assert not store.leases.renew(lease)
    assert not store.jobs.finish(job_id, "succeeded", lease=lease, artifact="nope")
    assert not store.jobs.set_stage(job_id, "slow-worker", "compile")
    assert store.jobs.get(job_id)["state"] == "queued"
    # The next worker takes it over as attempt 2.
    lease2, _ = _take(store, target, "next-worker")
    assert store.jobs.get(job_id)["attempt"] == 2
    assert store.jobs.finish(job_id, "succeeded", lease=lease2, artifact="k")
    assert _pending(store, lease2.stream) == 0 and store.r.xlen(lease2.stream) == 0


def test_cancel_of_a_queued_job_wins_over_a_worker_that_just_read_it(store):
    target = _target()
    job_id = _submit(store, target)
    stream = keys.queue(target, "interactive")
    [(lease, _)] = store.queues.read("w", [stream])
    assert store.jobs.cancel(job_id) == "cancelled"  # still queued: ends now
    assert store.jobs.get(job_id)["error"] == {"type": "Cancelled", "message": "cancelled before it started",
                                               "stage": "", "excerpt": "", "retryable": False}
    assert store.jobs.start(job_id, lease) == ("cancelled", 0)
    assert _pending(store, stream) == 0 and store.r.xlen(stream) == 0
    events = [ev["state"] for _, ev in store.jobs.events(job_id)]
    assert events == ["queued", "cancelled"]

    # A queued job nobody has read yet loses its entry at once.
    other = _submit(store, target)
    assert store.jobs.cancel(other) == "cancelled"
    assert store.r.xlen(stream) == 0


def test_cancel_of_a_running_job_is_a_flag_its_worker_acts_on(store):
    target = _target()
    job_id = _submit(store, target)
    lease, _ = _take(store, target, "w")
    assert store.jobs.cancel(job_id) == "running"
    assert store.jobs.cancel_requested(job_id) and store.jobs.get(job_id)["cancel_requested"]
    assert store.jobs.finish(job_id, "cancelled", lease=lease, error=Failure.cancelled("x"))
    assert store.jobs.cancel(job_id) == "cancelled"  # already ended: nothing changes


def test_a_request_after_a_running_jobs_cancel_gets_a_job_of_its_own(store):
    """Once every namespace on a running job cancelled it, the job ends within seconds: an identical request in that
    window must not join it (it would end `cancelled` without its asker cancelling anything)."""
    target, key = _target(), uuid.uuid4().hex
    fields = {"model_id": "m", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {},
              "max_attempts": 3}
    doomed, _ = store.jobs.submit(key, target, fields)
    lease, _ = _take(store, target, "w")
    assert store.jobs.submit(key, target, fields) == (doomed, False)  # joined while nobody cancelled it
    assert store.jobs.cancel(doomed) == "running"
    fresh, created = store.jobs.submit(key, target, fields)
    assert created and fresh != doomed and store.jobs.get(fresh)["state"] == "queued"
    assert not store.jobs.get(fresh)["cancel_requested"]
    assert store.jobs.finish(doomed, "cancelled", lease=lease, error=Failure.cancelled("x"))
    assert store.jobs.submit(key, target, fields) == (fresh, False)  # the old job's end left the new one in place


def test_a_cancelled_job_whose_worker_was_lost_ends_cancelled_not_requeued(store):
    target = _target()
    job_id = _submit(store, target)
    _take(store, target, "gone")
    store.jobs.cancel(job_id)
    time.sleep(0.15)
    assert reap_all(store, 0.1, store.queues.ensure(target)) == [(job_id, "cancelled")]
    assert store.jobs.get(job_id)["state"] == "cancelled"


def test_hand_back_refunds_the_attempt(store):
    target = _target()
    job_id = _submit(store, target)
    lease, _ = _take(store, target, "w")
    assert store.jobs.get(job_id)["attempts"] == 1
    assert store.jobs.requeue(job_id, lease, refund=True, expect_state="running", reason="shutting down")
    job = store.jobs.get(job_id)
    assert (job["state"], job["attempts"], job.get("worker")) == ("queued", 0, None)
    assert not store.jobs.requeue(job_id, lease, refund=True)  # a second hand-back of the same lease does nothing
    assert store.jobs.get(job_id)["attempts"] == 0


@pytest.mark.parametrize("priority", ["interactive", "batch"])
def test_submit_records_priority_and_entry(store, priority):
    target = _target()
    job_id = _submit(store, target, priority=priority)
    job = store.jobs.get(job_id)
    assert job["priority"] == priority
    assert store.r.xrange(keys.queue(target, priority))[0] == (job["msg"], {"job": job_id})
    assert keys.queue(target, priority) in store.r.smembers(keys.QUEUES)
