"""The web console, served by the API process at /ui (`app.include_router(ui.router)`).

Server-rendered Jinja2 pages over the same route functions the JSON API serves, with the same keys, scopes and
namespaces; small vendored browser libraries (static/vendor/README.md: htmx and its SSE extension for the live
parts, uPlot for the plots), and a strict Content-Security-Policy. No build step and no Node at run time.

    session.py     sign in with an API key (an HttpOnly SameSite=Strict cookie), CSRF checks
    web.py         rendering, the CSP, static files, errors as pages
    jobs.py        the live job list; a job's stage timeline over SSE; cancel and retry
    timeline.py    a job's events as a timeline of attempts and stages
    artifacts.py   an artifact's report, kernels, check, manifest; provenance; the sandboxed code view
    highlight.py   generated code escaped and highlighted, as a page that can run nothing
    models.py      models, their inputs and dynamic dims, speed-up per target
    farm.py        workers, queues, throughput and store use; keys and namespaces (admins)
    settings.py    AOTC_UI_* settings
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response

from service.ui import artifacts, farm, jobs, models, session
from service.ui.web import UiRoute, static_response

router = APIRouter(include_in_schema=False)
_static = APIRouter(prefix="/ui/static", route_class=UiRoute, include_in_schema=False)


@_static.get("/{name}")
async def static_file(name: str, v: Annotated[str | None, Query(max_length=64)] = None) -> Response:
    return static_response(name, v)


for _sub in (_static, session.router, jobs.router, artifacts.router, models.router, farm.router):
    router.include_router(_sub)

__all__ = ["router"]
