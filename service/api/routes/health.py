from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import StoreDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, bool]:
    """The process is up."""
    return {"ok": True}


@router.get("/readyz")
def readyz(store: StoreDep) -> JSONResponse:
    """Redis answers; lists the targets that live workers serve."""
    store.ping()
    targets = sorted({w["target"] for w in store.live_workers()})
    return JSONResponse({"ok": True, "targets": targets})
