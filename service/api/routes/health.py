from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import StoreDep
from service.api.errors import InsufficientStorage
from service.api.schemas import Health, Ready, errors
from service.store.memory import out_of_memory
from service.store.registry import broken

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> dict[str, bool]:
    """The process is up."""
    return {"ok": True}


@router.get("/readyz", response_model=Ready, responses=errors(503, 507))
def readyz(store: StoreDep) -> dict[str, Any]:
    """Redis answers and has room; lists the targets that healthy live workers serve. 507 when Redis is out of
    memory (it refuses writes, workers' heartbeats included).

    Readiness is this API process's: a broken worker does not make it unready (lookups, pulls and uploads still
    work, and jobs wait in line for a healthy worker), so the answer stays 200 but says `degraded` and names each
    unhealthy worker with its reason. Alert on `degraded` (or on aotc_workers_unhealthy in /metrics)."""
    store.ping()
    if full := out_of_memory(store.r):
        raise InsufficientStorage(full)
    workers = store.workers.live()
    unhealthy = [{"id": w["id"], "target": w.get("target", ""), "reason": w.get("unhealthy_reason") or "unhealthy",
                  "since": w.get("unhealthy_since")} for w in workers if broken(w)]
    targets = sorted({w["target"] for w in workers if not broken(w)})
    return {"ok": True, "targets": targets, "degraded": bool(unhealthy), "unhealthy_workers": unhealthy}
