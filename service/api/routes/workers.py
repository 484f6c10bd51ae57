from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.auth import needs
from service.api.deps import StoreDep
from service.api.schemas import V1_ERRORS, CachesRemoved, CompileCaches, Stats, WorkerList

router = APIRouter(prefix="/v1", tags=["workers"], responses=V1_ERRORS, dependencies=needs("admin"))


@router.get("/workers", response_model=WorkerList, response_model_exclude_unset=True)
def list_workers(store: StoreDep) -> dict[str, Any]:
    """Live workers: their target, toolchain, device and current job."""
    return {"workers": store.workers.live()}


@router.get("/stats", response_model=Stats)
def stats(store: StoreDep) -> dict[str, Any]:
    """Counters: compiles actually run (cache hits run none)."""
    return {"compiles": store.caches.compiles()}


@router.get("/caches", response_model=CompileCaches)
def compile_caches(store: StoreDep) -> dict[str, Any]:
    """What workers share through Redis to compile faster: max-autotune's matmul/convolution timings per target
    and system, and the number of Inductor remote-cache entries (Triton autotune results)."""
    return store.caches.summary()


@router.delete("/caches", response_model=CachesRemoved)
def clear_compile_caches(store: StoreDep) -> dict[str, Any]:
    """Drop the shared compile caches (artifacts stay; the next compiles run cold). Returns what was removed."""
    return {"removed": store.caches.clear()}
