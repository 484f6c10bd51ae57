"""Probes: `/healthz` is liveness (restart this process when it fails), `/readyz` readiness (send it no traffic
while it fails). What each checks, and what compose and Kubernetes should probe: docs/configuration.md, "Health
probes"."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from compiler.errors import AotcError
from compiler.targets import worker_targets
from service.api.deps import StoreDep
from service.api.errors import InsufficientStorage
from service.api.liveness import Liveness
from service.api.schemas import Health, Ready, errors
from service.store import Store
from service.store.memory import out_of_memory
from service.store.registry import broken

router = APIRouter(tags=["health"])


class Wedged(AotcError):
    """This API process cannot make progress by itself (service/api/liveness.py): restart it."""

    status, code = 503, "wedged"


class NotReady(AotcError):
    """This API process is wedged: send its traffic elsewhere (and restart it: /healthz fails too)."""

    status, code = 503, "not_ready"
    headers = {"Retry-After": "2"}


def _stuck(request: Request) -> list[str]:
    liveness: Liveness | None = getattr(request.app.state, "liveness", None)
    return liveness.problems() if liveness is not None else []


@router.get("/healthz", response_model=Health, responses=errors(503, why={
    503: "This API process is wedged (a background task ended or is stuck, or its thread pool is): restart it"}))
async def healthz(request: Request) -> dict[str, bool]:
    """Liveness: this API process makes progress by itself (its event loop answers this, its background tasks run,
    its thread pool is not stuck). Never asks Redis: a Redis outage is /readyz's business, and restarting API
    processes would not mend it. 503 names what is stuck."""
    if problems := _stuck(request):
        raise Wedged(f"this API process is wedged: {'; '.join(problems)}")
    return {"ok": True}


@router.get("/readyz", response_model=Ready, responses=errors(503, 507, why={
    503: "The service cannot reach its Redis, or this API process is wedged"}))
async def readyz(request: Request, store: StoreDep) -> dict[str, Any]:
    """Readiness: this process can serve. 503 while it is wedged (/healthz) or while Redis does not answer; 507
    when Redis is out of memory (it refuses writes, workers' heartbeats included). Lists the targets that healthy
    live workers serve.

    Readiness is this API process's: a broken worker does not make it unready (lookups, pulls and uploads still
    work, and jobs wait in line for a healthy worker), so the answer stays 200 but says `degraded` and names each
    unhealthy worker with its reason. Alert on `degraded` (or on aotc_workers_unhealthy in /metrics)."""
    if problems := _stuck(request):
        raise NotReady(f"this API process is wedged: {'; '.join(problems)}")
    return await run_in_threadpool(_ready, store)


def _ready(store: Store) -> dict[str, Any]:
    store.ping()  # ConnectionError: 503 redis_unavailable (service/api/errors.py)
    if full := out_of_memory(store.r):
        raise InsufficientStorage(full)
    workers = store.workers.live()
    unhealthy = [{"id": w["id"], "target": w.get("target", ""), "reason": w.get("unhealthy_reason") or "unhealthy",
                  "since": w.get("unhealthy_since")} for w in workers if broken(w)]
    targets = sorted({t for w in workers if not broken(w) for t in worker_targets(w)})
    return {"ok": True, "targets": targets, "degraded": bool(unhealthy), "unhealthy_workers": unhealthy}
