from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from compiler.options import CompileOptions
from compiler import cachekey
from compiler.targets import Target, pick_worker
from compiler import shapes as specs
from service.api.deps import SettingsDep, StoreDep
from compiler.errors import Unavailable, Unprocessable
from service.api.lookup import find_artifact
from service.api.routes.models import resolve_model

router = APIRouter(prefix="/v1/compilations", tags=["compilations"])


class CompilationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(description="The id POST /v1/models returned (the sha256 of the archive).")
    shapes: dict[str, Any] = Field(
        description="Per input, its dims: a size (8), a range ({'min': 1, 'max': 32}), or a string '1..32x3x224x224'.",
        examples=[{"x": [8, 3, 224, 224]}, {"x": [{"min": 1, "max": 32}, 3, 224, 224]}],
    )
    target: str = Field(default="cpu", description="'cpu', 'cuda', or a concrete target such as 'cuda-sm90'.")
    options: CompileOptions = Field(default_factory=CompileOptions)
    buckets: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=16,
        description="Extra static shape buckets, each {input: dims} like `shapes` (e.g. batch 1, 8, 32). Each gets "
        "its own artifact under its own key; a client picks the smallest bucket that fits at run time, else the "
        "artifact for `shapes`.",
        examples=[[{"x": [1, 3, 224, 224]}, {"x": [8, 3, 224, 224]}, {"x": [32, 3, 224, 224]}]],
    )
    priority: Literal["interactive", "batch"] = Field(
        default="interactive",
        description="Workers serve every queued interactive job before any batch job. A request that joins a job "
        "already queued keeps that job's priority.",
    )


def _answer(store: Any, settings: Any, model: dict[str, Any], spec: list[dict[str, Any]], worker: dict[str, Any],
            options: dict[str, Any], priority: str) -> dict[str, Any]:
    """The answer for one spec: {"status": "cached", "key", "artifact"} or {"status": "queued"|"joined", "key", "job"}."""
    factors = cachekey.factors(model["id"], spec, worker["target"], worker["toolchain"], options)
    key = cachekey.cache_key(factors)
    artifact = store.get_artifact(key)
    if artifact:
        return {"status": "cached", "key": key, "artifact": artifact}
    job_id, created = store.submit_job(
        key,
        worker["target"],
        {
            "model_id": model["id"],
            "spec": spec,
            "options": options,
            "toolchain": worker["toolchain"],
            "factors": factors,
            "max_attempts": settings.job_max_attempts,
        },
        priority=priority,
    )
    return {"status": "queued" if created else "joined", "key": key, "job": store.get_job(job_id)}


def _bucket_specs(model: dict[str, Any], buckets: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for n, b in enumerate(buckets):
        try:
            spec = specs.canonical_spec(model["inputs"], b)
        except Unprocessable as e:
            raise Unprocessable(f"bucket {n}: {e.message}") from None
        if specs.is_dynamic(spec):
            raise Unprocessable(f"bucket {n} has a range; buckets are static shapes (put the range in `shapes`)")
        if spec not in out:
            out.append(spec)
    return out


@router.post("", status_code=202, responses={200: {"description": "Matching artifacts are cached"}})
def request_compilation(req: CompilationRequest, store: StoreDep, settings: SettingsDep) -> JSONResponse:
    """Compile a model for some shapes and a target, and optionally for extra static shape buckets.

    200 with the artifact when one is cached; otherwise 202 with the job (identical requests share one job).
    With `buckets`, the answer also lists one entry per bucket (its spec, key, and artifact or job); each bucket is
    cached under its own key, and the answer is 200 only when every one is cached.
    422 when the shapes contradict the exported program; 503 when no live worker serves the target.
    """
    model = resolve_model(store, req.model_id)
    spec = specs.canonical_spec(model["inputs"], req.shapes)
    bucket_specs = _bucket_specs(model, req.buckets)
    target = Target.parse(req.target)
    options = req.options.canonical()

    worker = pick_worker(target, store.live_workers())
    if worker is None:
        answers = []
        for s in [spec, *bucket_specs]:
            cached = find_artifact(store, model["id"], target, s, options)
            if not (cached and cached["factors"]["spec"] == s):
                live = sorted({w["target"] for w in store.live_workers()})
                raise Unavailable(
                    f"no live worker serves target {str(target)!r} (live targets: {live or 'none'}); "
                    f"start one on a matching machine with `aotc worker`, or ask for one of the live targets",
                    live_targets=live,
                )
            answers.append({"status": "cached", "key": cached["key"], "artifact": cached})
    else:
        answers = [_answer(store, settings, model, s, worker, options, req.priority) for s in [spec, *bucket_specs]]

    body = dict(answers[0])
    if req.buckets:
        body["buckets"] = [{"spec": s, **a} for s, a in zip(bucket_specs, answers[1:])]
    if all(a["status"] == "cached" for a in answers):
        return JSONResponse(body, status_code=200)
    headers = {"Location": f"/v1/jobs/{body['job']['id']}"} if "job" in body else {}
    return JSONResponse(body, status_code=202, headers=headers)
