"""A namespace keeps at most AOTC_NS_KEPT_JOBS job records (Namespaces.trim_jobs, scripts.TRIM_JOBS), against a
real Redis. Job records, their event streams and their index entries were never deleted, and cancelling a queued
job frees its quota slot at once: one compile key that submitted and cancelled in a loop grew Redis by 8 KB a job,
0.6 MiB/s, and a full Redis (noeviction) stops every tenant."""

from __future__ import annotations

import uuid

from service.store import Store, keys


def _job(store: Store, ns: str, target: str) -> str:
    job_id, created = store.jobs.submit(uuid.uuid4().hex, target, {
        "model_id": "m", "spec": [], "options": {}, "toolchain": {"torch": "x"}, "factors": {}, "max_attempts": 1,
        "namespace": ns})
    assert created and store.namespaces.add_job(ns, job_id)
    return job_id


def _held(store: Store, job_id: str) -> bool:
    return bool(store.r.exists(keys.job(job_id)) or store.r.exists(keys.job_events(job_id)))


def test_the_oldest_ended_jobs_past_the_limit_go_and_queued_or_shared_ones_stay(store: Store) -> None:
    ns, other = f"kept-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    target = f"cpu-kept-{uuid.uuid4().hex[:6]}"
    jobs = [_job(store, ns, target) for _ in range(8)]
    queued_old = jobs[0]  # the oldest, still queued: never dropped
    shared = jobs[1]  # ended, and another namespace asked for it too
    assert store.namespaces.add_job(other, shared)
    for job_id in jobs[1:]:
        assert store.jobs.cancel(job_id) is not None
    assert store.r.zscore(keys.JOBS_INDEX, jobs[2]) is not None and _held(store, jobs[2])

    assert store.namespaces.trim_jobs(ns, keep=3, scan=2) == 1  # the two oldest looked at: one queued, one shared
    assert store.namespaces.trim_jobs(ns, keep=3, batch=2) == 2  # the queued one passed over
    assert store.namespaces.trim_jobs(ns, keep=3) == 2
    assert store.namespaces.trim_jobs(ns, keep=3) == 0
    left = store.namespaces.job_ids(ns, 100)
    assert set(left) == {queued_old, *jobs[-2:]}  # the limit, the queued one among them
    assert _held(store, queued_old) and store.jobs.get(queued_old)["state"] == "queued"
    # The shared one: out of this namespace's list, still the other's, with its record.
    assert shared not in left and store.namespaces.job_ids(other, 10) == [shared] and _held(store, shared)
    for gone in jobs[2:6]:
        assert not _held(store, gone) and store.jobs.get(gone) is None
        assert store.r.zscore(keys.JOBS_INDEX, gone) is None
        assert not store.r.exists(keys.job_namespaces(gone))
    assert store.r.smembers(keys.job_namespaces(shared)) == {other}
    store.jobs.cancel(queued_old)
