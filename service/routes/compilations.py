from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from compiler.options import CompileOptions
from service import cachekey, specs, targets
from service.deps import SettingsDep, StoreDep
from service.errors import Unavailable
from service.lookup import find_artifact
from service.routes.models import resolve_model

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


@router.post("", status_code=202, responses={200: {"description": "A matching artifact is cached"}})
def request_compilation(req: CompilationRequest, store: StoreDep, settings: SettingsDep) -> JSONResponse:
    """Compile a model for some shapes and a target.

    200 with the artifact when one is cached; otherwise 202 with the job (identical requests share one job).
    422 when the shapes contradict the exported program; 503 when no live worker serves the target.
    """
    model = resolve_model(store, req.model_id)
    spec = specs.canonical_spec(model["inputs"], req.shapes)
    target = targets.validate(req.target)
    options = req.options.canonical()

    worker = targets.pick_worker(target, store.live_workers())
    if worker is None:
        cached = find_artifact(store, model["id"], target, spec, options)
        if cached and cached["factors"]["spec"] == spec:
            return JSONResponse({"status": "cached", "key": cached["key"], "artifact": cached}, status_code=200)
        live = sorted({w["target"] for w in store.live_workers()})
        raise Unavailable(
            f"no live worker serves target {target!r} (live targets: {live or 'none'}); "
            f"start one on a matching machine with `aotc worker`, or ask for one of the live targets",
            live_targets=live,
        )

    factors = cachekey.factors(model["id"], spec, worker["target"], worker["toolchain"], options)
    key = cachekey.cache_key(factors)
    artifact = store.get_artifact(key)
    if artifact:
        return JSONResponse({"status": "cached", "key": key, "artifact": artifact}, status_code=200)

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
    )
    job = store.get_job(job_id)
    return JSONResponse(
        {"status": "queued" if created else "joined", "key": key, "job": job},
        status_code=202,
        headers={"Location": f"/v1/jobs/{job_id}"},
    )
