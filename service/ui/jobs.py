"""Jobs: the live list, one job's stage timeline over SSE, and its cancel and retry buttons.

Each page calls the JSON route that serves the same data (service.api.routes.jobs, .compilations), with the
signed-in key, so a page shows exactly what `GET /v1/jobs` would, and the buttons do what `DELETE /v1/jobs/{id}`
and `POST /v1/compilations` do, quotas included.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, cast

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from compiler.errors import Conflict, NotFound
from compiler.options import CompileOptions
from service.api.auth import Principal
from service.api.deps import _job as job_visible_to
from service.api.events import job_stream
from service.api.routes import compilations as compilations_route
from service.api.routes import jobs as jobs_route
from service.api.routes import models as models_route
from service.api.schemas import JOB_ID, CompilationRequest, JobState
from service.api.slots import Slots
from service.store import TERMINAL, Store
from service.ui import timeline
from service.ui.session import CheckedForm, Viewer, needs
from service.ui.web import UiRoute, csrf_token, env, render

router = APIRouter(prefix="/ui/jobs", route_class=UiRoute, include_in_schema=False)
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
LIST_LIMIT = 200  # the newest jobs a list shows (GET /v1/jobs pages at most 1000)
JobIdPath = Annotated[str, Path(pattern=JOB_ID, max_length=32)]
Filter = Annotated[str, Query(max_length=100)]


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _listed(store: Store, who: Principal, state: str, target: str, model: str) -> dict[str, Any]:
    """The jobs GET /v1/jobs lists for this key, filtered by target and model here (the route filters by state)."""
    jobs = jobs_route.list_jobs(store, who, LIST_LIMIT, cast(JobState | None, state or None))["jobs"]
    targets = sorted({str(j.get("target")) for j in jobs if j.get("target")})
    if target:
        jobs = [j for j in jobs if str(j.get("target", "")).startswith(target)]
    if model:
        jobs = [j for j in jobs if str(j.get("model_id", "")).startswith(model)]
    models = models_route.list_models(store, who, 200)["models"] if who.allows("pull") else []
    names = {m["id"]: m.get("name") or m["id"][:12] for m in models}
    return {"jobs": jobs, "targets": targets, "models": names}


def _filters(state: str, target: str, model: str) -> dict[str, str]:
    return {"state": state if state in STATES else "", "target": target, "model": model}


@router.get("")
async def jobs_page(request: Request, who: Viewer, state: Filter = "", target: Filter = "",
                    model: Filter = "") -> Response:
    needs(who, "compile", "the job list")
    f = _filters(state, target, model)
    listed = await run_in_threadpool(_listed, _store(request), who, f["state"], f["target"], f["model"])
    return render(request, "jobs.html", nav="jobs", filters=f, states=STATES, limit=LIST_LIMIT, **listed)


@router.get("/rows")
async def job_rows(request: Request, who: Viewer, state: Filter = "", target: Filter = "",
                   model: Filter = "") -> Response:
    """The list's rows alone: what the page polls to stay live."""
    needs(who, "compile", "the job list")
    f = _filters(state, target, model)
    listed = await run_in_threadpool(_listed, _store(request), who, f["state"], f["target"], f["model"])
    return render(request, "_job_rows.html", **listed)


def _events(store: Store, job_id: str) -> list[tuple[str, dict[str, str]]]:
    events, after = [], "0-0"
    while True:
        batch = store.jobs.events(job_id, after)
        events += batch
        if len(batch) < 100:
            return events
        after = batch[-1][0]


def _live_context(job: dict[str, Any], events: list[tuple[str, dict[str, str]]], who: Principal) -> dict[str, Any]:
    tl = timeline.build(events, job)
    return {"job": job, "timeline": tl, "now": time.time(), "ended": job["state"] in TERMINAL,
            "can_act": who.allows("compile")}


def _job_and_events(store: Store, job_id: str, who: Principal) -> tuple[dict[str, Any], list[Any]]:
    job = job_visible_to(store, job_id, who)  # GET /v1/jobs/{id}'s own check: 404 for another namespace's job
    return job, _events(store, job_id)


@router.get("/{job_id}")
async def job_page(request: Request, job_id: JobIdPath, who: Viewer) -> Response:
    needs(who, "compile", "a job")
    store = _store(request)
    job, events = await run_in_threadpool(_job_and_events, store, job_id, who)
    return render(request, "job.html", nav="jobs", **_live_context(job, events, who))


@router.get("/{job_id}/live")
async def job_live(request: Request, job_id: JobIdPath, who: Viewer) -> Response:
    """The live part of a job's page (state, timeline, failures, buttons), as a fragment."""
    needs(who, "compile", "a job")
    job, events = await run_in_threadpool(_job_and_events, _store(request), job_id, who)
    return render(request, "_job_live.html", **_live_context(job, events, who))


