from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from compiler.archive.inspect import inspect_archive
from service.api.deps import SettingsDep, StoreDep
from compiler.errors import BadRequest, NotFound, PayloadTooLarge, Unprocessable
from service.store import Store

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.post("", status_code=201, responses={200: {"description": "Already uploaded"}})
async def upload_model(request: Request, store: StoreDep, settings: SettingsDep, name: str | None = None) -> JSONResponse:
    """Upload a `torch.export.save` archive as the raw request body.

    The body is streamed to disk under the size limit, hashed, and inspected without unpickling anything:
    the answer lists the inputs the program declares (names, shapes with dynamic ranges, dtypes).
    The model id is the sha256 of the content, so uploading the same file twice is harmless.
    """
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
        existing = await run_in_threadpool(store.get_model, model_id)
        if existing:
            return JSONResponse(existing, status_code=200)
        info = await run_in_threadpool(inspect_archive, path, max_json_bytes=settings.max_json_mb * 2**20)
        record: dict[str, Any] = {
            "id": model_id,
            "name": name or request.headers.get("x-aotc-filename") or model_id[:12],
            "size": size,
            "created": time.time(),
            **info,
        }

        def _persist() -> None:
            with open(path, "rb") as src:
                store.put_blob("model", model_id, src)
            store.put_model(record)  # the record last: a model is visible only once its bytes are stored

        await run_in_threadpool(_persist)
        return JSONResponse(record, status_code=201)
    finally:
        os.unlink(path)


def resolve_model(store: Store, model_id: str) -> dict[str, Any]:
    """The model with this id, or with this unique id prefix (8+ hex digits, as `aotc models` prints)."""
    ids = store.find_models(model_id) if len(model_id) >= 8 and all(c in "0123456789abcdef" for c in model_id) else []
    if len(ids) > 1:
        raise Unprocessable(f"model id prefix {model_id!r} is ambiguous; give more digits")
    model = store.get_model(ids[0]) if ids else None
    if model is None:
        raise NotFound(f"no model {model_id!r}; upload it with POST /v1/models")
    return model


@router.get("")
def list_models(store: StoreDep, limit: int = 100) -> dict[str, Any]:
    """Uploaded models, newest first."""
    return {"models": store.list_models(limit)}


@router.get("/{model_id}")
def get_model(model_id: str, store: StoreDep) -> dict[str, Any]:
    """One model: its inputs as the exported program declares them. A unique id prefix works too."""
    return resolve_model(store, model_id)
