"""FastAPI dependencies, as Annotated aliases: the store, the settings, and the records a path names.

A route that takes `ModelDep`, `JobDep` or `ArtifactDep` gets the record, or the request ends with a 404 before
the route runs. Ids carried in a body or a query go through `resolve_model` (sync) or `find_model` (async).
`ModelDep` and `ArtifactDep` read through the async path (service/api/cache.py), with no thread-pool hop.
`ArtifactMetaDep` is the artifact's record rendered as the JSON answer (GET /v1/artifacts/{key}/meta), from memory
while Redis holds the same bytes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Response

from compiler.errors import NotFound, Unprocessable
from service.api.cache import Ambiguous, Found, NoModel, Reads
from service.api.settings import Settings
from service.store import Store


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def is_id_prefix(model_id: str) -> bool:
    """A model id or a prefix of one that is long enough to look up (8+ hex digits, as `aotc models` prints)."""
    return 8 <= len(model_id) <= 64 and all(c in "0123456789abcdef" for c in model_id)


def _no_model(model_id: str) -> NotFound:
    return NotFound(f"no model {model_id!r}; upload it with POST /v1/models")


def _ambiguous(model_id: str) -> Unprocessable:
    return Unprocessable(f"model id prefix {model_id!r} is ambiguous; give more digits")


def resolve_model(store: Store, model_id: str) -> dict[str, Any]:
    """The model with this id, or with this unique id prefix (8+ hex digits, as `aotc models` prints)."""
    ids = store.models.find(model_id) if is_id_prefix(model_id) else []
    if len(ids) > 1:
        raise _ambiguous(model_id)
    model = store.models.get(ids[0]) if ids else None
    if model is None:
        raise _no_model(model_id)
    return model


async def find_model(reads: Reads, model_id: str, *, with_artifacts: bool = False, trust_id: bool = False) -> Found:
    """`resolve_model` on the async path (Reads.model), with the same answers: 404 unknown, 422 ambiguous."""
    if not is_id_prefix(model_id):
        raise _no_model(model_id)
    try:
        return await reads.model(model_id, with_artifacts=with_artifacts, trust_id=trust_id)
    except NoModel:
        raise _no_model(model_id) from None
    except Ambiguous:
        raise _ambiguous(model_id) from None


async def _model(
    request: Request,
    model_id: Annotated[str, Path(description="The model's id, or a unique prefix of it (8+ hex digits).")],
) -> dict[str, Any]:
    return (await find_model(request.app.state.reads, model_id)).model


def _job(store: StoreDep, job_id: Annotated[str, Path(description="The job's id.")]) -> dict[str, Any]:
    job = store.jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


KeyPath = Annotated[str, Path(description="The artifact's cache key.")]


async def _artifact_raw(request: Request, key: str) -> str:
    raw = await request.app.state.reads.artifact(key)
    if raw is None:
        raise NotFound(f"no artifact {key!r}")
    return str(raw)


async def _artifact(request: Request, key: KeyPath) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(await _artifact_raw(request, key))
    return record


async def _artifact_meta(request: Request, key: KeyPath) -> Response:
    # One flat dependency (each level costs FastAPI's resolution on the hot path).
    reads: Reads = request.app.state.reads
    return Response(reads.meta(key, await _artifact_raw(request, key)), media_type="application/json")


# JobDep is sync: FastAPI runs it in its thread pool, like the routes' own store calls. The getters above are
# async only so that FastAPI calls them on the event loop: a sync dependency costs a thread-pool hop.
ModelDep = Annotated[dict[str, Any], Depends(_model)]
JobDep = Annotated[dict[str, Any], Depends(_job)]
ArtifactDep = Annotated[dict[str, Any], Depends(_artifact)]
ArtifactMetaDep = Annotated[Response, Depends(_artifact_meta)]
