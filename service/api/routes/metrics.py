"""GET /metrics: the service in Prometheus' text format, the same answer from every API process.

Everything comes from Redis, so any number of API processes (aotc-server --api-workers, replicas behind a load
balancer) report one service, and a scrape of any of them is the whole truth:

- gauges are read at scrape time: queue depth per target and priority, jobs by state, live and unhealthy
  workers, models, artifacts and the bytes they store, Redis' memory;
- counters live in Redis (`metrics:counters`): the API processes add to them as they answer (`CountRequests`
  below: POST /v1/compilations answered cached or queued, package bytes streamed);
- the compile and check seconds histograms live in Redis too (`metrics:hist:*`): a scrape that finds a job newly
  succeeded adds its timings (the worker records them in the job), exactly once across processes (`OBSERVE` in
  service/store/scripts.py), so they count every succeeded job whoever scrapes and however often.

A scrape reads each job's state once until it is final (each process keeps the final ones), so its cost grows with
the jobs still live plus a ZRANGE of the job index.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import cast

import redis
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import needs
from service.api.http import SENDFILE
from service.api.schemas import V1_ERRORS
from service.store import TERMINAL, Store, keys, scripts
from service.store.registry import broken, late

log = logging.getLogger("aotc.metrics")
router = APIRouter(tags=["health"], dependencies=needs("admin"))  # counts of every namespace: admin only

# Upper bounds in seconds: a small CPU compile takes ~10-30 s, max-autotune on a GPU minutes; checks are shorter.
BUCKETS = {
    "compile": (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0),
    "check": (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0),
}
TIMING = {"compile": "compile_total", "check": "check"}  # the job record's `timings` field for each histogram
STATES = ("queued", "running", *TERMINAL)
_BATCH = 1000


def bucket_field(seconds: float, bounds: Iterable[float]) -> str:
    """The histogram field a value counts in: the smallest upper bound it is within, else +Inf."""
    return next((repr(b) for b in bounds if seconds <= b), "+Inf")


def _batches(items: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(items), _BATCH):
        yield items[i:i + _BATCH]


class Scraper:
    """Builds the metric families from Redis. One per API process: it remembers the jobs already final (their
    state cannot change) and the sizes of stored models (fixed per id), so a scrape reads only what is new."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._final: dict[str, str] = {}
        self._sizes: dict[str, dict[str, int]] = {"model": {}}
        self._observe = store.r.register_script(scripts.OBSERVE)
        self._lock = threading.Lock()  # scrapes run in the thread pool: one at a time per process

    def render(self) -> bytes:
        with self._lock:
            families = self.families()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(families))
        return generate_latest(registry)

    def families(self) -> list[Metric]:
        r = self.store.r
        targets = self._queues_and_targets()
        out: list[Metric] = [*targets[1]]
        out += self._jobs()
        out += self._histograms(targets[0])
        out += self._workers()
        counters = cast(dict[str, str], r.hgetall(keys.METRICS_COUNTERS))
        out.append(CounterMetricFamily("aotc_compilation_cache_hits", "POST /v1/compilations answered from the "
                                       "artifact cache (200 cached).", value=int(counters.get("cache_hits", 0))))
        out.append(CounterMetricFamily("aotc_compilation_cache_misses", "POST /v1/compilations that had to queue "
                                       "(202 queued or joined).", value=int(counters.get("cache_misses", 0))))
        out.append(CounterMetricFamily("aotc_served_bytes", "Package bytes the API streamed "
                                       "(GET /v1/artifacts/{key}).", value=int(counters.get("served_bytes", 0))))
        pulls = CounterMetricFamily("aotc_package_pulls", "Package downloads (GET /v1/artifacts/{key}): streamed by "
                                    "the API, or redirected to the object store.", labels=["via"])
        pulls.add_metric(["api"], int(counters.get("pulls_api", 0)))
        pulls.add_metric(["redirect"], int(counters.get("pulls_redirected", 0)))
        out.append(pulls)
        out.append(CounterMetricFamily("aotc_weights_served_bytes", "Weights blob bytes the API streamed "
                                       "(GET /v1/artifacts/{key}/weights).",
                                       value=int(counters.get("weights_served_bytes", 0))))
        weights = CounterMetricFamily("aotc_weights_pulls", "Weights blob downloads (GET /v1/artifacts/{key}/weights)"
                                      ": streamed by the API, or redirected to the object store.", labels=["via"])
        weights.add_metric(["api"], int(counters.get("weights_pulls_api", 0)))
        weights.add_metric(["redirect"], int(counters.get("weights_pulls_redirected", 0)))
        out.append(weights)
        out.append(CounterMetricFamily("aotc_compiles", "Compiles workers ran (a cache hit runs none).",
                                       value=self.store.caches.compiles()))
        out.append(CounterMetricFamily("aotc_artifact_evictions", "Artifacts evicted to keep the store under "
                                       "AOTC_STORE_MAX_GB.", value=int(counters.get("evictions", 0))))
        out += self._stored()
        memory = r.info("memory")
        out.append(GaugeMetricFamily("aotc_redis_used_memory_bytes", "Memory Redis uses (records, queues, and "
                                     "blobs when they are stored in Redis).", value=int(memory["used_memory"])))
        return out

    def _queues_and_targets(self) -> tuple[list[str], list[Metric]]:
        depth = GaugeMetricFamily("aotc_queue_depth", "Jobs waiting in line, per target and priority.",
                                  labels=["target", "priority"])
        held = GaugeMetricFamily("aotc_queue_claimed", "Queue entries workers (or a reaper) hold, per target and "
                                 "priority.", labels=["target", "priority"])
        streams = self.store.queues.all()
        pipe = self.store.r.pipeline(transaction=False)
        for s in streams:
            pipe.xlen(s)
            pipe.xpending(s, keys.QUEUE_GROUP)
        replies = pipe.execute(raise_on_error=False)
        targets: set[str] = set()
        for n, s in enumerate(streams):
            length, pending = replies[2 * n], replies[2 * n + 1]
            target, _, priority = s.removeprefix(keys.queue("", "")[:-1]).rpartition(":")
            targets.add(target)
            if isinstance(length, Exception) or isinstance(pending, Exception):
                continue  # a stream that lost its group (Redis restarted without persistence): no numbers
            claimed = int(pending["pending"])
            depth.add_metric([target, priority], max(0, int(length) - claimed))
            held.add_metric([target, priority], claimed)
        return sorted(targets), [depth, held]

    def _jobs(self) -> list[Metric]:
        """Jobs by state; counts newly succeeded jobs in the histograms."""
        r = self.store.r
        ids = cast(list[str], r.zrange(keys.JOBS_INDEX, 0, -1))
        counts: Counter[str] = Counter()
        final: dict[str, str] = {}
        todo: list[str] = []
        for i in ids:
            st = self._final.get(i)
            if st is None:
                todo.append(i)
            else:
                counts[st] += 1
                final[i] = st
        for batch in _batches(todo):
            pipe = r.pipeline(transaction=False)
            for i in batch:
                pipe.hmget(keys.job(i), ["state", "target", "timings"])
            ended: list[tuple[str, str, str | None]] = []  # (job id, target, timings) of succeeded jobs
            for i, (state, target, timings) in zip(batch, pipe.execute()):
                if state is None:
                    continue  # the record is gone
                counts[state] += 1
                if state in TERMINAL:
                    final[i] = state
                    if state == "succeeded" and timings:
                        ended.append((i, target or "unknown", timings))
            try:
                self._observe_succeeded(ended)
            except redis.RedisError as e:  # counted at the next scrape instead (OBSERVE counts a job once)
                log.warning("metrics: could not record job timings: %s", e)
                for i, _, _ in ended:
                    final.pop(i, None)
        self._final = final
        fam = GaugeMetricFamily("aotc_jobs", "Jobs by state (the jobs the job index holds).", labels=["state"])
        for st in sorted(set(STATES) | set(counts)):
            fam.add_metric([st], counts.get(st, 0))
        return [fam]

    def _observe_succeeded(self, ended: list[tuple[str, str, str | None]]) -> None:
        pipe = self.store.r.pipeline(transaction=False)
        for job_id, target, raw in ended:
            timings = json.loads(raw or "{}")
            hkeys, args = [keys.METRICS_OBSERVED], [job_id]
            for name, field in TIMING.items():
                if isinstance(timings.get(field), (int, float)):
                    hkeys.append(keys.metrics_histogram(name, target))
                    args += [bucket_field(float(timings[field]), BUCKETS[name]), repr(float(timings[field]))]
            self._observe(keys=hkeys, args=args, client=pipe)
        if ended:
            pipe.execute()

    def _histograms(self, targets: list[str]) -> list[Metric]:
        r = self.store.r
        pipe = r.pipeline(transaction=False)
        for t in targets:
            for name in BUCKETS:
                pipe.hgetall(keys.metrics_histogram(name, t))
        replies = iter(pipe.execute())
        fams = {name: HistogramMetricFamily(f"aotc_{name}_seconds", f"{name.capitalize()} time of succeeded jobs "
                                            "(the worker's timings), per target.", labels=["target"])
                for name in BUCKETS}
        for t in targets:
            for name, bounds in BUCKETS.items():
                h = cast(dict[str, str], next(replies))
                cumulative, buckets = 0, []
                for b in bounds:
                    cumulative += int(h.get(repr(b), 0))
                    buckets.append((repr(b), cumulative))
                buckets.append(("+Inf", int(h.get("count", 0))))
                fams[name].add_metric([t], buckets, sum_value=float(h.get("sum", 0.0)))
        return list(fams.values())

    def _workers(self) -> list[Metric]:
        live = GaugeMetricFamily("aotc_workers_live", "Workers whose heartbeat is current, per target.",
                                 labels=["target"])
        unhealthy = GaugeMetricFamily("aotc_workers_unhealthy", "Registered workers that missed a heartbeat or "
                                      "more (stuck, cut off or dying), or that say they are unhealthy (their "
                                      "children fail before the compile starts), per target.", labels=["target"])
        ok: defaultdict[str, int] = defaultdict(int)
        bad: defaultdict[str, int] = defaultdict(int)
        for w in self.store.workers.live():
            (bad if late(w) or broken(w) else ok)[str(w.get("target"))] += 1
        for t in sorted(set(ok) | set(bad)):
            live.add_metric([t], ok.get(t, 0))
            unhealthy.add_metric([t], bad.get(t, 0))
        return [live, unhealthy]

    def _stored(self) -> list[Metric]:
        """Models and artifacts, and their bytes: each model's `size` (read once per id), and the artifacts' total
        that eviction keeps within AOTC_STORE_MAX_GB (packages and sources)."""
        r = self.store.r
        count = GaugeMetricFamily("aotc_stored", "Models and artifacts stored.", labels=["kind"])
        size = GaugeMetricFamily("aotc_stored_bytes", "Bytes stored: uploaded models; artifacts' packages and "
                                 "sources (what AOTC_STORE_MAX_GB bounds).", labels=["kind"])
        ids = cast(list[str], r.zrange(keys.MODELS_INDEX, 0, -1))
        known = self._sizes["model"]
        for batch in _batches([i for i in ids if i not in known]):
            for i, raw in zip(batch, cast(list[str | None], r.mget([keys.model(i) for i in batch]))):
                if raw:
                    known[i] = int(json.loads(raw).get("size") or 0)
        self._sizes["model"] = {i: known[i] for i in ids if i in known}  # forget what was deleted
        count.add_metric(["model"], len(ids))
        size.add_metric(["model"], sum(self._sizes["model"].values()))
        count.add_metric(["artifact"], int(r.zcard(keys.ARTIFACTS_INDEX)))
        size.add_metric(["artifact"], self.store.artifacts.total_bytes())
        return [count, size]


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


