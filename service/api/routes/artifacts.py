from __future__ import annotations

import io
import zipfile
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, StringConstraints

from compiler.errors import Conflict, NotFound, Unprocessable
from compiler.options import CompileOptions, Mode, weights_layout
from compiler.targets import Target
from service.api.auth import Admin, Compile, Pull, needs
from service.api.deps import ArtifactDep, ArtifactMetaDep, SettingsDep, StoreDep, own_model_id, resolve_model
from service.api.http import Sendfile, offers_sendfile
from service.api.lookup import lookup_answer
from service.api.ranges import Unsatisfiable, byte_range, etag_matches
from service.api.schemas import (
    ARTIFACT_KEY,
    MAX_SHAPE_ARG,
    MAX_SHAPE_ARGS,
    MAX_SOURCE_PATH,
    MAX_TARGET,
    MODEL_ID,
    SHAPE_ARG,
    TARGET,
    V1_ERRORS,
    ArtifactList,
    ArtifactRecord,
    CompilationAnswer,
    ErrorBody,
    Limit,
    SignedManifest,
    SourceListing,
    StageReport,
    errors,
)
from service.store import Store
from service.store.blobstore import open_local

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"], responses=V1_ERRORS, dependencies=needs("pull"))
SOURCES_LIMIT = 512 * 2**20  # the sources archive is read whole; the worker writes text, far below this
_NO_ARTIFACT = {404: "No such artifact"}


@router.get("", response_model=ArtifactList, response_model_exclude_unset=True, responses=errors(422))
def list_artifacts(store: StoreDep, who: Pull, limit: Limit = 100) -> dict[str, Any]:
    """Stored artifacts, newest first: those of the caller's namespace's models (an admin's: all)."""
    if who.ns is None:
        return {"artifacts": store.artifacts.recent(limit)}
    found: list[dict[str, Any]] = []
    for model_id in store.namespaces.model_ids(who.ns, limit):
        found.extend(store.artifacts.for_model(model_id))
    return {"artifacts": sorted(found, key=lambda a: -a["created"])[:limit]}


@router.get("/lookup", response_model=ArtifactRecord, response_model_exclude_unset=True, responses=errors(
    404, 422, why={404: "No such model, or no artifact fits",
                   422: "Unreadable shapes or target, shapes the program does not allow, or an ambiguous id prefix"}))
async def lookup(
    request: Request,
    who: Pull,
    model_id: Annotated[str, Query(pattern=MODEL_ID, max_length=64,
                                   description="The model's id, or a unique prefix of it (8+ hex digits).")],
    target: Annotated[str, Query(max_length=MAX_TARGET, pattern=TARGET,
                                 description="'cpu', 'cuda', or a concrete target.")] = "cpu",
    *,
    shape: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_SHAPE_ARG, pattern=SHAPE_ARG)]], Query(
        default_factory=list, max_length=MAX_SHAPE_ARGS, description="NAME=SHAPE, once per input, e.g. "
        "x=8x3x224x224; each dim fits in int64 (at most 19 digits)")],
    mode: Annotated[Mode | None, Query(description="Only artifacts compiled in this mode.")] = None,
    graphs: Annotated[bool, Query(description="The caller replays CUDA graphs: rank equally specialised artifacts "
                                  "by the check's graph-replay median where all have one.")] = False,
    allow_unverified: Annotated[bool, Query(description="Also serve a package built for the target but not yet run "
                                            "on it (on_target.state unverified), where nothing that ran there "
                                            "fits.")] = False,
) -> Response:
    """Find the artifact for (model, shapes, target) without knowing its key; 404 when none fits.

    Static artifacts win over dynamic ones that cover the shapes; among dynamic ones, the narrowest range; among
    equally specialised ones, the fastest median of checks taken the same way on the same kind of device.
    """
    # The async hot path (service/api/lookup.py): one Redis round trip, the answer rendered once per process.
    model_id = await own_model_id(request, who, model_id)
    body = await lookup_answer(request.app.state.reads, model_id, target, shape, mode, graphs, allow_unverified)
    return Response(body, media_type="application/json")


@router.get("/{key}/meta", response_model=ArtifactRecord, response_model_exclude_unset=True,
            responses=errors(404, 422, why=_NO_ARTIFACT))
async def meta(art: ArtifactMetaDep) -> Response:
    """The cache-key factors, sizes, timings and the artifact check's result."""
    return art  # already rendered (service/api/deps.py)


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


class _LocalZip(zipfile.ZipFile):
    """A sources archive read from its file on this machine's disk (the file blob store): only the members asked
    for are read, and the file is closed with the archive."""

    def __init__(self, f: Any) -> None:
        self._own = f
        try:
            super().__init__(f)
        except BaseException:
            f.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._own.close()


