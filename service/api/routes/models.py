from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from compiler.archive.inspect import inspect_archive
from compiler.errors import BadRequest, PayloadTooLarge, Unprocessable
from service.api.deps import ModelDep, SettingsDep, StoreDep
from service.api.schemas import ModelList, ModelRecord, errors

router = APIRouter(prefix="/v1/models", tags=["models"], responses=errors(503))


def _model_name(name: str | None, max_chars: int) -> str | None:
    """A model name others will see in listings and terminals: printable text (no control, format or line
    separator characters: no terminal escapes, no bidi overrides), not blank, at most `max_chars` characters."""
    if name is None or name == "":
        return None
    if len(name) > max_chars:
        raise Unprocessable(f"the model name is {len(name)} characters; the limit is {max_chars} "
                            "(AOTC_MAX_MODEL_NAME_CHARS)", setting="AOTC_MAX_MODEL_NAME_CHARS")
    if not name.isprintable() or not name.strip():
        raise Unprocessable(f"the model name {ascii(name)[:80]} is not printable text: a name may hold letters, "
                            "digits, punctuation and spaces, but no control or formatting characters")
    return name


@router.post("", status_code=201, response_model=ModelRecord, response_model_exclude_unset=True, responses={
    200: {"model": ModelRecord, "description": "Already uploaded"},
    **errors(400, 413, 415, 422, why={400: "The body is empty", 422: "Not an exported program, or an unsafe one"}),
})
async def upload_model(request: Request, response: Response, store: StoreDep, settings: SettingsDep,
                       name: str | None = None) -> dict[str, Any]:
    """Upload a `torch.export.save` archive as the raw request body.

    The body is streamed to disk under the size limit, hashed, and inspected without unpickling anything:
    the answer lists the inputs the program declares (names, shapes with dynamic ranges, dtypes).
    The model id is the sha256 of the content, so uploading the same file twice is harmless.
    The name (`?name=`, else the `x-aotc-filename` header) is printable text of at most AOTC_MAX_MODEL_NAME_CHARS.
    """
    model_name = _model_name(name or request.headers.get("x-aotc-filename"),
                             settings.max_model_name_chars)
    limit = settings.max_upload_mb * 2**20
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the upload is {int(declared)} bytes; the limit is {limit} bytes (AOTC_MAX_UPLOAD_MB)")
    tmp_dir = settings.data_dir / "uploads"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=tmp_dir, suffix=".pt2")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"the upload is over the limit of {limit} bytes (AOTC_MAX_UPLOAD_MB)")
                digest.update(chunk)
                f.write(chunk)
        if size == 0:
            raise BadRequest("the request body is empty; send the .pt2 file as the body")
        model_id = digest.hexdigest()
        existing = await run_in_threadpool(store.models.get, model_id)
        # Already stored, unless its bytes went missing: then this upload stores them again.
        if existing:
            have_bytes: bool = await run_in_threadpool(store.blobs.exists, "model", model_id)
            if have_bytes:
                response.status_code = 200
                return existing
        info = await run_in_threadpool(inspect_archive, path, settings.archive_limits())
        record: dict[str, Any] = {
            "id": model_id,
            "name": model_name or model_id[:12],
            "size": size,
            "created": time.time(),
            **info,
        }

        def _persist() -> None:
            with open(path, "rb") as src:
                store.blobs.put("model", model_id, src)
            store.models.put(record)  # the record last: a model is visible only once its bytes are stored

        await run_in_threadpool(_persist)
        return record
    finally:
        os.unlink(path)


@router.get("", response_model=ModelList, response_model_exclude_unset=True, responses=errors(422))
def list_models(store: StoreDep, limit: int = 100) -> dict[str, Any]:
    """Uploaded models, newest first."""
    return {"models": store.models.recent(limit)}


@router.get("/{model_id}", response_model=ModelRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why={404: "No such model", 422: "The id prefix is ambiguous"}))
async def get_model(model: ModelDep) -> dict[str, Any]:
    """One model: its inputs as the exported program declares them. A unique id prefix works too."""
    return model
