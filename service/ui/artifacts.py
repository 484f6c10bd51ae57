"""An artifact: its stage report, kernels, check, manifest and toolchain; the provenance of its kernels; the
generated code in a sandboxed frame.

The data comes from the routes under /v1/artifacts/{key} (meta, report, source, manifest), called with the
signed-in key: another namespace's artifact is a 404 page here as it is a 404 there.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from compiler.errors import AotcError, NotFound, Unprocessable
from compiler.report import summary_rows
from service.api.auth import Principal
from service.api.deps import _artifact as artifact_visible_to
from service.api.routes import artifacts as artifacts_route
from service.api.schemas import ARTIFACT_KEY, MAX_SOURCE_PATH
from service.store import Store
from service.ui import highlight
from service.ui.session import Viewer, needs
from service.ui.settings import get_console_settings
from service.ui.web import UiRoute, render

router = APIRouter(prefix="/ui/artifacts", route_class=UiRoute, include_in_schema=False)
KeyPath = Annotated[str, Path(pattern=ARTIFACT_KEY, max_length=32)]
SourcePath = Annotated[str, Path(max_length=MAX_SOURCE_PATH)]
FIGURES = {"eager": "eager", "compiled": "plain", "graph": "CUDA graph"}  # the check's latency keys, as shown
_FX_CALL = re.compile(r"^\s+(\w+) = torch\.ops\.([\w.]+)\(", re.M)
_FX_GETITEM = re.compile(r"^\s+(\w+) = (\w+)\[\d+\]", re.M)


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def _record(request: Request, key: str, who: Principal) -> dict[str, Any]:
    needs(who, "pull", "an artifact")
    return await artifact_visible_to(request, key, who)  # GET /v1/artifacts/{key}/meta's own check


def _optional(fn: Any, *args: Any) -> Any:
    """A part an older artifact may lack (report, sources, manifest): None instead of its 404 or 409."""
    try:
        return fn(*args)
    except (NotFound, AotcError) as e:
        if e.status in (404, 409):
            return None
        raise


@router.get("")
async def artifact_list(request: Request, who: Viewer) -> Response:
    needs(who, "pull", "the artifact list")
    arts = await run_in_threadpool(artifacts_route.list_artifacts, _store(request), who, 200)
    return render(request, "artifacts.html", nav="artifacts", artifacts=arts["artifacts"])


def latency_boxes(check: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One box per (point, figure): min, quartiles, median, max in ms, and how they were taken."""
    out = []
    for p in (check or {}).get("points") or []:
        latency = p.get("latency") or {}
        for k, lat in sorted(latency.items(), key=lambda kv: list(FIGURES).index(kv[0]) if kv[0] in FIGURES else 9):
            if not isinstance(lat, dict) or lat.get("median_ms") is None:
                continue
            out.append({"point": p.get("point"), "figure": FIGURES.get(k, k),
                        "shapes": ", ".join(f"{n}={'x'.join(str(d) for d in s)}" for n, s in
                                            (p.get("shapes") or {}).items()),
                        **{q: lat.get(f"{q}_ms") for q in ("min", "p25", "median", "p75", "max")},
                        "reps": lat.get("reps"), "warmup": lat.get("warmup_reps"), "method": lat.get("method")})
    return out


def _statement(envelope: dict[str, Any] | None) -> dict[str, Any] | None:
    if not envelope:
        return None
    try:
        statement: dict[str, Any] = json.loads(base64.b64decode(envelope["payload"]))
    except (ValueError, KeyError, TypeError):
        return None
    return statement


def kernel_rows(report: dict[str, Any], limit: int) -> dict[str, Any]:
    fusion = (report.get("stages") or {}).get("fusion") or {}
    groups = fusion.get("groups") or []
    externs = fusion.get("externs") or []
    return {"groups": groups[:limit], "groups_total": len(groups), "externs": externs[:limit],
            "externs_total": len(externs), "fusion": fusion}


@router.get("/{key}")
async def artifact_page(request: Request, key: KeyPath, who: Viewer) -> Response:
    art = await _record(request, key, who)
    store = _store(request)
    settings = get_console_settings()

    def parts() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]:
        report = _optional(artifacts_route.report, art, store) or {}
        files, lines = _sources(store, art, settings.code_view_max_kb * 1024)
        return report, files, lines

    report, files, lines = await run_in_threadpool(parts)
    code_files = [f for f in files if f["kind"] in ("kernels", "wrapper")]
    graph_files = [f for f in files if f["kind"] == "graph"]
    first = (code_files or graph_files or [{"path": ""}])[0]["path"]
    check = art.get("check") or {}
    envelope = art.get("manifest") if art.get("package", True) is not False else None
    return render(
        request, "artifact.html", nav="artifacts", art=art, report=report, rows=summary_rows(report) if report
        else [], code_files=code_files, graph_files=graph_files, first_file=first, check=check,
        boxes=latency_boxes(check), boxes_json=json.dumps(latency_boxes(check)), envelope=envelope,
        statement=_statement(envelope), kernels=kernel_rows(report, settings.page_kernels),
        kernel_lines=lines, stages=report.get("stages") or {})


