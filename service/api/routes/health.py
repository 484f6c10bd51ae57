from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import StoreDep
from service.api.schemas import Health, Ready, errors

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz() -> dict[str, bool]:
    """The process is up."""
    return {"ok": True}


@router.get("/readyz", response_model=Ready, responses=errors(503))
def readyz(store: StoreDep) -> dict[str, Any]:
    """Redis answers; lists the targets that live workers serve."""
    store.ping()
    targets = sorted({w["target"] for w in store.workers.live()})
    return {"ok": True, "targets": targets}
