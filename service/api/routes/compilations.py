from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from compiler import cachekey, refs
from compiler import shapes as specs
from compiler.errors import TooManyJobs, Unavailable, Unprocessable
from compiler.targets import Target, pick_worker, worker_targets
from service.api.auth import Compile, Principal, needs
from service.api.deps import SettingsDep, StoreDep, check_room, resolve_model
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
            "namespace": who.namespace,  # the creator's (a joining request changes nothing): its tuning share
        },
        priority=priority,
    )
    # Decided by the namespace's own record alone (one atomic ZADD NX): of identical requests racing, exactly one
    # per namespace is "queued", even when another one's submit created the job first.
    new_here = store.namespaces.add_job(who.namespace, job_id, reservation)
    if new_here:
        store.namespaces.trim_jobs(who.namespace, settings.ns_kept_jobs)
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


def _compile_for(store: Store, settings: Settings, who: Principal, model: dict[str, Any], spec: list[dict[str, Any]],
                 bucket_specs: list[list[dict[str, Any]]], target: Target, options: dict[str, Any],
                 priority: str) -> dict[str, Any]:
    """The answer for one target: {"status", "key", "artifact"|"job"} and, with buckets, "buckets". Raises
    Unavailable when no live worker serves the target and not everything asked for is cached."""
    worker = pick_worker(target, store.workers.live())
    if worker is None:
        answers = []
        for s in [spec, *bucket_specs]:
            cached = find_artifact(store, model["id"], target, s, options)
            if not (cached and cached["factors"]["spec"] == s):
                live = sorted({t for w in store.workers.live() for t in worker_targets(w)})
                # A GPU worker's Inductor (torch 2.11) builds kernels for its own GPU only: a GPU architecture is
                # served by a worker on such a GPU, never by a newer one.
                own_gpu = ("; GPU workers build kernels for their own GPU's architecture only, so only a worker "
                           f"on an {target.arch} GPU can build it" if target.kind == "cuda" and target.arch else "")
                raise Unavailable(
                    f"no live worker serves target {str(target)!r} (live targets: {live or 'none'}); start one on a "
                    f"matching machine with `aotc-worker`, or ask for one of the live targets{own_gpu}",
                    live_targets=live,
                )
            answers.append({"status": "cached", "key": cached["key"], "artifact": cached})
    else:
        wanted = [spec, *bucket_specs]
        found = [_find(store, model, s, worker, options) for s in wanted]
        uncached = sum(1 for _, _, artifact in found if artifact is None)
        # Admins (operators, and open mode) have no quota. New work only: what is cached is answered over quota too.
        if uncached:
            check_room(store, settings, who, 1, f"{uncached} more artifact(s) to store")
        held = _admit_jobs(store, settings, who.ns, uncached) if uncached and who.ns is not None else ()
        slots = iter(held)
        try:
            answers = [_answer(store, settings, who, model, s, f, worker, options, priority,
                               None if f[2] else next(slots, None))
                       for s, f in zip(wanted, found, strict=True)]
        finally:
            if held and who.ns is not None:
                store.namespaces.release(who.ns, held)  # what is left unfilled: a failure, or jobs joined

    body = dict(answers[0])
    if bucket_specs:
        body["buckets"] = [{"spec": s, **a} for s, a in zip(bucket_specs, answers[1:], strict=True)]
    return body


def _targets(requested: list[str], live: list[dict[str, Any]], most: int) -> list[Target]:
    """The targets a request names, 'all' expanded to every concrete target a live worker serves (each level a CPU
    worker serves counts: compiler.targets.worker_targets), without repeats; 422 past AOTC_MAX_TARGETS_PER_REQUEST."""
    out: list[Target] = []
    for text in requested:
        if text.strip().lower() == "all":
            served = sorted({t for w in live for t in worker_targets(w)})
            if not served:
                raise Unavailable("the request asks for all targets, and no live worker serves any; start one with "
                                  "`aotc-worker`", live_targets=[])
            found = [Target.parse(t) for t in served]
        else:
            found = [Target.parse(text)]
        out.extend(t for t in found if t not in out)
    if len(out) > most:
        raise Unprocessable(f"the request names {len(out)} targets; the limit is {most} "
                            "(AOTC_MAX_TARGETS_PER_REQUEST)", setting="AOTC_MAX_TARGETS_PER_REQUEST")
    return out


