"""The worker's queue reading, in-process against a real Redis, without compiles: priorities and reaping."""

from __future__ import annotations

import time
import uuid

from service.store import Store, keys
from worker.main import Worker
from worker.settings import WorkerSettings


def _worker(store: Store, target: str, **settings: float) -> Worker:
    info = {"target": target, "host": "test", "device": "cpu", "device_name": "test", "toolchain": {"torch": "x"}}
    w = Worker(WorkerSettings(redis_url=store.url, poll_ms=100, **settings), info)
    w.ensure_queues()
    return w


FIELDS = {"model_id": "m", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {}, "max_attempts": 3}


def _submit(store: Store, target: str, priority: str) -> str:
    job_id, _ = store.jobs.submit(uuid.uuid4().hex, target, FIELDS, priority=priority)
    return job_id


def _serve_all(w: Worker, store: Store) -> list[tuple[str, str]]:
    """Read the queue dry: start each entry and finish what started. Returns (job id, start outcome) in order."""
    served = []
    while (msg := w.next_message()) is not None:
        lease, job_id = msg
        outcome = store.jobs.start(job_id, lease)[0]
        served.append((job_id, outcome))
        if outcome == "running":
            assert store.jobs.finish(job_id, "succeeded", lease=lease, artifact="k")
    return served


