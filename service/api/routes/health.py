from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import StoreDep
from service.api.errors import InsufficientStorage
from service.api.schemas import Health, Ready, errors
from service.store.memory import out_of_memory

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> dict[str, bool]:
    """The process is up."""
    return {"ok": True}


@router.get("/readyz", response_model=Ready, responses=errors(503))
def readyz(store: StoreDep) -> dict[str, Any]:
    """Redis answers and has room; lists the targets that live workers serve. 507 when Redis is out of memory (it
    refuses writes, workers' heartbeats included)."""
    store.ping()
    if full := out_of_memory(store.r):
        raise InsufficientStorage(full)
    targets = sorted({w["target"] for w in store.workers.live()})
    return {"ok": True, "targets": targets}
