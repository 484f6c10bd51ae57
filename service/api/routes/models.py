from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from compiler.archive.inspect import inspect_archive
from compiler.errors import BadRequest, PayloadTooLarge, Unprocessable
from service.api.auth import Compile, Principal, Pull, needs
from service.api.deps import ModelDep, SettingsDep, StoreDep, check_room
from service.api.disk import DiskFull, Spool, writing
from service.api.schemas import NAME_TEXT, V1_ERRORS, Limit, ModelList, ModelRecord, errors
from service.api.settings import Settings
from service.api.slots import UploadSlot
from service.store import Store
from service.store.blobstore import local_root

router = APIRouter(prefix="/v1/models", tags=["models"], responses=V1_ERRORS, dependencies=needs("pull"))


def _model_name(name: str | None, max_chars: int) -> str | None:
    """A model name others will see in listings and terminals, at most `max_chars` characters. That it is printable
    text (no terminal escapes, no bidi overrides) the parameters' pattern (NAME_TEXT) has checked."""
    if name is None or name == "":
        return None
    if len(name) > max_chars:
        raise Unprocessable(f"the model name is {len(name)} characters; the limit is {max_chars} "
                            "(AOTC_MAX_MODEL_NAME_CHARS)", setting="AOTC_MAX_MODEL_NAME_CHARS")
    return name


@router.post("", status_code=201, response_model=ModelRecord, response_model_exclude_unset=True, responses={
    200: {"model": ModelRecord, "description": "Already uploaded"},
    **errors(400, 408, 413, 415, 422, 429, 507, why={
        400: "The body is empty", 422: "Not an exported program, or an unsafe one, or a bad name",
        429: "The key has AOTC_MAX_UPLOADS_PER_KEY uploads in progress",
        507: "No room: a disk or the blob store is full (disk_full; a re-upload of a stored model still succeeds), "
             "Redis is out of memory, or the namespace's quota would be passed"}),
}, openapi_extra={"requestBody": {"required": True, "description": "The archive `torch.export.save` wrote, as "
                  "the raw body (at most AOTC_MAX_UPLOAD_MB)", "content": {
                      "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def upload_model(request: Request, response: Response, store: StoreDep, settings: SettingsDep,
                       who: Compile, _slot: UploadSlot, name: Annotated[str | None, Query(
                           pattern=NAME_TEXT, description="The model's name: printable text of at most "
                           "AOTC_MAX_MODEL_NAME_CHARS characters")] = None,
                       filename: Annotated[str | None, Header(
                           alias="x-aotc-filename", pattern=NAME_TEXT,
                           description="The name when `name` is not given (the CLI sends the file's)")] = None,
                       ) -> dict[str, Any]:
    """Upload a `torch.export.save` archive as the raw request body.

    The body is streamed to disk under the size limit, hashed, and inspected without unpickling anything:
    the answer lists the inputs the program declares (names, shapes with dynamic ranges, dtypes).
    The model id is the sha256 of the content, so uploading the same file twice is harmless, even on a full disk.
    A new model that would leave less than AOTC_DISK_LOW_WATER_MB free is refused with a 507.
    The name (`?name=`, else the `x-aotc-filename` header) is printable text of at most AOTC_MAX_MODEL_NAME_CHARS.
    A key may have at most AOTC_MAX_UPLOADS_PER_KEY uploads in progress at once (429 past it).
    """
    model_name = _model_name(name or filename, settings.max_model_name_chars)
    limit = settings.max_upload_mb * 2**20
    declared = request.headers.get("content-length")
    size_said = int(declared) if declared and declared.isdigit() else None
    if size_said is not None and size_said > limit:
        raise PayloadTooLarge(f"the upload is {size_said} bytes; the limit is {limit} bytes (AOTC_MAX_UPLOAD_MB)")
    blob_root = await run_in_threadpool(local_root, store.blobs)
    spool = Spool(settings, blob_root)
    try:
        await spool.receive(request, limit, size_said)
        size = spool.size
        if size == 0:
            raise BadRequest("the request body is empty; send the .pt2 file as the body")
        model_id = spool.digest.hexdigest()
        name_here = model_name or model_id[:12]
        existing = await run_in_threadpool(store.models.get, model_id)
        # Already stored, unless its bytes went missing: then this upload stores them again. The answer is the
        # caller's own: 200 only when its namespace had this model, never because another namespace has it.
        # A full disk does not stop a re-upload: its body was hashed even where it could not be written.
        have_bytes: bool = existing is not None and await run_in_threadpool(store.blobs.exists, "model", model_id)
        if existing and have_bytes:
            added = await run_in_threadpool(_add_to_namespace, store, settings, who, model_id, name_here, size)
            response.status_code = 201 if added else 200
            return await run_in_threadpool(store.namespaces.view, who.namespace, existing)
        if spool.refused is not None or spool.path is None:
            raise spool.refused or DiskFull("the upload could not be spooled to disk")
        path = spool.path
        await run_in_threadpool(check_room, store, settings, who, size)
        info = await run_in_threadpool(inspect_archive, str(path), settings.archive_limits())
        record: dict[str, Any] = {
            "id": model_id,
            "name": existing["name"] if existing else name_here,
            "size": size,
            "created": existing["created"] if existing else time.time(),
            **info,
        }

        def _persist() -> None:
            spool.room_to_store()
            with writing(blob_root or settings.data_dir, settings, "storing the model"), open(path, "rb") as src:
                store.blobs.put("model", model_id, src)
            store.models.put(record)  # the record last: a model is visible only once its bytes are stored
            store.namespaces.add_model(who.namespace, model_id, name_here)

        await run_in_threadpool(_persist)
        return await run_in_threadpool(store.namespaces.view, who.namespace, record)
    finally:
        spool.discard()


def _add_to_namespace(store: Store, settings: Settings, who: Principal, model_id: str, name: str,
                      size: int) -> bool:
    """Put a model already stored in the caller's namespace (its quota counts the model's bytes from now)."""
    if store.namespaces.has_model(who.namespace, model_id):
        return False
    check_room(store, settings, who, size)
    return store.namespaces.add_model(who.namespace, model_id, name)


@router.get("", response_model=ModelList, response_model_exclude_unset=True, responses=errors(422))
def list_models(store: StoreDep, who: Pull, limit: Limit = 100) -> dict[str, Any]:
    """Uploaded models, newest first: the caller's namespace's (an admin's: all)."""
    if who.ns is None:
        return {"models": store.models.recent(limit)}
    return {"models": store.namespaces.models(who.ns, limit)}


@router.get("/{model_id}", response_model=ModelRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why={404: "No such model", 422: "The id prefix is ambiguous"}))
async def get_model(model: ModelDep) -> dict[str, Any]:
    """One model: its inputs as the exported program declares them. A unique id prefix works too."""
    return model
