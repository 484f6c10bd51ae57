"""Every Redis key aotc uses, in one place.

All keys live under one prefix so a shared Redis can host aotc beside other tenants.

    models:index                  zset  model id -> upload time
    model:{id}                    str   model record (JSON)
    blob:{kind}:{id}              hash  blob manifest: size, sha256, chunk count
    blob:{kind}:{id}:{n}          str   chunk n of a blob (each < 512 MB, Redis' string limit)
    job:{id}                      hash  job record; JSON-valued fields
    jobs:index                    zset  job id -> creation time
    job:{id}:events               stream of state/stage changes (for SSE and the CLI)
    inflight:{cache key}          str   job id of the one job computing that key (single-flight)
    queue:{target}:{priority}     stream of job ids for one concrete target and priority, group `workers`
    queues                        set   every queue stream, so a reaper anywhere can find expired leases
    deadletter                    list  ids of jobs that failed for good
    artifact:{key}                str   artifact record (JSON): factors, sizes, timings, check
    report:{key}                  str   the artifact's stage report (JSON, compiler.report schema)
    blob:sources:{key}            blob  zip of the artifact's stage graphs and generated code
    artifacts:index               zset  artifact key -> creation time
    artifacts:by-model:{model}    set   artifact keys built from one model (deploy-time lookup)
    worker:{id}                   str   worker record (JSON), expires unless heartbeats renew it
    workers:index                 zset  worker id -> last heartbeat
    stats:compiles                int   compiles actually run (proves cache hits in tests)
    tuning:gemm:{target}:{system} hash  max-autotune matmul/conv timings shared by workers (worker/tuning.py):
                                        field JSON [op, inputs, precision, choice] -> milliseconds

Inductor's own remote caches, when workers point them here (AOTC_INDUCTOR_REMOTE_CACHE), write `pt2:*` keys
outside this prefix: Triton autotune results, small JSON values that torch keys by its own version, Triton's
and the GPU's. Neither kind expires; deleting them only costs later compiles their warm start.
"""

from __future__ import annotations

PREFIX = "aotc:"
QUEUE_GROUP = "workers"
# Priorities, most urgent first: a worker serves every interactive job before any batch job.
PRIORITIES = ("interactive", "batch")
# The consumer name reapers claim expired leases under (shared, so reapers never pile up consumer names).
REAPER = "reaper"


def model(model_id: str) -> str:
    return f"{PREFIX}model:{model_id}"


MODELS_INDEX = f"{PREFIX}models:index"


def blob(kind: str, blob_id: str) -> str:
    return f"{PREFIX}blob:{kind}:{blob_id}"


def blob_chunk(kind: str, blob_id: str, n: int) -> str:
    return f"{PREFIX}blob:{kind}:{blob_id}:{n}"


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


JOBS_INDEX = f"{PREFIX}jobs:index"


def inflight(cache_key: str) -> str:
    return f"{PREFIX}inflight:{cache_key}"


def queue(target: str, priority: str) -> str:
    return f"{PREFIX}queue:{target}:{priority}"


QUEUES = f"{PREFIX}queues"


DEADLETTER = f"{PREFIX}deadletter"


def artifact(key: str) -> str:
    return f"{PREFIX}artifact:{key}"


ARTIFACTS_INDEX = f"{PREFIX}artifacts:index"


def report(key: str) -> str:
    return f"{PREFIX}report:{key}"


def artifacts_by_model(model_id: str) -> str:
    return f"{PREFIX}artifacts:by-model:{model_id}"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


WORKERS_INDEX = f"{PREFIX}workers:index"
COMPILES = f"{PREFIX}stats:compiles"


def gemm_tuning(target: str, system: str) -> str:
    return f"{PREFIX}tuning:gemm:{target}:{system}"


GEMM_TUNING_PATTERN = f"{PREFIX}tuning:gemm:*"
# Inductor's remote-cache keys (torch._inductor.remote_cache.RedisRemoteCache: "pt2:{cache id}::{key}:c{n}").
INDUCTOR_PATTERN = "pt2:*"
