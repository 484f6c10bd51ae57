from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from compiler import cachekey
from compiler import shapes as specs
from compiler.errors import TooManyJobs, Unavailable, Unprocessable
from compiler.targets import Target, pick_worker, worker_targets
from service.api.auth import Compile, Principal, needs
from service.api.deps import SettingsDep, StoreDep, resolve_model
from service.api.lookup import find_artifact
from service.api.schemas import V1_ERRORS, CompilationAnswer, CompilationRequest, errors
from service.api.settings import Settings
from service.store import Store

router = APIRouter(prefix="/v1/compilations", tags=["compilations"], responses=V1_ERRORS,
                   dependencies=needs("compile"))


Found = tuple[dict[str, Any], str, dict[str, Any] | None]  # (cache-key factors, key, the artifact if cached)


def _find(store: Store, model: dict[str, Any], spec: list[dict[str, Any]], worker: dict[str, Any],
          options: dict[str, Any]) -> Found:
    factors = cachekey.factors(model["id"], spec, worker["target"], worker["toolchain"], options)
    key = cachekey.cache_key(factors)
    return factors, key, store.artifacts.get(key)


def _answer(store: Store, settings: Settings, who: Principal, model: dict[str, Any], spec: list[dict[str, Any]],
            found: Found, worker: dict[str, Any], options: dict[str, Any], priority: str,
            reservation: str | None = None) -> dict[str, Any]:
    """The answer for one spec: {"status": "cached", "key", "artifact"} or
    {"status": "queued"|"joined", "key", "job"}. "joined" only when the caller's namespace already asked for
    that job: a job another namespace asked for first answers "queued", as a new one would. A new job fills
    `reservation` (the job quota's, from `_admit_jobs`)."""
    factors, key, artifact = found
    if artifact:
        return {"status": "cached", "key": key, "artifact": artifact}
    job_id, _ = store.jobs.submit(
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
    # Decided by the namespace's own record alone (one atomic ZADD NX): of identical requests racing, exactly one
    # per namespace is "queued", even when another one's submit created the job first.
    new_here = store.namespaces.add_job(who.namespace, job_id, reservation)
    return {"status": "queued" if new_here else "joined", "key": key, "job": store.jobs.get(job_id)}


def _admit_jobs(store: Store, settings: Settings, ns: str, wanted: int) -> tuple[str, ...]:
    """Reserve `wanted` more jobs of the namespace's quota of queued plus running jobs, atomically with every other
    request (service/store/namespaces.py); 429 when they would pass it. Returns the reservations to fill."""
    quota = store.namespaces.quota(ns, settings.default_quota())
    got = store.namespaces.admit(ns, wanted, quota.max_jobs)
    if not got.admitted:
        pending = f" (and {got.reserved} being admitted for requests in flight)" if got.reserved else ""
        raise TooManyJobs(
            f"namespace {ns!r} has {got.active} jobs queued or running{pending} and asks for {wanted} more; its "
            f"quota is {quota.max_jobs} (max_jobs): wait for some to end, or ask an admin to raise it",
            quota="max_jobs", active=got.active, limit=quota.max_jobs)
    return got.reservations


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
    **errors(400, 404, 408, 422, 429, 503, why={
        404: "No such model",
        422: "The shapes contradict the exported program, or the target or options do not validate",
        503: "No live worker serves the target (error.live_targets lists those served), or Redis is unreachable",
    }),
})
def request_compilation(req: CompilationRequest, response: Response, store: StoreDep,
                        settings: SettingsDep, who: Compile) -> dict[str, Any]:
    """Compile a model for some shapes and a target, and optionally for extra static shape buckets.

    200 with the artifact when one is cached; otherwise 202 with the job (identical requests share one job).
    With `buckets`, the answer also lists one entry per bucket (its spec, key, and artifact or job); each bucket is
    cached under its own key, and the answer is 200 only when every one is cached.
    422 when the shapes contradict the exported program; 503 when no live worker serves the target.
    """
    model = resolve_model(store, req.model_id, who.ns)
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
                live = sorted({t for w in store.workers.live() for t in worker_targets(w)})
                raise Unavailable(
                    f"no live worker serves target {str(target)!r} (live targets: {live or 'none'}); "
                    f"start one on a matching machine with `aotc-worker`, or ask for one of the live targets",
                    live_targets=live,
                )
            answers.append({"status": "cached", "key": cached["key"], "artifact": cached})
    else:
        wanted = [spec, *bucket_specs]
        found = [_find(store, model, s, worker, options) for s in wanted]
        uncached = sum(1 for _, _, artifact in found if artifact is None)
        # Admins (operators, and open mode) have no quota.
        held = _admit_jobs(store, settings, who.ns, uncached) if uncached and who.ns is not None else ()
        slots = iter(held)
        try:
            answers = [_answer(store, settings, who, model, s, f, worker, options, req.priority,
                               None if f[2] else next(slots, None))
                       for s, f in zip(wanted, found, strict=True)]
        finally:
            if held and who.ns is not None:
                store.namespaces.release(who.ns, held)  # what is left unfilled: a failure, or jobs joined

    body = dict(answers[0])
    if req.buckets:
        body["buckets"] = [{"spec": s, **a} for s, a in zip(bucket_specs, answers[1:], strict=True)]
    if all(a["status"] == "cached" for a in answers):
        response.status_code = 200
        return body
    if "job" in body:
        response.headers["Location"] = f"/v1/jobs/{body['job']['id']}"
    return body
