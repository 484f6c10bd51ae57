from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from compiler import cachekey
from compiler import shapes as specs
from compiler.errors import Unavailable, Unprocessable
from compiler.targets import Target, pick_worker
from service.api.deps import SettingsDep, StoreDep, resolve_model
from service.api.lookup import find_artifact
from service.api.schemas import CompilationAnswer, CompilationRequest, errors
from service.api.settings import Settings
from service.store import Store

router = APIRouter(prefix="/v1/compilations", tags=["compilations"])


def _answer(store: Store, settings: Settings, model: dict[str, Any], spec: list[dict[str, Any]],
            worker: dict[str, Any], options: dict[str, Any], priority: str) -> dict[str, Any]:
    """The answer for one spec: {"status": "cached", "key", "artifact"} or
    {"status": "queued"|"joined", "key", "job"}."""
    factors = cachekey.factors(model["id"], spec, worker["target"], worker["toolchain"], options)
    key = cachekey.cache_key(factors)
    artifact = store.artifacts.get(key)
    if artifact:
        return {"status": "cached", "key": key, "artifact": artifact}
    job_id, created = store.jobs.submit(
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
    return {"status": "queued" if created else "joined", "key": key, "job": store.jobs.get(job_id)}


def _bucket_specs(model: dict[str, Any], buckets: list[dict[str, Any]],
                  max_input_bytes: int) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for n, b in enumerate(buckets):
        try:
            spec = specs.canonical_spec(model["inputs"], b, max_input_bytes=max_input_bytes)
        except Unprocessable as e:
            raise Unprocessable(f"bucket {n}: {e.message}") from None
        if specs.is_dynamic(spec):
            raise Unprocessable(f"bucket {n} has a range; buckets are static shapes (put the range in `shapes`)")
        if spec not in out:
            out.append(spec)
    return out


@router.post("", status_code=202, response_model=CompilationAnswer, response_model_exclude_unset=True, responses={
    200: {"model": CompilationAnswer, "description": "Matching artifacts are cached"},
    **errors(404, 422, 503, why={
        404: "No such model",
        422: "The shapes contradict the exported program, or the target or options do not validate",
        503: "No live worker serves the target (error.live_targets lists those served), or Redis is unreachable",
    }),
})
def request_compilation(req: CompilationRequest, response: Response, store: StoreDep,
                        settings: SettingsDep) -> dict[str, Any]:
    """Compile a model for some shapes and a target, and optionally for extra static shape buckets.

    200 with the artifact when one is cached; otherwise 202 with the job (identical requests share one job).
    With `buckets`, the answer also lists one entry per bucket (its spec, key, and artifact or job); each bucket is
    cached under its own key, and the answer is 200 only when every one is cached.
    422 when the shapes contradict the exported program; 503 when no live worker serves the target.
    """
    model = resolve_model(store, req.model_id)
    max_input_bytes = settings.max_input_mb * 2**20
    spec = specs.canonical_spec(model["inputs"], req.shapes, max_input_bytes=max_input_bytes)
    bucket_specs = _bucket_specs(model, req.buckets, max_input_bytes)
    target = Target.parse(req.target)
    options = req.options.canonical()

    worker = pick_worker(target, store.workers.live())
    if worker is None:
        answers = []
        for s in [spec, *bucket_specs]:
            cached = find_artifact(store, model["id"], target, s, options)
            if not (cached and cached["factors"]["spec"] == s):
                live = sorted({w["target"] for w in store.workers.live()})
                raise Unavailable(
                    f"no live worker serves target {str(target)!r} (live targets: {live or 'none'}); "
                    f"start one on a matching machine with `aotc-worker`, or ask for one of the live targets",
                    live_targets=live,
                )
            answers.append({"status": "cached", "key": cached["key"], "artifact": cached})
    else:
        answers = [_answer(store, settings, model, s, worker, options, req.priority) for s in [spec, *bucket_specs]]

    body = dict(answers[0])
    if req.buckets:
        body["buckets"] = [{"spec": s, **a} for s, a in zip(bucket_specs, answers[1:], strict=True)]
    if all(a["status"] == "cached" for a in answers):
        response.status_code = 200
        return body
    if "job" in body:
        response.headers["Location"] = f"/v1/jobs/{body['job']['id']}"
    return body
