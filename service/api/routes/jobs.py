from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from compiler.errors import Conflict
from service.api.deps import JobDep, StoreDep
from service.api.events import job_stream
from service.api.schemas import JobList, JobRecord, errors
from service.store import TERMINAL

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=errors(503))


@router.get("", response_model=JobList, response_model_exclude_unset=True, responses=errors(422))
def list_jobs(store: StoreDep, limit: int = 50, state: str | None = None) -> dict[str, Any]:
    """Recent jobs, newest first; `state` filters (queued, running, succeeded, failed, cancelled)."""
    return {"jobs": store.jobs.recent(limit, state)}


@router.get("/deadletter", response_model=JobList, response_model_exclude_unset=True, responses=errors(422))
def deadletter(store: StoreDep, limit: int = 50) -> dict[str, Any]:
    """Jobs that failed for good, newest first."""
    return {"jobs": store.jobs.deadletter(limit)}


@router.get("/{job_id}", response_model=JobRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why={404: "No such job"}))
def get_job(job: JobDep) -> dict[str, Any]:
    """A job's state, current stage, attempts, timings, and on failure the error with its stage and an excerpt."""
    return job


@router.get("/{job_id}/events", response_class=StreamingResponse, responses={
    200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"},
    **errors(404, 422, why={404: "No such job"}),
})
async def job_events(job: JobDep, request: Request, store: StoreDep,
                     last_event_id: Annotated[str | None, Header()] = None) -> StreamingResponse:
    """A job's state and stage changes as Server-Sent Events (`event: state`), from its start, or after
    `Last-Event-ID`; then `event: end` with the whole job record once it has ended."""
    job_id = job["id"]

    async def load_job() -> Any:
        return await run_in_threadpool(store.jobs.get, job_id)

    draining = request.app.state.draining
    stream = job_stream(request.app.state.aredis, job_id, load_job, after=last_event_id or "0-0",
                        stopping=draining.is_set)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.delete("/{job_id}", status_code=202, response_model=JobRecord, response_model_exclude_unset=True,
               responses={200: {"model": JobRecord, "description": "A queued job, cancelled now"},
                          **errors(404, 409, 422, why={404: "No such job", 409: "The job has already ended"})})
def cancel_job(job: JobDep, response: Response, store: StoreDep) -> dict[str, Any] | None:
    """Cancel a job: a queued one ends at once (200), a running one within seconds (202; its worker kills the
    compile). Every request that joined the job sees it cancelled. 409 when the job has already ended."""
    job_id = job["id"]
    state = store.jobs.cancel(job_id) if job["state"] not in TERMINAL else job["state"]
    if state == "cancelled" and job["state"] == "queued":
        response.status_code = 200
        return store.jobs.get(job_id)
    if state in TERMINAL or state is None:
        raise Conflict(f"job {job_id} already ended ({state})", state=state)
    return {**(store.jobs.get(job_id) or job), "cancel_requested": True}
