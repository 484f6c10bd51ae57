from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.deps import StoreDep

router = APIRouter(prefix="/v1", tags=["workers"])


@router.get("/workers")
def list_workers(store: StoreDep) -> dict[str, Any]:
    """Live workers: their target, toolchain, device and current job."""
    return {"workers": store.live_workers()}


@router.get("/stats")
def stats(store: StoreDep) -> dict[str, Any]:
    """Counters: compiles actually run (cache hits run none)."""
    return {"compiles": store.count_compiles()}
