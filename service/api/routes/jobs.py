from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from compiler.errors import Conflict
from service.api.auth import Compile, needs
from service.api.deps import JobDep, SettingsDep, StoreDep
from service.api.events import job_stream
from service.api.schemas import STREAM_ID, V1_ERRORS, JobList, JobRecord, JobState, Limit, errors
from service.api.slots import Slots
from service.store import TERMINAL

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=V1_ERRORS, dependencies=needs("compile"))


@router.get("", response_model=JobList, response_model_exclude_unset=True, responses=errors(422))
def list_jobs(store: StoreDep, who: Compile, limit: Limit = 50,
              state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
              ) -> dict[str, Any]:
    """Recent jobs, newest first; `state` filters (queued, running, succeeded, failed, cancelled). A namespace's
    key sees the jobs its namespace asked for; an admin's, all."""
    if who.ns is None:
        return {"jobs": store.jobs.recent(limit, state)}
    ids = store.namespaces.job_ids(who.ns, limit * 4 if state else limit)
    return {"jobs": [j for j in (store.jobs.get(i) for i in ids) if j and state in (None, j["state"])][:limit]}


@router.get("/deadletter", response_model=JobList, response_model_exclude_unset=True, responses=errors(422))
def deadletter(store: StoreDep, who: Compile, limit: Limit = 50) -> dict[str, Any]:
    """Jobs that failed for good, newest first (a namespace's key: its own among them)."""
    jobs = store.jobs.deadletter(limit)
    return {"jobs": jobs if who.ns is None else [j for j in jobs if store.namespaces.has_job(who.ns, j["id"])]}


@router.get("/{job_id}", response_model=JobRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why={404: "No such job"}))
def get_job(job: JobDep) -> dict[str, Any]:
    """A job's state, current stage, attempts, timings, and on failure the error with its stage and an excerpt."""
    return job


class EventStream(StreamingResponse):
    """An event stream that gives its key's stream slot back however it ends: `end`, a shutdown, or a client gone."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            # A client that left while the stream waited to send leaves the generator at a `yield`: close it now,
            # so its watch on the job ends with the request (its cleanup does not wait on anything).
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@router.get("/{job_id}/events", response_class=StreamingResponse, responses={
    200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"},
    **errors(404, 422, 429, why={404: "No such job", 429: "The key has AOTC_MAX_STREAMS_PER_KEY streams open"}),
})
async def job_events(job: JobDep, request: Request, store: StoreDep, settings: SettingsDep, who: Compile,
                     last_event_id: Annotated[str | None, Header(
                         pattern=STREAM_ID, description="Resume after this event id (`id:` of an event sent)")]
                     = None) -> StreamingResponse:
    """A job's state and stage changes as Server-Sent Events (`event: state`), from its start, or after
    `Last-Event-ID`; then `event: end` with the whole job record once it has ended. A key may hold at most
    AOTC_MAX_STREAMS_PER_KEY streams open at once (429 past it)."""
    job_id = job["id"]

    async def load_job() -> Any:
        return await run_in_threadpool(store.jobs.get, job_id)

    slots: Slots = request.app.state.slots
    slot = await slots.take("streams", who, settings.max_streams_per_key)
    stream = job_stream(request.app.state.events, request.app.state.aredis, job_id, load_job,
                        after=last_event_id or "0-0", stopping=request.app.state.draining.is_set)
    return EventStream(stream, lambda: slots.release(slot))


@router.delete("/{job_id}", status_code=202, response_model=JobRecord, response_model_exclude_unset=True,
               responses={200: {"model": JobRecord, "description": "A queued job, cancelled now"},
                          **errors(404, 409, 422, why={404: "No such job", 409: "The job has already ended"})})
def cancel_job(job: JobDep, response: Response, store: StoreDep, who: Compile) -> dict[str, Any] | None:
    """Cancel a job: a queued one ends at once (200), a running one within seconds (202; its worker kills the
    compile). Every request of the namespace that joined the job sees it cancelled. 409 when it has already ended.

    A job that other namespaces asked for too (the same model bytes, shapes and target) goes on for them: the
    caller's namespace leaves it (it no longer lists it) and the answer is the one a cancel of its own would get."""
    job_id = job["id"]
    if who.ns is not None and job["state"] not in TERMINAL and store.namespaces.shared_with_others(who.ns, job_id):
        store.namespaces.leave_job(who.ns, job_id)
        response.status_code = 200 if job["state"] == "queued" else 202
        return {**job, "state": "cancelled"} if job["state"] == "queued" else {**job, "cancel_requested": True}
    state = store.jobs.cancel(job_id) if job["state"] not in TERMINAL else job["state"]
    if state == "cancelled" and job["state"] == "queued":
        response.status_code = 200
        return store.jobs.get(job_id)
    if state in TERMINAL or state is None:
        raise Conflict(f"job {job_id} already ended ({state})", state=state)
    return {**(store.jobs.get(job_id) or job), "cancel_requested": True}
