"""FastAPI dependencies, as Annotated aliases: the store, the settings, and the records a path names.

A route that takes `ModelDep`, `JobDep` or `ArtifactDep` gets the record, or the request ends with a 404 before
the route runs. Ids carried in a body or a query go through `resolve_model` instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request

from compiler.errors import NotFound, Unprocessable
from service.api.settings import Settings
from service.store import Store


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def resolve_model(store: Store, model_id: str) -> dict[str, Any]:
    """The model with this id, or with this unique id prefix (8+ hex digits, as `aotc models` prints)."""
    hexish = len(model_id) >= 8 and all(c in "0123456789abcdef" for c in model_id)
    ids = store.models.find(model_id) if hexish else []
    if len(ids) > 1:
        raise Unprocessable(f"model id prefix {model_id!r} is ambiguous; give more digits")
    model = store.models.get(ids[0]) if ids else None
    if model is None:
        raise NotFound(f"no model {model_id!r}; upload it with POST /v1/models")
    return model


def _model(
    store: StoreDep,
    model_id: Annotated[str, Path(description="The model's id, or a unique prefix of it (8+ hex digits).")],
) -> dict[str, Any]:
    return resolve_model(store, model_id)


def _job(store: StoreDep, job_id: Annotated[str, Path(description="The job's id.")]) -> dict[str, Any]:
    job = store.jobs.get(job_id)
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


def _artifact(store: StoreDep, key: Annotated[str, Path(description="The artifact's cache key.")]) -> dict[str, Any]:
    art = store.artifacts.get(key)
    if art is None:
        raise NotFound(f"no artifact {key!r}")
    return art


# Sync dependencies: FastAPI runs them in its thread pool, like the routes' own store calls.
ModelDep = Annotated[dict[str, Any], Depends(_model)]
JobDep = Annotated[dict[str, Any], Depends(_job)]
ArtifactDep = Annotated[dict[str, Any], Depends(_artifact)]