@router.get("/metrics", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}},
          "description": "Prometheus text format (version 0.0.4)"},
    **V1_ERRORS})
def metrics(request: Request) -> Response:
    """The service's metrics for Prometheus: queues, jobs, workers, compile and check times, cache hits and misses,
    bytes stored and served. Needs an admin key (it counts every namespace); every API process answers for the
    whole service."""
    scraper: Scraper = request.app.state.scraper
    return Response(scraper.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


class CountRequests:
    """ASGI middleware that counts, in Redis, what /metrics reports of the answers themselves: POST
    /v1/compilations answered 200 (cache hit) or 202 (miss), package and weights blob pulls and the bytes the API
    streamed of each. Other paths pass straight through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path == "/v1/compilations" or (path.startswith("/v1/artifacts/") and (
                (path.count("/") == 3 and path != "/v1/artifacts/lookup")
                or (path.count("/") == 4 and path.endswith("/weights"))))):
            await self.app(scope, receive, send)
            return
        status, sent, recorded = 0, 0, False

        async def record() -> None:
            # Before the answer's last bytes go: a client that reads /metrics once its pull is done sees it counted
            # (counted after the answer, the count raced the client's next request).
            nonlocal recorded
            if recorded:
                return
            recorded = True
            route = getattr(scope.get("route"), "path", None)
            counts: dict[str, int] = {}
            if route == "/v1/compilations" and scope["method"] == "POST" and status in (200, 202):
                counts["cache_hits" if status == 200 else "cache_misses"] = 1
            elif route == "/v1/artifacts/{key}" and scope["method"] == "GET":
                if status in (200, 206):
                    counts = {"pulls_api": 1, "served_bytes": sent}
                elif status == 307:  # a presigned URL: the object store serves the bytes
                    counts = {"pulls_redirected": 1}
            elif route == "/v1/artifacts/{key}/weights" and scope["method"] == "GET":
                if status in (200, 206):
                    counts = {"weights_pulls_api": 1, "weights_served_bytes": sent}
                elif status == 307:
                    counts = {"weights_pulls_redirected": 1}
            if counts:
                try:
                    pipe = scope["app"].state.aredis.pipeline(transaction=False)
                    for field, n in counts.items():
                        pipe.hincrby(keys.METRICS_COUNTERS, field, n)
                    await pipe.execute()
                except redis.RedisError as e:  # a lost count, not a failed request
                    log.warning("metrics: could not count %s: %s", counts, e)

        async def counting(message: Message) -> None:
            nonlocal status, sent
            last = False
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                last = not message.get("more_body", False)
            elif message["type"] == SENDFILE:  # the body, sent by the kernel (service/api/http.py)
                sent += int(message["count"])
                last = True
            if last:
                await record()
            await send(message)

        await self.app(scope, receive, counting)
        await record()  # an answer that ended without its last body message