def _builds(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a version records of its compile request: per target (and bucket), the key and the job."""
    out: list[dict[str, Any]] = []
    for e in entries:
        for a in [e, *(e.get("buckets") or [])]:
            if a.get("key"):
                job = a.get("job") or {}
                concrete = job.get("target") or (a.get("artifact") or {}).get("target") or e["target"]
                out.append({"target": concrete, "key": a["key"], "job": job.get("id"), "status": a["status"]})
        if not e.get("key"):
            out.append({"target": e["target"], "key": None, "job": None, "status": e["status"]})
    return out


@router.post("", status_code=202, response_model=CompilationAnswer, response_model_exclude_unset=True, responses={
    200: {"model": CompilationAnswer, "description": "Matching artifacts are cached"},
    **errors(400, 404, 408, 409, 422, 429, 503, 507, why={
        404: "No such model",
        409: "A tag of 'latest', which always names the newest version",
        422: "The shapes contradict the exported program, or the target, options, name or tags do not validate",
        503: "No live worker serves the target (error.live_targets lists those served), or none of `targets`, or "
             "Redis is unreachable",
        507: "The namespace holds its whole stored-bytes quota (quota_storage, max_stored_gb) and the request needs "
             "a compile (a cached answer is given over quota too), or Redis is out of memory",
    }),
})
def request_compilation(req: CompilationRequest, response: Response, store: StoreDep,
                        settings: SettingsDep, who: Compile) -> dict[str, Any]:
    """Compile a model for some shapes and a target, and optionally for extra static shape buckets.

    200 with the artifact when one is cached; otherwise 202 with the job (identical requests share one job).
    With `buckets`, the answer also lists one entry per bucket (its spec, key, and artifact or job); each bucket is
    cached under its own key, and the answer is 200 only when every one is cached.
    With `targets`, one job per target (and bucket); the answer lists every target in `targets`, and a target that
    no live worker serves is reported there without failing the others (503 only when none can be served).
    With `name` (and `tags`), a new version of that name in the caller's namespace points at the model, and the
    tags move to it.
    422 when the shapes contradict the exported program; 503 when no live worker serves the target.
    """
    if req.targets is not None and "target" in req.model_fields_set:
        raise Unprocessable("give `target` or `targets`, not both")
    if req.tags and req.name is None:
        raise Unprocessable("`tags` move to the version `name` records: give a name too")
    if req.name is not None:  # before anything is queued: a bad name leaves nothing behind
        limit = settings.max_registry_name_chars
        refs.check_word("name", req.name, limit, "AOTC_MAX_REGISTRY_NAME_CHARS")
        for tag in req.tags:
            refs.check_tag(tag, limit, "AOTC_MAX_REGISTRY_NAME_CHARS")
    model = resolve_model(store, req.model_id, who.ns)
    max_input_bytes = settings.max_input_mb * 2**20
    spec = specs.canonical_spec(model["inputs"], req.shapes, max_input_bytes=max_input_bytes)
    bucket_specs = _bucket_specs(model, req.buckets, max_input_bytes)
    if req.options.training and (why := specs.training_refusal(spec)):
        raise Unprocessable(why, field="shapes")
    options = req.options.canonical()

    if req.targets is None:
        body = _compile_for(store, settings, who, model, spec, bucket_specs, Target.parse(req.target), options,
                            req.priority)
        entries = [{"target": req.target, **body}]
        settled = [body, *body.get("buckets", [])]
    else:
        entries = []
        for target in _targets(req.targets, store.workers.live(), settings.max_targets_per_request):
            try:
                entries.append({"target": str(target), **_compile_for(store, settings, who, model, spec,
                                                                      bucket_specs, target, options, req.priority)})
            except Unavailable as e:
                entries.append({"target": str(target), "status": "unserved", **e.to_json()})
            except TooManyJobs as e:
                entries.append({"target": str(target), "status": "refused", **e.to_json()})
        served = [e for e in entries if e["status"] not in ("unserved", "refused")]
        if not served:
            raise Unavailable("none of the requested targets can be built now: " + "; ".join(
                f"{e['target']}: {e['error']['message']}" for e in entries),
                live_targets=sorted({t for w in store.workers.live() for t in worker_targets(w)}))
        settled = [a for e in served for a in [e, *e.get("buckets", [])]]
        status = ("partial" if len(served) < len(entries)
                  else "cached" if all(a["status"] == "cached" for a in settled) else "queued")
        body = {"status": status, "targets": entries}

    if req.name is not None:
        version = store.names.add_version(who.namespace, req.name, model["id"], who.key_id, tags=req.tags,
                                          builds=_builds(entries), limits=settings.registry_limits())
        body["version"] = version.to_json()
    if all(a["status"] == "cached" for a in settled):  # nothing queued (a partial answer says what is missing)
        response.status_code = 200
        return body
    if "job" in body:
        response.headers["Location"] = f"/v1/jobs/{body['job']['id']}"
    return body
