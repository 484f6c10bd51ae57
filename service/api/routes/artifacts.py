from __future__ import annotations

import io
import zipfile
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from compiler import shapes as specs
from compiler.targets import Target
from service.api.deps import StoreDep
from compiler.errors import Conflict, NotFound, Unprocessable
from service.api.lookup import find_artifact
from service.api.routes.models import resolve_model

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])
SOURCES_LIMIT = 512 * 2**20  # the sources archive is read whole; the worker writes text, far below this


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
    requested = specs.parse_shape_args(shape)
    spec = specs.canonical_spec(model["inputs"], requested)
    wanted = Target.parse(target)
    art = find_artifact(store, model_id, wanted, spec, mode=mode)
    if art is None:
        shapes = specs.format_spec(spec)
        raise NotFound(f"no artifact of model {model_id[:12]} for {shapes} on {str(wanted)!r}; request one with POST /v1/compilations")
    return art


@router.get("/{key}/meta")
def meta(key: str, store: StoreDep) -> dict[str, Any]:
    """The cache-key factors, sizes, timings and the artifact check's result."""
    return _artifact_or_404(store, key)


@router.get("/{key}/report")
def report(key: str, store: StoreDep) -> dict[str, Any]:
    """The stage report: what each compiler stage (capture, autograd, lowering, fusion, codegen, package) saw and
    how long it took: graphs with node counts and op histograms, in-place ops removed, decompositions, fused
    kernels and extern calls, the generated code's files, and the artifact check."""
    _artifact_or_404(store, key)
    rep = store.get_report(key)
    if rep is None:
        raise NotFound(f"artifact {key} has no stage report (it was built before reports existed)")
    return rep


def _sources(store: Any, key: str) -> zipfile.ZipFile:
    _artifact_or_404(store, key)
    data = store.read_blob("sources", key, SOURCES_LIMIT)
    if data is None:
        raise NotFound(f"artifact {key} has no stored sources (it was built before reports existed)")
    return zipfile.ZipFile(io.BytesIO(data))


def _kind(path: str) -> str:
    if path.startswith("graphs/"):
        return "graph"
    if path.startswith("code/triton/") or path.startswith("code/kernel"):
        return "kernels"
    return "wrapper" if path.startswith("code/wrapper") else "other"


@router.get("/{key}/source")
def source_listing(key: str, store: StoreDep) -> dict[str, Any]:
    """The generated code (C++ kernels and wrapper on CPUs; Triton kernels and the wrapper on GPUs) and each
    stage's FX graph: a listing, each file fetchable at its `url`."""
    with _sources(store, key) as zf:
        files = [{"path": i.filename, "kind": _kind(i.filename), "bytes": i.file_size,
                  "url": f"/v1/artifacts/{key}/source/{i.filename}"} for i in zf.infolist() if not i.is_dir()]
    return {"key": key, "files": files}


@router.get("/{key}/source/{path:path}", response_model=None)
def source_file(key: str, path: str, store: StoreDep) -> Response:
    """One generated file or graph, as text."""
    with _sources(store, key) as zf:
        try:
            data = zf.read(path)
        except KeyError:
            raise NotFound(f"artifact {key} has no source file {path!r}; GET /v1/artifacts/{key}/source lists them") from None
    return Response(data, media_type="text/plain; charset=utf-8")


@router.api_route("/{key}", methods=["GET", "HEAD"], response_model=None)
def download(key: str, request: Request, store: StoreDep) -> Response:
    """The AOTInductor package (.pt2), streamed; its sha256 is the ETag."""
    art = _artifact_or_404(store, key)
    if art.get("package", True) is False:
        raise Conflict(f"artifact {key} is a report only (mode=training has no package yet); see "
                       f"/v1/artifacts/{key}/report and /v1/artifacts/{key}/source")
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
