"""The farm and the admin pages (admin keys only, as GET /v1/workers, /metrics, /v1/keys and /v1/namespaces are).

The farm shows the live workers (GET /v1/workers), the gauges and counters /metrics serves (parsed from the very
text a Prometheus scrape gets), and queue depth and throughput over time, rebuilt from the job records
GET /v1/jobs lists (each job's created, started and finished times): nothing new is recorded for the console.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families
from starlette.concurrency import run_in_threadpool

from service.api.auth import Principal
from service.api.routes import jobs as jobs_route
from service.api.routes import keys as keys_route
from service.api.routes import workers as workers_route
from service.api.routes.metrics import Scraper
from service.store import Store
from service.store.registry import broken, late
from service.ui.session import Viewer, needs
from service.ui.settings import get_console_settings
from service.ui.web import UiRoute, render

router = APIRouter(prefix="/ui", route_class=UiRoute, include_in_schema=False)
BUCKETS = 60


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def metrics(scraper: Scraper) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics' answer as {sample name: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(scraper.render().decode()):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return out


def history(jobs: list[dict[str, Any]], now: float, buckets: int = BUCKETS) -> dict[str, Any]:
    """Queue depth, jobs running, and jobs ended per minute over time, from job records: at each bucket's end, a
    job was queued if created before it and not yet started, running if started and not yet finished."""
    times = [float(j["created"]) for j in jobs if j.get("created")]
    if not times:
        return {"t": [], "queued": [], "running": [], "succeeded": [], "failed": [], "window_s": 0}
    start = max(min(times), now - 24 * 3600)
    step = max(1.0, (now - start) / buckets)
    edges = [start + step * (i + 1) for i in range(buckets)]
    queued, running = [0] * buckets, [0] * buckets
    ended: dict[str, list[float]] = {"succeeded": [0.0] * buckets, "failed": [0.0] * buckets}
    for j in jobs:
        created = float(j.get("created") or 0)
        started = float(j["started"]) if j.get("started") else None
        finished = float(j["finished"]) if j.get("finished") else None
        for i, t in enumerate(edges):
            if created <= t and (started is None or started > t) and (finished is None or finished > t):
                queued[i] += 1
            elif started is not None and started <= t and (finished is None or finished > t):
                running[i] += 1
        state = j.get("state")
        if finished is not None and state in ended and finished > start:
            i = min(buckets - 1, int((finished - start) // step))
            ended[str(state)][i] += 60.0 / step  # per minute
    return {"t": [round(t) for t in edges], "queued": queued, "running": running,
            "succeeded": [round(v, 3) for v in ended["succeeded"]], "failed": [round(v, 3) for v in ended["failed"]],
            "window_s": round(now - start)}


def _farm(request: Request, who: Principal) -> dict[str, Any]:
    store = _store(request)
    workers = workers_route.list_workers(store)["workers"]
    now = time.time()
    for w in workers:
        full = f"; the last job that ran out of space: {w['last_disk_full']}" if w.get("last_disk_full") else ""
        w["health"] = ("unhealthy: " + str(w.get("unhealthy_reason") or "its children fail") + full if broken(w)
                       else "late: missed a heartbeat" if late(w, now) else "ok")
    m = metrics(request.app.state.scraper)
    jobs = jobs_route.list_jobs(store, who, get_console_settings().history_jobs, None)["jobs"]
    max_gb = float(request.app.state.settings.store_max_gb or 0)

    def one(name: str, **labels: str) -> float:
        return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    queues = [{"target": lab.get("target"), "priority": lab.get("priority"), "depth": int(v),
               "claimed": int(one("aotc_queue_claimed", **lab))} for lab, v in m.get("aotc_queue_depth", [])]
    states = {lab.get("state"): int(v) for lab, v in m.get("aotc_jobs", [])}
    hist = history(jobs, now)
    return {
        "workers": workers, "queues": queues, "states": states, "history": hist, "history_json": json.dumps(hist),
        "history_jobs": len(jobs),
        "store_use": {"artifact_bytes": one("aotc_stored_bytes", kind="artifact"),
                      "model_bytes": one("aotc_stored_bytes", kind="model"),
                      "artifacts": int(one("aotc_stored", kind="artifact")), "models": int(one("aotc_stored",
                                                                                             kind="model")),
                      "max_bytes": max_gb * 2**30 if max_gb else None,
                      "redis_bytes": one("aotc_redis_used_memory_bytes"),
                      "evictions": int(one("aotc_artifact_evictions_total")),
                      "served_bytes": one("aotc_served_bytes_total")},
        "counters": {"compiles": int(one("aotc_compiles_total")), "hits": int(one("aotc_compilation_cache_hits_total")),
                     "misses": int(one("aotc_compilation_cache_misses_total")),
                     "pulls": int(one("aotc_package_pulls_total"))},
    }


@router.get("/farm")
async def farm_page(request: Request, who: Viewer) -> Response:
    needs(who, "admin", "the farm")
    return render(request, "farm.html", nav="farm", **await run_in_threadpool(_farm, request, who))


@router.get("/admin")
async def admin_page(request: Request, who: Viewer) -> Response:
    needs(who, "admin", "keys and namespaces")
    store, settings = _store(request), request.app.state.settings

    def load() -> dict[str, Any]:
        return {"keys": keys_route.list_keys(store, who)["keys"],
                "namespaces": keys_route.list_namespaces(store, settings, who)["namespaces"]}

    return render(request, "admin.html", nav="admin", **await run_in_threadpool(load))
