from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api.deps import StoreDep

router = APIRouter(prefix="/v1", tags=["workers"])


@router.get("/workers")
def list_workers(store: StoreDep) -> dict[str, Any]:
    """Live workers: their target, toolchain, device and current job."""
    return {"workers": store.live_workers()}


@router.get("/stats")
def stats(store: StoreDep) -> dict[str, Any]:
    """Counters: compiles actually run (cache hits run none)."""
    return {"compiles": store.count_compiles()}


@router.get("/caches")
def compile_caches(store: StoreDep) -> dict[str, Any]:
    """What workers share through Redis to compile faster: max-autotune's matmul/convolution timings per target
    and system, and the number of Inductor remote-cache entries (Triton autotune results)."""
    return store.compile_caches()


@router.delete("/caches")
def clear_compile_caches(store: StoreDep) -> dict[str, Any]:
    """Drop the shared compile caches (artifacts stay; the next compiles run cold). Returns what was removed."""
    return {"removed": store.clear_compile_caches()}