def _sources(store: Store, art: dict[str, Any]) -> zipfile.ZipFile:
    """The artifact's sources archive: from its file where the blob store keeps one on this machine, so that a
    request holds only what it reads; else (Redis, S3) read whole, up to SOURCES_LIMIT."""
    key = art["key"]
    blob = store.artifacts.blob_id(art)
    local = open_local(store.blobs, "sources", blob)
    if local is not None:
        return _LocalZip(local)
    data = store.blobs.read("sources", blob, SOURCES_LIMIT)
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
    with _sources(store, art) as zf:
        files = [{"path": i.filename, "kind": _kind(i.filename), "bytes": i.file_size,
                  "url": f"/v1/artifacts/{key}/source/{i.filename}"} for i in zf.infolist() if not i.is_dir()]
    return {"key": key, "files": files}


@router.get("/{key}/source/{path:path}", response_class=Response, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "The file, as text"},
    **errors(404, 422, why={404: "No such artifact, or no such file in its sources"}),
})
def source_file(art: ArtifactDep, path: Annotated[str, Path(max_length=MAX_SOURCE_PATH)],
                store: StoreDep) -> Response:
    """One generated file or graph, as text."""
    key = art["key"]
    with _sources(store, art) as zf:
        try:
            data = zf.read(path)
        except KeyError:
            raise NotFound(f"artifact {key} has no source file {path!r}; "
                           f"GET /v1/artifacts/{key}/source lists them") from None
    return Response(data, media_type="text/plain; charset=utf-8")


_PACKAGE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The package, with its sha256 as the ETag"},
    206: {"description": "The bytes one `Range` asked for (`Content-Range` says which)"},
    304: {"description": "Not modified: If-None-Match named its ETag"},
    307: {"description": "With an S3 blob store: a presigned URL that serves the package (and its ranges)"},
    416: {"model": ErrorBody, "description": "The Range starts past the end (`Content-Range: bytes */SIZE`)"},
    **errors(404, 409, 422, why={**_NO_ARTIFACT, 409: "A report-only artifact (mode=training): no package",
                                 422: "The artifact's package is not stored"}),
}


@router.get("/{key}", response_class=Response, responses=_PACKAGE)
@router.head("/{key}", response_class=Response, responses=_PACKAGE)
def download(art: ArtifactDep, request: Request, store: StoreDep) -> Response:
    """The AOTInductor package (.pt2), streamed in small pieces; its sha256 is the ETag.

    One `Range: bytes=...` answers 206 with those bytes (a pull that was cut off resumes there); an `If-None-Match`
    naming the ETag answers 304. With an S3 blob store the answer is a 307 to a presigned URL, so the bytes come
    straight from object storage. Every GET counts as a pull: the artifact goes to the back of the eviction order.
    """
    key = art["key"]
    if art.get("package", True) is False:
        raise Conflict(f"artifact {key} is a report only (mode=training has no package yet); see "
                       f"/v1/artifacts/{key}/report and /v1/artifacts/{key}/source")
    if request.method == "GET":
        store.artifacts.touch(key)
    return _serve(request, store, "artifact", store.artifacts.blob_id(art), str(art["sha256"]), int(art["size"]),
                  f"{key}.pt2", f"artifact {key}")


def _serve(request: Request, store: Store, kind: str, blob: str, sha: str, size: int, filename: str,
           what: str) -> Response:
    """A blob with its sha256 as the ETag: HEAD, If-None-Match, one Range, or a 307 to a presigned URL."""
    etag = f'"{sha}"'
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "X-Aotc-Sha256": sha,
               "Content-Disposition": f'attachment; filename="{filename}"'}
    if etag_matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers={"ETag": etag, "Accept-Ranges": "bytes"})
    if request.method == "HEAD":
        return Response(headers={**headers, "Content-Length": str(size)}, media_type="application/octet-stream")
    url = store.blobs.presign(kind, blob, filename=filename)
    if url:
        return RedirectResponse(url, status_code=307, headers={"ETag": etag, "X-Aotc-Sha256": sha})
    try:
        span = byte_range(request.headers.get("range"), request.headers.get("if-range"), etag, size)
    except Unsatisfiable:
        return JSONResponse({"error": {"code": "range_not_satisfiable", "message": (
            f"{what} is {size} bytes; the Range {request.headers.get('range')!r} starts past its end")}},
            status_code=416, headers={"Content-Range": f"bytes */{size}", "ETag": etag})
    start, end = span or (0, size)
    headers["Content-Length"] = str(end - start)
    if span:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    status = 206 if span else 200
    # A file on this machine goes out with sendfile where the server offers it (service/api/http.py); the rest is
    # streamed in pieces.
    if offers_sendfile(request.scope) and (f := open_local(store.blobs, kind, blob)) is not None:
        return Sendfile(f, start, end - start, status, headers, "application/octet-stream")
    try:
        body = store.blobs.iter_range(kind, blob, start, end)
    except KeyError:
        raise Unprocessable(f"{what} is not stored") from None
    return StreamingResponse(body, status_code=status, headers=headers, media_type="application/octet-stream")


_WEIGHTS: dict[int | str, dict[str, Any]] = {
    **_PACKAGE,
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "The weights blob (safetensors), with its sha256 as the ETag"},
    **errors(404, 409, 422, why={**_NO_ARTIFACT, 409: "The artifact's package carries its own weights",
                                 422: "The artifact's weights blob is not stored"}),
}


