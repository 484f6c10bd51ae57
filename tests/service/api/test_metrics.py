"""GET /metrics: Prometheus' text format, the same from every API process, and counters that move as jobs run.

The job here is run by the test acting as the worker (claim, start, publish, finish through the store, as
worker/job.py does), so the test is fast; tests/service/api/test_aotc_server.py scrapes a real compile."""

from __future__ import annotations

import json
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from procs import api, start_api, stop
from service.store import keys

TARGET = "cpu-zmetricstest"  # its own, sorting after real targets (test_names.py says why)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    r = api.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _worker(store, worker_id: str, *, heartbeat_age_s: float = 0.0) -> None:
    record = {"id": worker_id, "target": TARGET, "toolchain": {"torch": "test"}, "device_name": "Test CPU",
              "host": "test", "started": time.time(), "pid": 0, "jobs_done": 0, "job": None}
    store.workers.heartbeat(record, 30.0)
    if heartbeat_age_s:  # as if its heartbeats had stopped that long ago, its record not yet expired
        late = {**record, "heartbeat": time.time() - heartbeat_age_s, "ttl_s": 30.0}
        store.r.set(keys.worker(worker_id), json.dumps(late), px=30_000)


def test_metrics_parse_and_move_as_a_job_runs(api_url, store, service_env, tmp_path: Path):
    model_id = "6b" * 32
    dims = [{"symbol": "s0", "min": 1, "max": 64}, 4]
    store.models.put({"id": model_id, "name": "metrics", "size": 1234, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": dims}]})
    _worker(store, "metrics-worker")
    before = scrape(api_url)
    assert value(before, "aotc_workers_live", target=TARGET) == 1
    assert value(before, "aotc_stored", kind="model") >= 1

    request = {"model_id": model_id, "shapes": {"x": [8, 4]}, "target": TARGET}
    queued = api.post(f"{api_url}/v1/compilations", json=request)
    assert queued.status_code == 202, queued.text
    job_id = queued.json()["job"]["id"]
    waiting = scrape(api_url)
    assert value(waiting, "aotc_compilation_cache_misses_total") == value(
        before, "aotc_compilation_cache_misses_total") + 1
    assert value(waiting, "aotc_queue_depth", target=TARGET, priority="interactive") == 1
    assert value(waiting, "aotc_jobs", state="queued") >= 1

    # The worker's part: claim, start, publish, finish with the timings the worker records.
    (lease, got), = store.queues.read("metrics-worker", [keys.queue(TARGET, "interactive")])
    assert got == job_id
    assert store.jobs.start(job_id, lease)[0] == "running"
    running = scrape(api_url)
    assert value(running, "aotc_queue_depth", target=TARGET, priority="interactive") == 0
    assert value(running, "aotc_queue_claimed", target=TARGET, priority="interactive") == 1
    job = store.jobs.get(job_id)
    package = tmp_path / "artifact.pt2"
    package.write_bytes(b"p" * 5000)
    store.artifacts.put({"key": job["key"], "factors": job["factors"], "model_id": model_id, "target": TARGET,
                         "spec": job["spec"], "options": job["options"], "job_id": job_id,
                         "worker": {"id": "metrics-worker", "device_name": "Test CPU", "host": "test"}}, package)
    timings = {"capture": 1.0, "compile_total": 12.5, "check": 1.5}
    assert store.jobs.finish(job_id, "succeeded", lease=lease, artifact=job["key"], timings=timings)

    done = scrape(api_url)
    assert value(done, "aotc_jobs", state="succeeded") == value(before, "aotc_jobs", state="succeeded") + 1
    assert value(done, "aotc_compile_seconds_count", target=TARGET) == 1
    assert value(done, "aotc_compile_seconds_sum", target=TARGET) == 12.5
    assert value(done, "aotc_compile_seconds_bucket", target=TARGET, le="10.0") == 0
    assert value(done, "aotc_compile_seconds_bucket", target=TARGET, le="20.0") == 1
    assert value(done, "aotc_compile_seconds_bucket", target=TARGET, le="+Inf") == 1
    assert value(done, "aotc_check_seconds_count", target=TARGET) == 1
    assert value(done, "aotc_check_seconds_bucket", target=TARGET, le="2.5") == 1
    stored = "aotc_stored_bytes"
    assert value(done, stored, kind="artifact") >= value(before, stored, kind="artifact") + 5000

    cached = api.post(f"{api_url}/v1/compilations", json=request)
    assert cached.status_code == 200 and cached.json()["status"] == "cached"
    pulled = api.get(f"{api_url}/v1/artifacts/{job['key']}", follow_redirects=True)
    assert pulled.status_code == 200 and len(pulled.content) == 5000
    after = scrape(api_url)
    assert value(after, "aotc_compilation_cache_hits_total") == value(done, "aotc_compilation_cache_hits_total") + 1
    assert value(after, "aotc_served_bytes_total") >= value(done, "aotc_served_bytes_total") + 5000
    pulls = "aotc_package_pulls_total"
    assert value(after, pulls, via="api") == value(done, pulls, via="api") + 1

    # Another API process reports the same service, and counts the job's timings no second time.
    other_url, other = start_api(service_env, tmp_path / "api-2.log")
    try:
        elsewhere = scrape(other_url)
        assert value(elsewhere, "aotc_compile_seconds_count", target=TARGET) == 1
        assert value(elsewhere, "aotc_compilation_cache_hits_total") == value(
            after, "aotc_compilation_cache_hits_total")
        assert value(scrape(api_url), "aotc_compile_seconds_count", target=TARGET) == 1
    finally:
        stop(other)


def test_a_worker_that_misses_heartbeats_counts_unhealthy(api_url, store):
    _worker(store, "metrics-late-worker", heartbeat_age_s=20.0)  # older than half its 30 s lifetime
    samples = scrape(api_url)
    assert value(samples, "aotc_workers_unhealthy", target=TARGET) >= 1
    store.workers.remove("metrics-late-worker")


def test_weights_downloads_are_counted_like_package_downloads(api_url, store, tmp_path: Path):
    """GET /v1/artifacts/{key}/weights moves aotc_weights_served_bytes and aotc_weights_pulls, apart from the
    packages' counters (a ranged pull counts the bytes it got)."""
    import hashlib

    model_id = "6c" * 32
    store.models.put({"id": model_id, "name": "metrics-weights", "size": 10, "created": time.time(), "inputs": []})
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"w" * 3000)
    package = tmp_path / "p.pt2"
    package.write_bytes(b"p" * 700)
    key = "6c" * 16
    store.artifacts.put({"key": key, "factors": {"model": model_id}, "model_id": model_id, "target": TARGET,
                         "spec": [], "options": {}, "weights": {"sha256": hashlib.sha256(weights.read_bytes())
                                                                .hexdigest(), "size": 3000, "constants": 1}},
                        package, weights=weights)
    before = scrape(api_url)
    got = api.get(f"{api_url}/v1/artifacts/{key}/weights", follow_redirects=True)
    assert got.status_code == 200 and len(got.content) == 3000
    part = api.get(f"{api_url}/v1/artifacts/{key}/weights", headers={"range": "bytes=1000-"}, follow_redirects=True)
    assert part.status_code == 206 and len(part.content) == 2000
    after = scrape(api_url)
    assert value(after, "aotc_weights_served_bytes_total") == value(before, "aotc_weights_served_bytes_total") + 5000
    assert value(after, "aotc_weights_pulls_total", via="api") == value(before, "aotc_weights_pulls_total",
                                                                         via="api") + 2
    assert value(after, "aotc_served_bytes_total") == value(before, "aotc_served_bytes_total")  # no package bytes
