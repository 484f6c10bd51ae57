"""A retried job waits out its backoff before any worker gets it, in-process against a real Redis: the queue keeps
it aside (`backoff`) and PROMOTE puts it back in its stream when it is due; cancels, interactive joins and stale
entries keep that promise."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from compiler.errors import Failure
from service.store import Store, keys
from worker.backoff import retry_delay
from worker.main import Worker
from worker.settings import WorkerSettings

INFO = {"host": "test", "device": "cpu", "device_name": "test", "toolchain": {"torch": "x"}}
FIELDS = {"model_id": "m", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {}, "max_attempts": 3}


def _worker(store: Store) -> Worker:
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = Worker(WorkerSettings(redis_url=store.url, poll_ms=100), {**INFO, "target": target})
    w.store.queues.ensure(target)
    return w


def _fail_first_attempt(w: Worker, delay_s: float, priority: str = "interactive") -> tuple[str, dict[str, Any]]:
    """Submit a job, claim it, and fail its attempt with a crash that is retried after `delay_s`."""
    job_id, _ = w.store.jobs.submit(uuid.uuid4().hex, w.target, FIELDS, priority=priority)
    msg = w.next_message()
    assert msg is not None and msg[1] == job_id
    assert w.store.jobs.start(job_id, msg[0]) == ("running", 1)
    job = {**(w.store.jobs.get(job_id) or {}), "worker": w.id}
    failure = Failure.crashed("compile", "compile crashed: the child process died of SIGSEGV (signal 11)", "", 11)
    assert w.store.jobs.retry_or_fail(job, msg[0], failure, delay_s=delay_s) == "requeued"
    return job_id, job


def _entries(store: Store, target: str) -> int:
    return sum(int(store.r.xlen(keys.queue(target, p))) for p in keys.PRIORITIES)


def test_a_retried_job_is_not_delivered_before_its_backoff_and_is_right_after(store):
    w = _worker(store)
    t0 = time.time()
    job_id, _ = _fail_first_attempt(w, delay_s=1.5)
    job = store.jobs.get(job_id)
    assert (job["state"], job["attempts"]) == ("queued", 1)
    assert t0 + 1.4 <= job["not_before"] <= time.time() + 1.6
    assert store.r.zscore(keys.BACKOFF, job_id) == pytest.approx(job["not_before"], abs=0.01)
    assert _entries(store, w.target) == 0  # in no stream: no worker can read it
    events = [ev for _, ev in store.jobs.events(job_id)]
    assert events[-1]["state"] == "queued" and events[-1]["not_before"] == f"{job['not_before']:.3f}"
    assert events[-1]["reason"].startswith("compile crashed")

    while time.time() < job["not_before"] - 0.2:  # polls before it is due find nothing
        assert w.next_message() is None
    deadline = time.monotonic() + 5
    while (msg := w.next_message()) is None:
        assert time.monotonic() < deadline, "the job never came back"
    assert msg[1] == job_id and time.time() >= job["not_before"]
    assert store.jobs.start(job_id, msg[0]) == ("running", 2)
    assert "not_before" not in store.jobs.get(job_id) and store.r.zscore(keys.BACKOFF, job_id) is None


def test_a_job_cancelled_during_its_backoff_ends_and_never_comes_back(store):
    w = _worker(store)
    job_id, _ = _fail_first_attempt(w, delay_s=0.3)
    assert store.jobs.cancel(job_id) == "cancelled"
    time.sleep(0.4)
    assert w.next_message() is None
    assert store.r.zscore(keys.BACKOFF, job_id) is None and _entries(store, w.target) == 0
    assert store.jobs.get(job_id)["state"] == "cancelled"


def test_an_interactive_request_joining_a_batch_job_in_backoff_waits_too_then_goes_interactive(store):
    w = _worker(store)
    job_id, job = _fail_first_attempt(w, delay_s=0.8, priority="batch")
    assert store.jobs.submit(job["key"], w.target, FIELDS, priority="interactive") == (job_id, False)
    record = store.jobs.get(job_id)
    assert record["priority"] == "interactive" and record["not_before"] > time.time()
    assert _entries(store, w.target) == 0  # the join did not get around the backoff
    time.sleep(0.9)
    # Any worker on this Redis promotes due jobs before it reads (a session's live workers too), so the count this
    # call returns may be 0 where another got there first: what counts is where the job is now.
    store.jobs.promote_due()
    assert store.r.xlen(keys.queue(w.target, "interactive")) == 1 and store.r.xlen(keys.queue(w.target, "batch")) == 0


def test_a_stale_entry_of_a_job_in_backoff_is_dropped_not_started(store):
    w = _worker(store)
    key = uuid.uuid4().hex
    job_id, _ = store.jobs.submit(key, w.target, FIELDS, priority="batch")
    store.jobs.submit(key, w.target, FIELDS, priority="interactive")  # now an entry in each stream
    msg = w.next_message()  # the interactive one
    assert msg is not None and msg[0].stream == keys.queue(w.target, "interactive")
    assert store.jobs.start(job_id, msg[0]) == ("running", 1)
    job = {**store.jobs.get(job_id), "worker": w.id}
    assert store.jobs.retry_or_fail(job, msg[0], Failure.timeout("compile", 5), delay_s=30) == "requeued"

    stale = w.next_message()  # the old batch entry: reading it must not start the job 30 s early
    assert stale is not None and stale[1] == job_id
    assert store.jobs.start(job_id, stale[0]) == ("backoff", 0)
    job = store.jobs.get(job_id)
    assert (job["state"], job["attempts"]) == ("queued", 1) and job["not_before"] > time.time() + 25
    assert _entries(store, w.target) == 0 and store.r.zscore(keys.BACKOFF, job_id) is not None
    assert int(store.r.xpending(keys.queue(w.target, "batch"), keys.QUEUE_GROUP)["pending"]) == 0
    store.jobs.cancel(job_id)


def test_retry_delay_doubles_per_attempt_up_to_the_cap_with_half_of_it_random():
    assert retry_delay(1, 0, 300) == 0.0  # AOTC_RETRY_BACKOFF_S=0: at once
    assert [retry_delay(a, 10, 300, rand=lambda: 1.0) for a in (1, 2, 3, 6, 50)] == [10, 20, 40, 300, 300]
    assert [retry_delay(a, 10, 300, rand=lambda: 0.0) for a in (1, 2, 6)] == [5, 10, 150]
    spread = {round(retry_delay(2, 10, 300), 3) for _ in range(50)}
    assert len(spread) > 40 and all(10 <= d <= 20 for d in spread)
