from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from service import specs, targets
from service.deps import StoreDep
from service.errors import NotFound, Unprocessable
from service.lookup import find_artifact
from service.routes.models import resolve_model

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])


def _artifact_or_404(store: Any, key: str) -> dict[str, Any]:
    art = store.get_artifact(key)
    if art is None:
        raise NotFound(f"no artifact {key!r}")
    return art


@router.get("")
def list_artifacts(store: StoreDep, limit: int = 100) -> dict[str, Any]:
    """Stored artifacts, newest first."""
    return {"artifacts": store.list_artifacts(limit)}


@router.get("/lookup")
def lookup(
    store: StoreDep,
    model_id: str,
    target: str = "cpu",
    shape: list[str] = Query(default=[], description="NAME=SHAPE, once per input, e.g. x=8x3x224x224"),
    mode: str | None = None,
) -> dict[str, Any]:
    """Find the artifact for (model, shapes, target) without knowing its key; 404 when none fits.

    Static artifacts win over dynamic ones that cover the shapes; among dynamic ones, the narrowest range.
    """
    model = resolve_model(store, model_id)
    model_id = model["id"]
    requested = dict(specs.parse_shape_arg(s) for s in shape)
    spec = specs.canonical_spec(model["inputs"], requested)
    target = targets.validate(target)
    art = find_artifact(store, model_id, target, spec)
    if art is not None and mode is not None and art["factors"]["options"].get("mode") != mode:
        art = None
    if art is None:
        shapes = ", ".join(f"{i['name']}={specs.format_shape(i['shape'])}" for i in spec)
        raise NotFound(f"no artifact of model {model_id[:12]} for {shapes} on {target!r}; request one with POST /v1/compilations")
    return art


@router.get("/{key}/meta")
def meta(key: str, store: StoreDep) -> dict[str, Any]:
    """The cache-key factors, sizes, timings and the artifact check's result."""
    return _artifact_or_404(store, key)


@router.api_route("/{key}", methods=["GET", "HEAD"], response_model=None)
def download(key: str, request: Request, store: StoreDep) -> Response:
    """The AOTInductor package (.pt2), streamed; its sha256 is the ETag."""
    art = _artifact_or_404(store, key)
    etag = f'"{art["sha256"]}"'
    headers = {
        "ETag": etag,
        "Content-Length": str(art["size"]),
        "Content-Disposition": f'attachment; filename="{key}.pt2"',
        "X-Aotc-Sha256": art["sha256"],
    }
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    if request.method == "HEAD":
        return Response(headers=headers, media_type="application/octet-stream")
    if store.blob_manifest("artifact", key) is None:
        raise Unprocessable(f"artifact {key} has no stored package")
    return StreamingResponse(store.iter_blob("artifact", key), headers=headers, media_type="application/octet-stream")