def _sources(store: Store, art: dict[str, Any], limit: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The sources archive's files (as GET /v1/artifacts/{key}/source lists them), and where each kernel is
    defined in them (`code/kernel.cpp#L-12`), read in one pass over the archive."""
    files: list[dict[str, Any]] = []
    lines: dict[str, str] = {}
    try:
        zf = artifacts_route._sources(store, art)
    except NotFound:
        return files, lines
    with zf:
        for i in zf.infolist():
            if i.is_dir():
                continue
            kind = artifacts_route._kind(i.filename)
            files.append({"path": i.filename, "kind": kind, "bytes": i.file_size})
            if kind == "kernels" and i.file_size <= limit:
                source = zf.read(i).decode("utf-8", "replace")
                for name, line in highlight.definitions(source).items():
                    lines.setdefault(name, f"{i.filename}#L-{line}")
    return files, lines


def _ops(code: str) -> dict[str, str]:
    """FX node name -> the op it calls, read from a graph's printed code (data only: never run)."""
    ops = {m.group(1): m.group(2) for m in _FX_CALL.finditer(code)}
    ops.update({m.group(1): "getitem" for m in _FX_GETITEM.finditer(code)})
    return ops


def provenance(report: dict[str, Any], full_code: dict[str, str]) -> dict[str, Any]:
    """Kernel <-> post-grad node <-> source node, from the stage report's fusion groups and extern calls (torch's
    provenance map, recorded by compiler/stages.py), with each node's op from its graph's code."""
    stages = report.get("stages") or {}
    fusion = stages.get("fusion") or {}
    post_ops = _ops(full_code.get("post_grad") or ((fusion.get("inductor_graph") or {}).get("code") or ""))
    src_ops = _ops(full_code.get("capture") or (((stages.get("capture") or {}).get("graph") or {}).get("code")
                                                or ""))
    kernels: list[dict[str, Any]] = []
    for g in fusion.get("groups") or []:
        kernels.append({"kernel": g.get("kernel") or " + ".join(g.get("scheduler_nodes") or []), "extern": False,
                        "post": g.get("fx_nodes") or [], "source": g.get("capture_nodes")})
    for e in fusion.get("externs") or []:
        kernels.append({"kernel": e.get("kernel") or e.get("node"), "extern": True, "library": e.get("library"),
                        "node": e.get("node"), "post": e.get("fx_nodes") or [], "source": None})
    by_source: dict[str, dict[str, Any]] = {}
    has_source = any(k["source"] for k in kernels)
    for n, k in enumerate(kernels):
        k["id"] = f"k{n}"
        for s in k["source"] or []:
            row = by_source.setdefault(s, {"node": s, "op": src_ops.get(s, ""), "kernels": [], "post": set()})
            row["kernels"].append(k)
            row["post"] |= set(k["post"])
    sources = [{**r, "post": sorted(r["post"])} for r in by_source.values()]
    return {"kernels": kernels, "sources": sources, "post_ops": post_ops, "src_ops": src_ops,
            "has_source": has_source, "hooks": report.get("hooks") or {}, "note": fusion.get("note") or "",
            "observed_by": fusion.get("observed_by") or ""}


@router.get("/{key}/provenance")
async def provenance_page(request: Request, key: KeyPath, who: Viewer) -> Response:
    art = await _record(request, key, who)
    store = _store(request)

    def parts() -> tuple[dict[str, Any], dict[str, str]]:
        report = _optional(artifacts_route.report, art, store) or {}
        stages = report.get("stages") or {}
        full: dict[str, str] = {}
        # Graph code past MAX_INLINE_CODE is cut in the report: read the whole graph from the sources then.
        for name, block in (("post_grad", (stages.get("fusion") or {}).get("inductor_graph")),
                            ("capture", (stages.get("capture") or {}).get("graph"))):
            if isinstance(block, dict) and block.get("code_truncated") and block.get("file"):
                got = _optional(artifacts_route.source_file, art, block["file"], store)
                if got is not None:
                    full[name] = bytes(got.body).decode("utf-8", "replace")
        return report, full

    report, full = await run_in_threadpool(parts)
    return render(request, "provenance.html", nav="artifacts", art=art, prov=provenance(report, full))


def _code_headers(csp: str = highlight.CODE_CSP) -> dict[str, str]:
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store",
            "Referrer-Policy": "no-referrer", "Cross-Origin-Resource-Policy": "same-origin"}


@router.get("/{key}/code/{path:path}")
async def code_view(request: Request, key: KeyPath, path: SourcePath, who: Viewer) -> Response:
    """One generated file or graph, highlighted, as a page that can run nothing (see service.ui.highlight)."""
    art = await _record(request, key, who)
    limit = get_console_settings().code_view_max_kb * 1024
    got = await run_in_threadpool(artifacts_route.source_file, art, path, _store(request))
    data = bytes(got.body)
    if len(data) > limit:
        raise Unprocessable(f"{path} is {len(data)} bytes, over the code view's limit of {limit} bytes "
                            f"(AOTC_UI_CODE_VIEW_MAX_KB); open it as plain text: /ui/artifacts/{key}/raw/{path}")
    source = data.decode("utf-8", "replace")
    body = await run_in_threadpool(highlight.to_html, path, source)
    return Response(highlight.document(path, body), media_type="text/html; charset=utf-8", headers=_code_headers())


@router.get("/{key}/raw/{path:path}")
async def raw_source(request: Request, key: KeyPath, path: SourcePath, who: Viewer) -> Response:
    """The file as plain text (what GET /v1/artifacts/{key}/source/{path} serves), sandboxed all the same."""
    art = await _record(request, key, who)
    got = await run_in_threadpool(artifacts_route.source_file, art, path, _store(request))
    return Response(bytes(got.body), media_type="text/plain; charset=utf-8",
                    headers=_code_headers("default-src 'none'; sandbox"))