def test_interactive_jobs_are_served_before_batch_jobs(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = _worker(store, target)
    order = [("batch", _submit(store, target, "batch")), ("interactive", _submit(store, target, "interactive")),
             ("batch", _submit(store, target, "batch")), ("interactive", _submit(store, target, "interactive"))]
    ids = [order[1][1], order[3][1], order[0][1], order[2][1]]
    assert _serve_all(w, store) == [(i, "running") for i in ids]


def test_a_batch_entry_read_together_with_an_interactive_one_goes_back_in_line(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = _worker(store, target)
    # Entries land on both streams between the non-blocking looks and the blocking read: simulate that read.
    b = _submit(store, target, "batch")
    i = _submit(store, target, "interactive")
    got = store.queues.read(w.id, w.streams)
    assert [job_id for _, job_id in got] == [i, b]  # one entry per stream, most urgent first: what Reader.next handles
    batch_stream = keys.queue(target, "batch")
    lease = got[1][0]
    assert lease.stream == batch_stream
    assert store.jobs.requeue(b, lease, expect_state="queued")
    assert store.jobs.get(b)["attempts"] == 0 and store.jobs.get(b)["state"] == "queued"
    assert store.jobs.get(i)["state"] == "queued"
    assert int(store.r.xpending(batch_stream, keys.QUEUE_GROUP)["pending"]) == 0


def test_an_idle_worker_reaps_a_lost_job_and_then_takes_it(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    lost = _worker(store, target)
    job_id = _submit(store, target, "interactive")
    lease, got = lost.next_message()
    assert got == job_id and store.jobs.start(job_id, lease)[0] == "running"

    rescuer = _worker(store, target, lease_s=0.3, heartbeat_s=0.1, reap_interval_s=0.1)
    time.sleep(0.4)
    msg = rescuer.next_message()  # reaps first (requeue), then reads the requeued entry
    assert msg is not None and msg[1] == job_id
    assert store.jobs.start(job_id, msg[0]) == ("running", 2)
    assert store.jobs.get(job_id)["failures"][0]["worker"] == lost.id


def test_an_interactive_request_joining_a_queued_batch_job_moves_it_ahead(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = _worker(store, target)
    wanted, ahead = f"k-{uuid.uuid4().hex}", f"k-{uuid.uuid4().hex}"
    ahead_id, _ = store.jobs.submit(ahead, target, FIELDS, priority="batch")
    job_id, _ = store.jobs.submit(wanted, target, FIELDS, priority="batch")
    joined, created = store.jobs.submit(wanted, target, FIELDS, priority="interactive")  # a deploy needs it now
    assert (joined, created) == (job_id, False)
    assert store.jobs.get(job_id)["priority"] == "interactive"
    assert [e[1].get("priority") for e in store.r.xrange(keys.job_events(job_id))] == [None, "interactive"]

    # The job ran first, from the interactive queue; its old batch entry was dropped when read, after the other job.
    assert _serve_all(w, store) == [(job_id, "running"), (ahead_id, "running"), (job_id, "succeeded")]
    for priority in keys.PRIORITIES:
        stream = keys.queue(target, priority)
        assert store.r.xlen(stream) == 0 and int(store.r.xpending(stream, keys.QUEUE_GROUP)["pending"]) == 0

    # A batch request joining a queued interactive job does not demote it, nor queue it twice.
    k = f"k-{uuid.uuid4().hex}"
    j, _ = store.jobs.submit(k, target, FIELDS, priority="interactive")
    assert store.jobs.submit(k, target, FIELDS, priority="batch") == (j, False)
    assert store.jobs.get(j)["priority"] == "interactive" and store.r.xlen(keys.queue(target, "batch")) == 0


def test_a_promoted_job_cancelled_while_queued_leaves_no_entry_behind(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = _worker(store, target)
    key = f"k-{uuid.uuid4().hex}"
    job_id, _ = store.jobs.submit(key, target, FIELDS, priority="batch")
    store.jobs.submit(key, target, FIELDS, priority="interactive")
    assert store.jobs.cancel(job_id) == "cancelled"
    msg = w.next_message()  # the batch entry, still in line
    assert msg is not None and msg[1] == job_id and store.jobs.start(job_id, msg[0]) == ("cancelled", 0)
    assert w.next_message() is None
    for priority in keys.PRIORITIES:
        assert store.r.xlen(keys.queue(target, priority)) == 0


def test_a_batch_job_waiting_longer_than_batch_max_wait_goes_before_interactive_ones(store):
    target = f"cpu-test-{uuid.uuid4().hex[:8]}"
    w = _worker(store, target, batch_max_wait_s=1.0)
    old_batch = _submit(store, target, "batch")
    time.sleep(1.2)
    fresh_batch = _submit(store, target, "batch")
    inter = [_submit(store, target, "interactive") for _ in range(2)]
    # The old batch job first; the fresh one has not waited long enough, so interactive work goes before it.
    assert _serve_all(w, store) == [(i, "running") for i in (old_batch, inter[0], inter[1], fresh_batch)]


def test_a_worker_serves_each_target_it_lists_its_own_first_within_a_priority(store):
    own, lower = f"cpu-test-{uuid.uuid4().hex[:8]}-v4", f"cpu-test-{uuid.uuid4().hex[:8]}-v3"
    info = {"target": own, "targets": [own, lower], "host": "test", "device": "cpu", "device_name": "test",
            "toolchain": {"torch": "x"}}
    w = Worker(WorkerSettings(redis_url=store.url, poll_ms=100), info)
    w.ensure_queues()
    low_batch = _submit(store, lower, "batch")
    low = _submit(store, lower, "interactive")
    mine = _submit(store, own, "interactive")
    # Interactive before batch whatever the target; within a priority, the worker's own target first.
    assert _serve_all(w, store) == [(mine, "running"), (low, "running"), (low_batch, "running")]
    # Then the verify jobs of the targets it serves natively (compiler/ontarget.py), after its compiles.
    assert w.streams == [keys.queue(t, p) for p in keys.PRIORITIES
                         for t in (own, lower, keys.verify_target(own), keys.verify_target(lower))]


def test_a_worker_never_reads_the_verify_queue_of_a_target_it_builds_only(store):
    own, lower = f"cpu-test-{uuid.uuid4().hex[:8]}-v4", f"cpu-test-{uuid.uuid4().hex[:8]}-v3"
    info = {"target": own, "targets": [own, lower], "build_only": [lower], "host": "test", "device": "cpu",
            "device_name": "test", "toolchain": {"torch": "x"}}
    blind = Worker(WorkerSettings(redis_url=store.url, poll_ms=100), info)
    assert keys.queue(keys.verify_target(lower), "interactive") not in blind.streams
    assert keys.queue(keys.verify_target(own), "interactive") in blind.streams
    assert keys.queue(lower, "interactive") in blind.streams  # it still builds it
    job_id, _ = store.jobs.submit(f"verify:{uuid.uuid4().hex}", keys.verify_target(lower),
                                  {"kind": "verify", "toolchain": {"torch": "x"}})
    assert blind.next_message() is None  # the verify job waits for a worker that serves the target natively
    native = Worker(WorkerSettings(redis_url=store.url, poll_ms=100), {**info, "build_only": []})
    lease, got = native.next_message()
    assert got == job_id and lease.stream == keys.queue(keys.verify_target(lower), "interactive")


def test_the_worker_targets_setting_reads_old_labels_and_refuses_unknown_levels(monkeypatch):
    import pydantic
    import pytest

    monkeypatch.setenv("AOTC_WORKER_TARGETS", '["cpu-x86_64-avx2", "cpu-x86_64-v1"]')
    assert WorkerSettings().worker_targets == ["cpu-x86_64-v3", "cpu-x86_64-v1"]
    monkeypatch.setenv("AOTC_WORKER_TARGETS", '["cpu-x86_64-v7"]')
    with pytest.raises(pydantic.ValidationError, match="AOTC_WORKER_TARGETS: unknown x86-64 level 'v7'"):
        WorkerSettings()
