from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import StoreDep
from compiler.errors import Conflict, NotFound
from service.api.events import job_stream
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


@router.get("/{job_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"}})
async def job_events(job_id: str, request: Request, store: StoreDep,
                     last_event_id: Annotated[str | None, Header()] = None) -> StreamingResponse:
    """A job's state and stage changes as Server-Sent Events (`event: state`), from its start, or after
    `Last-Event-ID`; then `event: end` with the whole job record once it has ended."""
    await run_in_threadpool(_job_or_404, store, job_id)

    async def load_job() -> Any:
        return await run_in_threadpool(store.get_job, job_id)

    draining = request.app.state.draining
    stream = job_stream(request.app.state.aredis, job_id, load_job, after=last_event_id or "0-0",
                        stopping=draining.is_set)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.delete("/{job_id}", status_code=202, responses={200: {"description": "A queued job, cancelled now"}})
def cancel_job(job_id: str, store: StoreDep) -> JSONResponse:
    """Cancel a job: a queued one ends at once (200), a running one within seconds (202; its worker kills the
    compile). Every request that joined the job sees it cancelled. 409 when the job has already ended."""
    job = _job_or_404(store, job_id)
    state = store.request_cancel(job_id) if job["state"] not in TERMINAL else job["state"]
    if state == "cancelled" and job["state"] == "queued":
        return JSONResponse(store.get_job(job_id), status_code=200)
    if state in TERMINAL or state is None:
        raise Conflict(f"job {job_id} already ended ({state})", state=state)
    return JSONResponse({**(store.get_job(job_id) or job), "cancel_requested": True}, status_code=202)
