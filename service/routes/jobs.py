from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.deps import StoreDep
from service.errors import Conflict, NotFound
from service.store import TERMINAL

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _job_or_404(store: Any, job_id: str) -> dict[str, Any]:
    job = store.get_job(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


@router.get("")
def list_jobs(store: StoreDep, limit: int = 50, state: str | None = None) -> dict[str, Any]:
    """Recent jobs, newest first; `state` filters (queued, running, succeeded, failed, cancelled)."""
    return {"jobs": store.list_jobs(limit, state)}


@router.get("/deadletter")
def deadletter(store: StoreDep, limit: int = 50) -> dict[str, Any]:
    """Jobs that failed for good, newest first."""
    return {"jobs": store.deadletter(limit)}


@router.get("/{job_id}")
def get_job(job_id: str, store: StoreDep) -> dict[str, Any]:
    """A job's state, current stage, attempts, timings, and on failure the error with its stage and an excerpt."""
    return _job_or_404(store, job_id)


@router.delete("/{job_id}", status_code=202)
def cancel_job(job_id: str, store: StoreDep) -> JSONResponse:
    """Cancel a job: a queued one ends at once, a running one within seconds (its worker kills the compile)."""
    job = _job_or_404(store, job_id)
    if job["state"] in TERMINAL:
        raise Conflict(f"job {job_id} already ended ({job['state']})", state=job["state"])
    store.request_cancel(job_id)
    if job["state"] == "queued":
        store.finish_job(job_id, "cancelled", error={"type": "Cancelled", "message": "cancelled before it started"})
        return JSONResponse(store.get_job(job_id), status_code=200)
    return JSONResponse({**job, "cancel_requested": True}, status_code=202)
