"""Every Redis key aotc uses, in one place.

All keys live under one prefix so a shared Redis can host aotc beside other tenants.

    models:index                  zset  model id -> upload time
    models:ids                    zset  model ids, all at score 0: short ids resolve by lex range (ZRANGEBYLEX)
    model:{id}                    str   model record (JSON)
    blob:{kind}:{id}              hash  blob manifest (the redis blob store): size, sha256, chunks, chunk_bytes, gen
    blob:{kind}:{id}:{gen}:{n}    str   chunk n of one write of a blob; it expires until the manifest names it
    blob:{kind}:{id}:{n}          str   chunk n of a blob written before chunks had a generation
    config:blob-store             str   the blob store the API uses (JSON url, id), for workers not told one
    job:{id}                      hash  job record; JSON-valued fields
    jobs:index                    zset  job id -> creation time
    job:{id}:events               stream of state/stage changes (for SSE and the CLI)
    inflight:{cache key}          str   job id of the one job computing that key (single-flight)
    queue:{target}:{priority}     stream of job ids for one concrete target and priority, group `workers`
    queues                        set   every queue stream, so a reaper anywhere can find expired leases
    backoff                       zset  job id -> when (epoch s) a retried job may go back in its stream; until
                                        then it is queued in no stream (service/store/scripts.py, PROMOTE)
    deadletter                    list  ids of jobs that failed for good
    artifact:{key}                str   artifact record (JSON): factors, sizes, timings, check
    report:{key}                  str   the artifact's stage report (JSON, compiler.report schema)
    (blob store) {blob id}        blob  the package (kind `artifact`) and a zip of the graphs and generated code
                                        (`sources`); the record's `blob`: {key}.{generation}, or the key
    artifacts:index               zset  artifact key -> creation time
    artifacts:by-model:{model}    set   artifact keys built from one model (deploy-time lookup)
    artifacts:pulled              zset  artifact key -> last pull (or publish) time: the eviction order
    artifacts:bytes               hash  artifact key -> bytes it holds in the blob store (package + sources)
    artifacts:total               int   the sum of artifacts:bytes, bounded by AOTC_STORE_MAX_GB
    artifacts:pinned              set   artifact keys that are never evicted
    blobs:garbage                 zset  blob id -> time after which its artifact/sources blobs are deleted
                                        (evicted ones: at once; a publish in progress: if it never finished);
                                        `weights:{sha256}` -> when a weights blob no artifact uses is deleted
    (blob store) {sha256}         blob  a model's weights at one precision (kind `weights`, safetensors), shared
                                        by every artifact whose manifest names that digest (compiler/weights.py)
    weights:users:{sha256}        set   artifact keys that bind this weights blob; empty: it goes to garbage
    weights:bytes                 hash  weights sha256 -> its bytes, counted once in artifacts:total
    probe                         str   a short-lived write that tells an out-of-memory Redis apart
    worker:{id}                   str   worker record (JSON), expires unless heartbeats renew it
    workers:index                 zset  worker id -> last heartbeat
    stats:compiles                int   compiles actually run (proves cache hits in tests)
    metrics:counters              hash  /metrics counters every API process adds to: cache hits and misses of
                                        POST /v1/compilations, package bytes served
    metrics:hist:{name}:{target}  hash  a /metrics histogram (compile or check seconds): bucket index -> count,
                                        plus `sum` and `count`
    metrics:observed              set   succeeded job ids already counted in those histograms (exactly once)
    apikeys                       hash  API key id -> key record (JSON): scope, namespace, name, created, revoked,
                                        and the sha256 of its secret (the secret itself is never stored)
    apikey:{sha256}               str   the id of the live key whose secret hashes to this (deleted on revoke)
    namespaces                    zset  namespace -> when it was first used
    ns:{ns}:models                zset  model id -> when this namespace uploaded it (its listing, its view)
    ns:{ns}:model-ids             zset  the same ids at score 0: this namespace's short ids (lex range)
    ns:{ns}:names                 hash  model id -> the name this namespace gave it
    ns:{ns}:jobs                  zset  job id -> when this namespace asked for it
    ns:{ns}:active                set   job ids this namespace may have queued or running (its job quota)
    ns:{ns}:quota                 hash  an admin's quotas for this namespace: max_jobs, max_stored_gb
    ns:{ns}:reserved              zset  job slots a compile request has taken against max_jobs and not yet filled
                                        -> when (ms, Redis's clock) the reservation lapses (scripts.py, ADMIT)
    job:{id}:namespaces           set   the namespaces whose requests share this job
    ns:{ns}:reg                   zset  the namespace's registry names -> when first used (service/store/names.py)
    ns:{ns}:reg:{name}:seq        int   the last version number given to the name (not reused until a gone name is
                                        forgotten)
    ns:{ns}:reg:{name}:versions   hash  version -> record (JSON): model_id, created, by, builds
    ns:{ns}:reg:{name}:tags       hash  tag -> version
    ns:{ns}:reg:{name}:history    list  tag moves, newest first (JSON: tag, from, to, by, at), capped at
                                        AOTC_TAG_HISTORY_LEN, and over the namespace at AOTC_MAX_TAG_HISTORY
    ns:{ns}:reg-history           int   how many tag moves all of the namespace's histories keep
    ns:{ns}:reg-gone              zset  names whose last version was deleted -> when; past AOTC_MAX_GONE_NAMES the
                                        oldest is forgotten (history, last version number)
    pins:model:{model}            set   the versions that hold a model ('{ns}/{name}@{v}'): while any does, the
                                        EVICT script keeps every artifact of that model
    tuning:gemm:{ns}:{target}:{system}
                                  hash  max-autotune matmul/conv timings shared by the workers' compiles of one
                                        namespace's jobs (worker/tuning.py): field JSON [op, inputs, precision,
                                        choice] -> milliseconds
    signing:keys                  hash  kid -> the public record (JSON) of a key workers sign manifests with:
                                        kid, algorithm, public_key (base64 raw), created, revoked_at (or null)
    slots:{kind}:{key id}         zset  what one API key holds open (kind `streams` or `uploads`): lease token ->
                                        when (ms, Redis's clock) it lapses unless its API process renews it
    api:{instance}:wake           stream one API process's wake-up call to its event reader (service/api/events.py);
                                        expires soon after its last use

Inductor's own remote caches write `pt2:*` keys outside this prefix (Triton autotune results) when a worker's
torch is pointed here; aotc no longer does, but `GET/DELETE /v1/caches` still count and drop any a Redis holds.
Neither kind expires; deleting them only costs later compiles their warm start.
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
MODEL_IDS = f"{PREFIX}models:ids"


def blob(kind: str, blob_id: str) -> str:
    return f"{PREFIX}blob:{kind}:{blob_id}"


def blob_chunk(kind: str, blob_id: str, n: int, gen: str = "") -> str:
    """Chunk `n` of one write (`gen`) of a blob; without `gen`, the layout from before writes had one."""
    return f"{blob_chunk_prefix(kind, blob_id, gen)}{n}"


def blob_chunk_prefix(kind: str, blob_id: str, gen: str = "") -> str:
    return f"{PREFIX}blob:{kind}:{blob_id}:{gen + ':' if gen else ''}"


BLOB_STORE = f"{PREFIX}config:blob-store"


def job(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


JOBS_INDEX = f"{PREFIX}jobs:index"


def inflight(cache_key: str) -> str:
    return f"{PREFIX}inflight:{cache_key}"


def queue(target: str, priority: str) -> str:
    return f"{PREFIX}queue:{target}:{priority}"


def verify_target(target: str) -> str:
    """The queue name (the job's `target`) of verify jobs for `target`: read only by workers that serve it natively
    (compiler/ontarget.py), never by one that builds it without running it there."""
    return f"verify/{target}"


QUEUES = f"{PREFIX}queues"


BACKOFF = f"{PREFIX}backoff"


DEADLETTER = f"{PREFIX}deadletter"


def artifact(key: str) -> str:
    return f"{PREFIX}artifact:{key}"


ARTIFACTS_INDEX = f"{PREFIX}artifacts:index"


def report(key: str) -> str:
    return f"{PREFIX}report:{key}"


def artifacts_by_model(model_id: str) -> str:
    return f"{PREFIX}artifacts:by-model:{model_id}"


ARTIFACTS_PULLED = f"{PREFIX}artifacts:pulled"
ARTIFACTS_BYTES = f"{PREFIX}artifacts:bytes"
ARTIFACTS_TOTAL = f"{PREFIX}artifacts:total"
ARTIFACTS_PINNED = f"{PREFIX}artifacts:pinned"
WEIGHTS_BYTES = f"{PREFIX}weights:bytes"
WEIGHTS_GARBAGE = "weights:"  # a blobs:garbage member naming a weights blob: this, then its sha256


def weights_users(sha256: str) -> str:
    return f"{PREFIX}weights:users:{sha256}"
BLOBS_GARBAGE = f"{PREFIX}blobs:garbage"
PROBE = f"{PREFIX}probe"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


WORKERS_INDEX = f"{PREFIX}workers:index"
COMPILES = f"{PREFIX}stats:compiles"
METRICS_COUNTERS = f"{PREFIX}metrics:counters"
METRICS_OBSERVED = f"{PREFIX}metrics:observed"


def metrics_histogram(name: str, target: str) -> str:
    return f"{PREFIX}metrics:hist:{name}:{target}"


def gemm_tuning(namespace: str, target: str, system: str) -> str:
    """Per namespace: a compile publishes the timings it measured for its job's namespace alone (worker/tuning.py
    says why)."""
    return f"{PREFIX}tuning:gemm:{namespace}:{target}:{system}"


APIKEYS = f"{PREFIX}apikeys"


def apikey(secret_sha256: str) -> str:
    return f"{PREFIX}apikey:{secret_sha256}"


NAMESPACES = f"{PREFIX}namespaces"


def ns(namespace: str, what: str) -> str:
    """A namespace's own index: models, model-ids, names, jobs, active, quota."""
    return f"{PREFIX}ns:{namespace}:{what}"


def reg(namespace: str, name: str, what: str) -> str:
    """One registry name's own keys (`what`: seq, versions, tags, history); the name is checked by compiler.refs."""
    return ns(namespace, f"reg:{name}:{what}")


def model_pins(model_id: str) -> str:
    """The versions holding a model. The EVICT script builds the same key from the prefix: keep them in step."""
    return f"{PREFIX}pins:model:{model_id}"


def job_namespaces(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:namespaces"


def slots(kind: str, key_id: str) -> str:
    """The leases of what one API key holds open: `kind` is streams or uploads."""
    return f"{PREFIX}slots:{kind}:{key_id}"


def api_wake(instance: str) -> str:
    return f"{PREFIX}api:{instance}:wake"


GEMM_TUNING_PATTERN = f"{PREFIX}tuning:gemm:*"
SIGNING_KEYS = f"{PREFIX}signing:keys"
# Inductor's remote-cache keys (torch._inductor.remote_cache.RedisRemoteCache: "pt2:{cache id}::{key}:c{n}").
INDUCTOR_PATTERN = "pt2:*"