def _frames(raw: str) -> tuple[str, str, dict[str, Any] | None]:
    """(event, id, data) of one SSE frame that service.api.events wrote."""
    event = event_id = ""
    data = None
    for line in raw.splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
    return event, event_id, data


def sse_html(event: str, html: str) -> str:
    """An SSE frame carrying HTML: one `data:` line per line (a bare CR would also end a line in SSE)."""
    lines = html.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return f"event: {event}\n" + "".join(f"data: {line}\n" for line in lines) + "\n"


@router.get("/{job_id}/stream")
async def job_stream_html(request: Request, job_id: JobIdPath, who: Viewer) -> Response:
    """The job's events, as GET /v1/jobs/{id}/events streams them, each turned into the re-rendered live part
    of its page (`event: live`), then `event: end`. htmx's SSE extension swaps each in."""
    needs(who, "compile", "a job")
    store = _store(request)
    job, events = await run_in_threadpool(_job_and_events, store, job_id, who)

    async def load_job() -> Any:
        return await run_in_threadpool(store.jobs.get, job_id)

    token = csrf_token(request)

    slots: Slots = request.app.state.slots  # the same AOTC_MAX_STREAMS_PER_KEY as GET /v1/jobs/{id}/events
    slot = await slots.take("streams", who, request.app.state.settings.max_streams_per_key)
    stream = job_stream(request.app.state.events, request.app.state.aredis, job_id, load_job,
                        after=events[-1][0] if events else "0-0", stopping=request.app.state.draining.is_set)

    async def frames() -> AsyncIterator[str]:
        seen = list(events)
        current = job
        template = env.get_template("_job_live.html")
        try:
            async for raw in stream:
                event, event_id, data = _frames(raw)
                if event == "state" and data is not None:
                    seen.append((event_id, data))
                    current = {**current, "state": data.get("state", current["state"]),
                               "stage": data.get("stage", current.get("stage"))}
                elif event == "end":
                    current = data or await load_job() or current
                else:
                    yield raw  # retry, keepalives, `unavailable`
                    continue
                yield sse_html("live", template.render(csrf=token, **_live_context(current, seen, who)))
                if event == "end":
                    yield "event: end\ndata: end\n\n"
                    return
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    return jobs_route.EventStream(frames(), lambda: slots.release(slot))


def _after_action(request: Request, job_id: str, message: str = "") -> Response:
    if request.headers.get("hx-request"):
        return Response(status_code=204, headers={"HX-Redirect": f"/ui/jobs/{job_id}"})
    return RedirectResponse(f"/ui/jobs/{job_id}", status_code=303)


@router.post("/{job_id}/cancel")
async def cancel(request: Request, job_id: JobIdPath, who: Viewer, form: CheckedForm) -> Response:
    """DELETE /v1/jobs/{id}, from the job's page."""
    needs(who, "compile", "cancelling a job")
    store = _store(request)

    def run() -> None:
        job = job_visible_to(store, job_id, who)
        jobs_route.cancel_job(job, Response(), store, who)

    try:
        await run_in_threadpool(run)
    except Conflict as e:
        raise Conflict(f"{e.message}: nothing to cancel") from None
    return _after_action(request, job_id)


@router.post("/{job_id}/retry")
async def retry(request: Request, job_id: JobIdPath, who: Viewer, form: CheckedForm) -> Response:
    """A failed or cancelled job asked for again: POST /v1/compilations with its model, shapes, target and
    options (the same quotas; a new job, or the artifact when one is cached meanwhile)."""
    needs(who, "compile", "retrying a job")
    store = _store(request)
    settings = request.app.state.settings

    def run() -> dict[str, Any]:
        job = job_visible_to(store, job_id, who)
        if job["state"] not in ("failed", "cancelled"):
            raise Conflict(f"job {job_id} is {job['state']}: only a failed or cancelled job can be retried")
        if not job.get("model_id") or not job.get("spec"):
            raise NotFound(f"job {job_id} has no model or shapes recorded to ask for again")
        req = CompilationRequest(
            model_id=job["model_id"], shapes={i["name"]: i["shape"] for i in job["spec"]},
            target=job.get("target") or "cpu", options=CompileOptions.model_validate(job.get("options") or {}),
            priority=job.get("priority") or "interactive")
        answer: dict[str, Any] = compilations_route.request_compilation(req, Response(), store, settings, who)
        return answer

    answer = await run_in_threadpool(run)
    if answer.get("status") == "cached":
        where = f"/ui/artifacts/{answer['key']}"
        if request.headers.get("hx-request"):
            return Response(status_code=204, headers={"HX-Redirect": where})
        return RedirectResponse(where, status_code=303)
    return _after_action(request, answer["job"]["id"])