@router.get("/{key}/weights", response_class=Response, responses=_WEIGHTS)
@router.head("/{key}/weights", response_class=Response, responses=_WEIGHTS)
def weights(art: ArtifactDep, request: Request, store: StoreDep) -> Response:
    """The weights blob a weightless package binds at load: safetensors (no pickle), shared by every artifact of
    the model at that precision, named by its sha256 (the ETag), which the artifact's signed manifest names with
    each constant's shape, dtype and stride. Served like the package: ranges, If-None-Match, presigned URLs."""
    key = art["key"]
    w = store.artifacts.weights_of(art)
    if w is None:
        raise Conflict(f"artifact {key} carries its own weights (built with freezing, or before weights were "
                       "stored once): pull the package alone")
    return _serve(request, store, "weights", w["sha256"], w["sha256"], int(w["size"]),
                  f"{w['sha256'][:16]}.safetensors", f"the weights blob of artifact {key}")


@router.post("/{key}/self-contained", status_code=202, response_model=CompilationAnswer,
             response_model_exclude_unset=True, responses={
                 200: {"model": CompilationAnswer, "description": "The self-contained build is stored: pull its key"},
                 **errors(404, 409, 422, 429, 503, why={
                     **_NO_ARTIFACT, 409: "A report-only artifact (mode=training): no package",
                     503: "No live worker serves the artifact's target, and no self-contained build is stored"})})
def self_contained(art: ArtifactDep, response: Response, store: StoreDep, settings: SettingsDep,
                   who: Compile) -> dict[str, Any]:
    """The artifact's self-contained build: the same model, shapes, target and options with its weights inside the
    package (`embed_weights`), for tools that cannot bind a weights blob (torch's own `aoti_load_package`). It is an
    artifact of its own, under its own key, signed, checked and evicted like any other.

    200 with it when it is stored (an artifact that carries its weights already answers with itself); otherwise
    202 with the job that builds it (a compile: AOTInductor cannot move weights into a package built without them,
    docs/weights.md says why), which counts against the namespace's job quota."""
    from service.api.routes.compilations import _compile_for

    if art.get("package", True) is False:
        raise Conflict(f"artifact {art['key']} is a report only (mode=training): it has no package")
    factors = art["factors"]
    if weights_layout(dict(factors.get("options") or {})) == "embedded" or not art.get("weights"):
        response.status_code = 200  # frozen, max-autotune, or published before weights were stored once
        return {"status": "cached", "key": art["key"], "artifact": art}
    model = resolve_model(store, str(art["model_id"]), who.ns)
    options = CompileOptions(**{**factors["options"], "embed_weights": True}).canonical()
    body = _compile_for(store, settings, who, model, list(factors["spec"]), [], Target.parse(str(factors["target"])),
                        options, "interactive")
    if body["status"] == "cached":
        response.status_code = 200
    elif "job" in body:
        response.headers["Location"] = f"/v1/jobs/{body['job']['id']}"
    return body


class PinState(BaseModel):
    key: str
    pinned: bool


_KEY = Path(pattern=ARTIFACT_KEY, description="The artifact's cache key (32 hex digits).")


@router.post("/{key}/pin", response_model=PinState, responses=errors(404, 422, why=_NO_ARTIFACT))
def pin(key: Annotated[str, _KEY], store: StoreDep, _: Admin) -> dict[str, Any]:
    """Keep an artifact: a pinned artifact is never evicted from the bounded artifact store (AOTC_STORE_MAX_GB)."""
    if not store.artifacts.pin(key):
        raise NotFound(f"no artifact {key!r}")
    return {"key": key, "pinned": True}


@router.delete("/{key}/pin", response_model=PinState, responses=errors(404, 422, why=_NO_ARTIFACT))
def unpin(key: Annotated[str, _KEY], store: StoreDep, _: Admin) -> dict[str, Any]:
    """Let an artifact be evicted again, least recently pulled first, when artifacts outgrow AOTC_STORE_MAX_GB."""
    if not store.artifacts.unpin(key):
        raise NotFound(f"no artifact {key!r}")
    store.artifacts.make_room()
    return {"key": key, "pinned": False}


@router.get("/{key}/manifest", response_model=SignedManifest, responses=errors(404, 409, 422, why={
    404: "No such artifact, or it is unsigned (published before signing: recompile it)",
    409: "A report-only artifact (mode=training): no package, so nothing to sign"}))
async def manifest(art: ArtifactDep) -> dict[str, Any]:
    """The artifact's signed manifest: a DSSE envelope around an in-toto statement of its package's sha256 and size,
    cache-key factors, model, toolchain, target and check, signed with Ed25519 by the worker that published it.
    Verify it against a pinned key (or one of GET /v1/signing-keys) before loading the package."""
    key = art["key"]
    if art.get("package", True) is False:
        raise Conflict(f"artifact {key} is a report only (mode=training): it has no package and no manifest")
    envelope = art.get("manifest")
    if not envelope:
        raise NotFound(f"artifact {key} is unsigned: published before signing, recompile it", reason="unsigned")
    return dict(envelope)
