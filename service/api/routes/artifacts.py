from __future__ import annotations

import io
import zipfile
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from compiler import shapes as specs
from compiler.errors import Conflict, NotFound, Unprocessable
from compiler.targets import Target
from service.api.deps import ArtifactDep, StoreDep, resolve_model
from service.api.lookup import find_artifact
from service.api.schemas import ArtifactList, ArtifactRecord, SourceListing, StageReport, errors
from service.store import Store

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"], responses=errors(503))
SOURCES_LIMIT = 512 * 2**20  # the sources archive is read whole; the worker writes text, far below this
_NO_ARTIFACT = {404: "No such artifact"}


@router.get("", response_model=ArtifactList, response_model_exclude_unset=True, responses=errors(422))
def list_artifacts(store: StoreDep, limit: int = 100) -> dict[str, Any]:
    """Stored artifacts, newest first."""
    return {"artifacts": store.artifacts.recent(limit)}


@router.get("/lookup", response_model=ArtifactRecord, response_model_exclude_unset=True, responses=errors(
    404, 422, why={404: "No such model, or no artifact fits",
                   422: "Unreadable shapes or target, shapes the program does not allow, or an ambiguous id prefix"}))
def lookup(
    store: StoreDep,
    model_id: str,
    target: str = "cpu",
    *,
    shape: Annotated[list[str], Query(default_factory=list,
                                      description="NAME=SHAPE, once per input, e.g. x=8x3x224x224")],
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
        raise NotFound(f"no artifact of model {model_id[:12]} for {shapes} on {str(wanted)!r}; "
                       "request one with POST /v1/compilations")
    return art


@router.get("/{key}/meta", response_model=ArtifactRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why=_NO_ARTIFACT))
def meta(art: ArtifactDep) -> dict[str, Any]:
    """The cache-key factors, sizes, timings and the artifact check's result."""
    return art


@router.get("/{key}/report", response_model=StageReport, response_model_exclude_unset=True,
            responses=errors(404, 422, why={404: "No such artifact, or it has no stage report"}))
def report(art: ArtifactDep, store: StoreDep) -> dict[str, Any]:
    """The stage report: what each compiler stage (capture, autograd, lowering, fusion, codegen, package) saw and
    how long it took: graphs with node counts and op histograms, in-place ops removed, decompositions, fused
    kernels and extern calls, the generated code's files, and the artifact check."""
    key = art["key"]
    rep = store.artifacts.report(key)
    if rep is None:
        raise NotFound(f"artifact {key} has no stage report (it was built before reports existed)")
    return rep


def _sources(store: Store, key: str) -> zipfile.ZipFile:
    data = store.blobs.read("sources", key, SOURCES_LIMIT)
    if data is None:
        raise NotFound(f"artifact {key} has no stored sources (it was built before reports existed)")
    return zipfile.ZipFile(io.BytesIO(data))


def _kind(path: str) -> str:
    if path.startswith("graphs/"):
        return "graph"
    if path.startswith("code/triton/") or path.startswith("code/kernel"):
        return "kernels"
    return "wrapper" if path.startswith("code/wrapper") else "other"


@router.get("/{key}/source", response_model=SourceListing,
            responses=errors(404, 422, why={404: "No such artifact, or it has no stored sources"}))
def source_listing(art: ArtifactDep, store: StoreDep) -> dict[str, Any]:
    """The generated code (C++ kernels and wrapper on CPUs; Triton kernels and the wrapper on GPUs) and each
    stage's FX graph: a listing, each file fetchable at its `url`."""
    key = art["key"]
    with _sources(store, key) as zf:
        files = [{"path": i.filename, "kind": _kind(i.filename), "bytes": i.file_size,
                  "url": f"/v1/artifacts/{key}/source/{i.filename}"} for i in zf.infolist() if not i.is_dir()]
    return {"key": key, "files": files}


@router.get("/{key}/source/{path:path}", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "The file, as text"},
    **errors(404, 422, why={404: "No such artifact, or no such file in its sources"}),
})
def source_file(art: ArtifactDep, path: str, store: StoreDep) -> Response:
    """One generated file or graph, as text."""
    key = art["key"]
    with _sources(store, key) as zf:
        try:
            data = zf.read(path)
        except KeyError:
            raise NotFound(f"artifact {key} has no source file {path!r}; "
                           f"GET /v1/artifacts/{key}/source lists them") from None
    return Response(data, media_type="text/plain; charset=utf-8")


_PACKAGE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The package, with its sha256 as the ETag"},
    304: {"description": "Not modified: If-None-Match named its ETag"},
    **errors(404, 409, 422, why={**_NO_ARTIFACT, 409: "A report-only artifact (mode=training): no package",
                                 422: "The artifact's package is not stored"}),
}


@router.get("/{key}", response_class=Response, responses=_PACKAGE)
@router.head("/{key}", response_class=Response, responses=_PACKAGE)
def download(art: ArtifactDep, request: Request, store: StoreDep) -> Response:
    """The AOTInductor package (.pt2), streamed; its sha256 is the ETag."""
    key = art["key"]
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
    if store.blobs.manifest("artifact", key) is None:
        raise Unprocessable(f"artifact {key} has no stored package")
    return StreamingResponse(store.blobs.chunks("artifact", key), headers=headers,
                             media_type="application/octet-stream")
