"""FastAPI dependencies, as Annotated aliases: the store, the settings, and the records a path names.

A route that takes `ModelDep`, `JobDep` or `ArtifactDep` gets the record, or the request ends with a 404 before
the route runs. Ids carried in a body or a query go through `resolve_model` (sync) or `find_model` (async).
`ModelDep` and `ArtifactDep` read through the async path (service/api/cache.py), with no thread-pool hop.
`ArtifactMetaDep` is the artifact's record rendered as the JSON answer (GET /v1/artifacts/{key}/meta), from memory
while Redis holds the same bytes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import Depends, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from compiler.errors import NotFound, OverQuota, Unprocessable
from service.api.auth import Caller, Keyring, Principal
from service.api.cache import Ambiguous, Found, NoModel, Reads
from service.api.schemas import ARTIFACT_KEY, JOB_ID, MODEL_ID
from service.api.settings import Settings
from service.store import Store, keys
from service.store.models import ID_LEN, lex_range
from service.store.namespaces import GB


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(get_store)]
# Path ids with their patterns (schemas.py): a value outside one names no record, and answers 404 before any
# Redis read (so `/v1/jobs/{id}:events` never reads the job's event stream as if it were the job).
ModelIdPath = Annotated[str, Path(pattern=MODEL_ID, max_length=64,
                                  description="The model's id, or a unique prefix of it (8+ hex digits).")]
JobIdPath = Annotated[str, Path(pattern=JOB_ID, max_length=32, description="The job's id (32 hex digits).")]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def is_id_prefix(model_id: str) -> bool:
    """A model id or a prefix of one that is long enough to look up (8+ hex digits, as `aotc models` prints)."""
    return _ID_PREFIX.fullmatch(model_id) is not None  # a regex: a per-character generator was 3 % of a lookup


_ID_PREFIX = re.compile(r"[0-9a-f]{8,64}")


def _no_model(model_id: str) -> NotFound:
    return NotFound(f"no model {model_id!r}; upload it with POST /v1/models")


def _ambiguous(model_id: str) -> Unprocessable:
    return Unprocessable(f"model id prefix {model_id!r} is ambiguous; give more digits")


def resolve_model(store: Store, model_id: str, ns: str | None = None) -> dict[str, Any]:
    """The model with this id, or with this unique id prefix (8+ hex digits, as `aotc models` prints); with `ns`,
    only among that namespace's models, and as that namespace sees it (its name for it)."""
    if not is_id_prefix(model_id):
        ids = []
    else:
        ids = store.models.find(model_id) if ns is None else store.namespaces.find_model(ns, model_id)
    if len(ids) > 1:
        raise _ambiguous(model_id)
    model = store.models.get(ids[0]) if ids else None
    if model is None:
        raise _no_model(model_id)
    return model if ns is None else store.namespaces.view(ns, model)


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


async def own_model_id(request: Request, who: Principal, model_id: str) -> str:
    """The full id of the model `model_id` names among those the caller may see (an admin: all of them, so the id
    is returned as given). Another namespace's model answers as a missing one: 404, never 403."""
    if who.ns is None:
        return model_id
    if not is_id_prefix(model_id):
        raise _no_model(model_id)
    keyring: Keyring = request.app.state.keyring
    if len(model_id) == ID_LEN:
        if await keyring.holds_model(who.ns, model_id):
            return model_id
        raise _no_model(model_id)
    start, stop = lex_range(model_id)
    ids = await request.app.state.aredis.zrangebylex(keys.ns(who.ns, "model-ids"), start, stop, start=0, num=2)
    if len(ids) > 1:
        raise _ambiguous(model_id)
    if not ids:
        raise _no_model(model_id)
    return str(ids[0])


async def _model(
    request: Request,
    model_id: ModelIdPath,
    who: Caller,
) -> dict[str, Any]:
    model = (await find_model(request.app.state.reads, await own_model_id(request, who, model_id))).model
    if who.ns is None:
        return model
    store: Store = request.app.state.store
    return await run_in_threadpool(store.namespaces.view, who.ns, model)


def _job(store: StoreDep, job_id: JobIdPath, who: Caller) -> dict[str, Any]:
    job = store.jobs.get(job_id) if who.ns is None or store.namespaces.has_job(who.ns, job_id) else None
    if job is None:
        raise NotFound(f"no job {job_id!r}")
    return job


KeyPath = Annotated[str, Path(pattern=ARTIFACT_KEY, description="The artifact's cache key (32 hex digits).")]


async def _artifact_raw(request: Request, key: str, who: Principal) -> str:
    reads: Reads = request.app.state.reads
    raw = await reads.artifact(key)
    if raw is not None and who.ns is not None:  # the caller's namespace must hold the artifact's model
        keyring: Keyring = request.app.state.keyring
        if not await keyring.holds_model(who.ns, reads.model_of(key, raw)):
            raw = None
    if raw is None:
        raise NotFound(f"no artifact {key!r}")
    return str(raw)


async def _artifact(request: Request, key: KeyPath, who: Caller) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(await _artifact_raw(request, key, who))
    return record


async def _artifact_meta(request: Request, key: KeyPath, who: Caller) -> Response:
    # One flat dependency (each level costs FastAPI's resolution on the hot path).
    reads: Reads = request.app.state.reads
    return Response(reads.meta(key, await _artifact_raw(request, key, who)), media_type="application/json")


# JobDep is sync: FastAPI runs it in its thread pool, like the routes' own store calls. The getters above are
# async only so that FastAPI calls them on the event loop: a sync dependency costs a thread-pool hop.
ModelDep = Annotated[dict[str, Any], Depends(_model)]
JobDep = Annotated[dict[str, Any], Depends(_job)]
ArtifactDep = Annotated[dict[str, Any], Depends(_artifact)]
ArtifactMetaDep = Annotated[Response, Depends(_artifact_meta)]


def check_room(store: Store, settings: Settings, who: Principal, incoming: int, what: str = "") -> None:
    """507 quota_storage when `incoming` more bytes would take the caller's namespace past its stored-bytes quota
    (admins, the operators, have none). A compile request passes `incoming` 1: its artifact's size is not known
    before it is built, so a namespace already at its quota is refused new work (`what` says which)."""
    if who.ns is None:
        return
    ns = who.ns
    quota = store.namespaces.quota(ns, settings.default_quota())
    held = store.namespaces.stored_bytes(ns)
    if held + incoming > quota.max_stored_bytes:
        more = what or f"{incoming / GB:.3f} GB more"
        raise OverQuota(
            f"namespace {ns!r} holds {held / GB:.3f} GB of models and artifacts; {more} would pass its quota of "
            f"{quota.max_stored_bytes / GB:.3f} GB (max_stored_gb; delete models, or an admin raises it with "
            "`aotc namespaces quota`)", quota="max_stored_gb", held_bytes=held, quota_bytes=quota.max_stored_bytes)
