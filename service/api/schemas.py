"""What the API takes and answers, as pydantic models: the OpenAPI schema at /docs.

Records that the store keeps (models, jobs, artifacts, workers, stage reports) are open: the stable fields are typed
and anything else a record holds passes through unchanged (`extra="allow"`). Routes answer with
`response_model_exclude_unset=True`, so an optional field that a record lacks stays absent rather than showing up
as null. Fields that may be ints in one record and floats in another are left untyped: a `float` field would turn
`3` into `3.0`.

Stored records are declared with their fields in alphabetical order: the store writes them as canonical JSON
(sorted keys), and declaring them in that order keeps the answers' key order as it was.

Errors are not rendered through these models (the app's exception handlers write them); `ErrorBody` documents
what they write, and `errors(...)` declares it on a route for each status code the route can answer with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi import Query
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    computed_field,
    with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from compiler.options import JSON_INT, CompileOptions
from compiler.speed import verdict


class Record(BaseModel):
    """A record the store keeps: typed where stable, open for the rest."""

    model_config = ConfigDict(extra="allow")


# -- errors ------------------------------------------------------------------------------------------------------


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str


class ErrorDetail(Record):
    code: str = Field(description="bad_request, unauthorized, forbidden, not_found, conflict, too_large, not_a_zip, "
                      "invalid, unsafe_archive, range_not_satisfiable, quota_jobs, internal, unavailable, "
                      "redis_unavailable, redis_error, insufficient_storage, quota_storage, disk_full (docs/api.md)")
    message: str = Field(description="What was wrong and, where it can say, what would be right.")
    request_id: str | None = Field(default=None, description="internal and redis_error: the id the server logged "
                                   "the failure under (also the X-Request-ID header).")
    errors: list[ValidationIssue] | None = Field(default=None, description="Request validation: each problem.")
    inputs: list[str] | None = Field(default=None, description="The inputs the exported program takes (422).")
    live_targets: list[str] | None = Field(default=None, description="Targets live workers serve (503).")
    state: str | None = Field(default=None, description="The job's state when it had already ended (409).")


class ErrorBody(BaseModel):
    """Every error answer: 4xx for a request the service refuses, 503 when it cannot serve it now."""

    error: ErrorDetail


_WHY = {
    400: "Malformed request (e.g. a body that is not JSON)",
    401: "No API key, or one the service does not know (send `Authorization: Bearer <key>`)",
    403: "The key's scope does not allow this request",
    404: "Not found (an id that cannot name a record, too: it does not match its pattern)",
    408: "The request body stalled or came too slowly (AOTC_BODY_IDLE_TIMEOUT_S, AOTC_BODY_MIN_RATE_KBPS); the "
         "connection is closed",
    409: "Conflicts with the current state",
    413: "Over the size limit (AOTC_MAX_UPLOAD_MB)",
    415: "Not a zip archive",
    422: "The request does not validate: `error.message` names each parameter and its bound",
    429: "The namespace has as many queued and running jobs as its quota allows (retry after Retry-After seconds)",
    503: "The service cannot reach its Redis, or Redis refused the command (retry after Retry-After seconds)",
    507: "Redis is out of memory or cannot write its disk, a disk or the blob store is full, or the namespace's "
         "stored bytes would pass its quota",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    429: _RETRY_AFTER, 503: _RETRY_AFTER, 507: _RETRY_AFTER,
}


def errors(*codes: int, why: Mapping[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entries for the errors a route can give, each with the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorBody, "description": (why or {}).get(code, _WHY[code])}
        if code in _HEADERS:
            out[code]["headers"] = _HEADERS[code]
    return out


# What every /v1 route can answer, whatever it does: its routers declare these (router-level `responses=`).
V1_ERRORS = errors(401, 403, 503, 507)


# -- parameters: the bounds every path and query parameter has (docs/api.md) -------------------------------------

MAX_LIMIT = 1000
JOB_ID = r"^[0-9a-f]{32}$"  # uuid4().hex (service/store/jobs.py)
MODEL_ID = r"^[0-9a-f]{8,64}$"  # the archive's sha256, or a prefix of 8+ hex digits (as `aotc models` prints)
ARTIFACT_KEY = r"^[0-9a-f]{32}$"  # compiler.cachekey.cache_key
MAX_SOURCE_PATH = 1024
MAX_TARGET = 64
MAX_SHAPE_ARG = 256  # one ?shape=NAME=SHAPE
MAX_SHAPE_ARGS = 64  # ?shape= given at most this often (one per input)
STREAM_ID = r"^[0-9]{1,19}(-[0-9]{1,19})?$"  # a Redis stream entry id (Last-Event-ID), each part below 2**64
INT64_MAX = 2**63 - 1  # compiler.shapes.INT64_MAX: every size fits in int64
# Grammars that pydantic enforces on the parameters and fields that carry them (Rust's regex engine, as the
# validators that read the published schema do), so the schema says exactly what is accepted. Each is no wider
# than the parser behind it (compiler.shapes, compiler.targets), which then never refuses a value that got this far.
IDENT = r"^[A-Za-z_][A-Za-z0-9_]*$"  # an input name: inputs are FX placeholders, named by identifiers
# Characters no name may hold: controls (Cc), format characters (Cf: bidi overrides, zero-width ones), private use
# (Co) and separators but the space (Zs, Zl, Zp), as Unicode 16 lists them: no terminal escapes, no text that reads
# backwards, no line breaks. Spelled out rather than as \p{C}: Python's str.isprintable() and the engines that read
# \p{...} know different Unicode versions (a letter of Unicode 15 was "unprintable" to Python 3.11), and schemathesis
# reads \p{C} as the controls alone; explicit ranges mean the same to all of them. Unassigned code points pass.
_NOT_IN_NAMES = (
    (0x0, 0x1F), (0x7F, 0xA0), (0xAD, 0xAD), (0x600, 0x605), (0x61C, 0x61C), (0x6DD, 0x6DD), (0x70F, 0x70F),
    (0x890, 0x891), (0x8E2, 0x8E2), (0x1680, 0x1680), (0x180E, 0x180E), (0x2000, 0x200F), (0x2028, 0x202F),
    (0x205F, 0x2064), (0x2066, 0x206F), (0x3000, 0x3000), (0xE000, 0xF8FF), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001), (0xE0020, 0xE007F), (0xF0000, 0xFFFFD), (0x100000, 0x10FFFD),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    # \uXXXX reads the same in ECMA, Rust and Python; past the BMP only the character itself does.
    def one(c: int) -> str:
        return f"\\u{c:04X}" if c <= 0xFFFF else chr(c)

    return "".join(one(a) if a == b else f"{one(a)}-{one(b)}" for a, b in ranges)


_NAME_CHAR = f"[^{_char_class(_NOT_IN_NAMES)}]"
# Printable text that is not blank (it starts, after any spaces, with a visible character), or nothing.
NAME_TEXT = f"^(?: *[^ {_char_class(_NOT_IN_NAMES)}]{_NAME_CHAR}*)?$"
TARGET = r"^(?:[Cc][Pp][Uu]|[Cc][Uu][Dd][Aa])(?:-[A-Za-z0-9_]+)*$"  # compiler.targets, in ASCII letters of any case
TARGETS_ITEM = r"^(?:[Aa][Ll][Ll]|(?:[Cc][Pp][Uu]|[Cc][Uu][Dd][Aa])(?:-[A-Za-z0-9_]+)*)$"  # a target, or 'all'
REF_MAX = 129  # compiler.refs.HARD_MAX_CHARS: the parser's bound; AOTC_MAX_REGISTRY_NAME_CHARS is the setting
REG_WORD_MAX = 64  # AOTC_MAX_REGISTRY_NAME_CHARS's default and ceiling: a path never holds a longer name or tag
REG_WORD = r"^[a-z0-9][a-z0-9._-]*$"  # a registry name or tag (compiler.refs)
REF = r"^[a-z0-9][a-z0-9._-]{0,63}(?::[a-z0-9][a-z0-9._-]{0,63}|@[1-9][0-9]{0,8})?$"  # NAME, NAME:TAG, NAME@VERSION
CONCRETE_TARGET = r"^(?:[Cc][Pp][Uu]|[Cc][Uu][Dd][Aa])(?:-[A-Za-z0-9_]+)+$"  # a host's target: 'cpu' will not do
_DIM = r"[0-9]{1,19}(?:\.\.[0-9]{1,19})?"  # a size or a range; 19 digits at most, as compiler.shapes reads them
ONE_DIM = rf"^{_DIM}$"
_SHAPE = rf"(?:|scalar|\(\)|{_DIM}(?:[xX]{_DIM})*)"
SHAPE = rf"^{_SHAPE}$"  # '8x3x224x224', '1..32x3', '' or 'scalar' for a 0-d input
SHAPE_ARG = rf"^[A-Za-z_][A-Za-z0-9_]*={_SHAPE}$"  # ?shape=NAME=SHAPE
# What a value outside each grammar is told (service/api/errors.py), `{value}` standing for the value.
PATTERN_RULES = {
    NAME_TEXT: "{value} is not printable text: a name may hold letters, digits, punctuation and spaces, but no "
               "control or formatting characters, and is not blank",
    TARGET: "unknown target {value}: use 'cpu', 'cuda', or a concrete target such as 'cuda-sm90' or "
            "'cpu-x86_64-v3'",
    ONE_DIM: "cannot read dim {value}: a dim is a size (8) or a range (1..32) of at most 19 digits (sizes fit in "
             "int64)",
    SHAPE: "cannot read shape {value}: each dim is a size (8) or a range (1..32) of at most 19 digits (sizes fit "
           "in int64), joined by 'x'",
    SHAPE_ARG: "cannot read {value}: write NAME=SHAPE, e.g. x=8x3x224x224 or x=1..32x3x224x224; NAME is an "
               "identifier, each dim at most 19 digits (sizes fit in int64)",
    IDENT: "{value} is not an input name: inputs are named by identifiers (letters, digits and '_')",
    REG_WORD: "{value} is not allowed as a name or tag: use lowercase letters, digits, '.', '_' and '-', starting "
              "with a letter or a digit",
    REF: "cannot read the reference {value}: write NAME, NAME:TAG or NAME@VERSION (from 1), where a name or tag is "
         "1 to 64 lowercase letters, digits, '.', '_' and '-', starting with a letter or a digit (e.g. "
         "bert-base:prod)",
    CONCRETE_TARGET: "{value} is not a host's target: give a concrete one, such as 'cpu-x86_64-avx2' or 'cuda-sm90'",
    STREAM_ID: "{value} is not an event id: send back the `id:` of an event this stream sent (digits, or "
               "digits-digits)",
}
# Parameters that name a record, and the rule each must meet: a value outside it names none, so the answer is the
# 404 an unknown id gets (service/api/errors.py), never a Redis read of some other key.
ID_PARAMS = {
    "job_id": ("job", "a job id is 32 hex digits"),
    "model_id": ("model", "a model id is 64 hex digits, or a unique prefix of 8 or more"),
    "key": ("artifact", "an artifact key is 32 hex digits"),
    "path": ("source file", f"a source path is at most {MAX_SOURCE_PATH} characters"),
}

Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"How many to list, newest first (1..{MAX_LIMIT}).")]


# -- shapes ------------------------------------------------------------------------------------------------------


class Range(Record):
    """A dynamic dim of a spec: min < max."""

    max: int
    min: int


class InputSpec(Record):
    """One input of a canonical spec (compiler.shapes): every user input in program order."""

    dtype: str
    name: str
    shape: list[int | Range]


class ProgramDim(Record):
    """A dynamic dim of an exported program: a symbol, or an expression of symbols, with its range."""

    expr: str | None = Field(default=None, description="A size expression, e.g. '2*s0'.")
    max: int | None = Field(default=None, description="None when unbounded.")
    min: int | None = None
    symbol: str | None = Field(default=None, description="Dims that share a symbol must be the same size.")


class ProgramInput(Record):
    dtype: str
    name: str
    shape: list[int | ProgramDim]


# -- models ------------------------------------------------------------------------------------------------------


class Params(Record):
    bytes: int
    count: int


class ModelRecord(Record):
    """An uploaded exported program, as inspected without unpickling anything."""

    created: float
    id: str = Field(description="The sha256 of the archive.")
    inputs: list[ProgramInput] = Field(description="The user inputs the program declares, in order.")
    name: str
    outputs: int | None = None
    params: Params | None = None
    pickles: list[str] | None = Field(default=None, description="Archive entries scanned as pickles.")
    root: str | None = None
    schema_version: str | None = None
    size: int = Field(description="Bytes.")
    torch_version: str | None = None


class ModelList(BaseModel):
    models: list[ModelRecord]


# -- artifacts ---------------------------------------------------------------------------------------------------


class CacheFactors(Record):
    """Everything the cache key hashes (compiler.cachekey)."""

    format: int
    model: str
    options: dict[str, Any]
    spec: list[InputSpec]
    target: str = Field(description="The concrete target, e.g. 'cuda-sm90' or 'cpu-x86_64-v3' (artifacts built "
                        "before x86-64 levels name ATen's capability, 'cpu-x86_64-avx512').")
    toolchain: dict[str, Any]


class BuiltBy(Record):
    device_name: str | None = None
    host: str | None = None
    id: str | None = None


_SPEED = ("What the check says about speed (compiler/speed.py): `vs_eager` (eager's median over the package's), "
          "`slower_than_eager` (published anyway, ranked below any artifact that is not), `graphs` (replayable; not "
          "replayable: a dynamic artifact runs plainly; or none) and `graphs_vs_eager`.")


class ArtifactRecord(Record):
    """A stored artifact: its cache-key factors, sizes, timings and the artifact check's result."""

    caches: Any = None
    check: dict[str, Any] | None = Field(
        default=None, description="The artifact check: passed, errors against eager, latencies, per point. "
        "`latency` holds the median and spread of each timing and how it was taken, `device_info` the device's name "
        "and clocks, `graphs` whether a CUDA-graph replay was captured and pays (`graph_ms`).")
    created: float
    dynamic_dims: Any = None
    factors: CacheFactors
    job_id: str | None = None
    key: str
    # Served alone (GET /v1/artifacts/{key}/manifest), never in meta, lookup or listings: it is most of the
    # record's bytes, and deploy-time lookups need none of it.
    manifest: Any = Field(default=None, exclude=True)
    model_id: str
    on_target: dict[str, Any] | None = Field(
        default=None, description="Absent: its builder served the target and checked it there. Else a package built "
        "without running it on its target (compiler/ontarget.py): state unverified (built_on: where it was built "
        "and checked), verified (checked_on, by: the countersigning key), or failed (why).")
    countersignatures: list[Any] | None = Field(
        default=None, description="DSSE envelopes by workers that checked the package on its target (compiler/"
        "signing.py, target-verification/v1); clients verify them against their trusted keys.")
    options: dict[str, Any]
    package: bool = Field(default=True, description="False for a report only (mode=training): no .pt2 to pull.")
    sha256: str | None = Field(description="The package's sha256 (its ETag); None for a report only.")
    size: int
    spec: list[InputSpec]
    target: str
    timings: dict[str, Any] | None = Field(default=None, description="Seconds per stage.")
    worker: BuiltBy | None = None

    @computed_field(description=_SPEED)  # type: ignore[prop-decorator]
    @property
    def speed(self) -> dict[str, Any]:
        return verdict(self.check, [i.model_dump() for i in self.spec])


class ArtifactList(BaseModel):
    artifacts: list[ArtifactRecord]


class StageReport(Record):
    """What each compiler stage saw (compiler.report, schema 1); `stages` maps each stage to its facts."""

    caches: Any = None
    device: str | None = None
    hooks: dict[str, Any] | None = None
    key: str | None = None
    mode: str | None = None
    notes: list[Any] | None = None
    options: dict[str, Any] | None = None
    schema_: int | None = Field(default=None, alias="schema")
    spec: list[InputSpec] | None = None
    stages: dict[str, dict[str, Any]] | None = Field(
        default=None, description="capture, autograd, lowering, fusion, codegen, package: each with its status, "
        "seconds, how it was observed, and its facts.")
    timings: dict[str, Any] | None = None
    torch: str | None = None


class SourceFile(BaseModel):
    path: str
    kind: Literal["graph", "kernels", "wrapper", "other"]
    bytes: int
    url: str = Field(description="Where to GET the file, as text.")


class SourceListing(BaseModel):
    key: str
    files: list[SourceFile]


# -- jobs --------------------------------------------------------------------------------------------------------

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class FailureRecord(Record):
    """Why a job failed (compiler.errors.Failure): retryable follows from the type."""

    type: str
    message: str | None = None
    stage: str | None = None
    excerpt: str | None = None
    retryable: bool | None = None


class JobRecord(Record):
    """A compile job. `key` is the cache key of what it produces; identical requests share one job."""

    id: str
    state: JobState
    stage: str | None = Field(default=None, description="queued, fetch, load, capture, ..., check, publish; "
                              "the state once it has ended.")
    key: str | None = None
    target: str | None = None
    priority: Literal["interactive", "batch"] | None = None
    model_id: str | None = None
    spec: list[InputSpec] | None = None
    options: dict[str, Any] | None = None
    toolchain: dict[str, Any] | None = None
    factors: dict[str, Any] | None = Field(default=None, description="What the cache key hashes (as CacheFactors).")
    created: float | None = None
    started: float | None = None
    finished: float | None = None
    attempts: int | None = Field(default=None, description="Claims so far, counted when a worker takes the job.")
    attempt: int | None = None
    max_attempts: int | None = None
    worker: str | None = Field(default=None, description="The worker running it.")
    last_worker: str | None = None
    artifact: str | None = Field(default=None, description="The artifact's key, once it succeeded.")
    timings: dict[str, Any] | None = None
    check: dict[str, Any] | None = None
    error: FailureRecord | None = None
    failures: list[dict[str, Any]] | None = Field(default=None, description="Each failed attempt.")
    not_before: float | None = Field(default=None, description="A retried job waits out its backoff: no worker "
                                     "takes it before this time (epoch seconds).")
    cancel_requested: bool


class JobList(BaseModel):
    jobs: list[JobRecord]


# -- compilations ------------------------------------------------------------------------------------------------


# What a compile request's `shapes` may hold, enforced by pydantic so the schema says it: per input (by its name),
# a list of dims or one string for the whole shape; each dim a size, a {min, max} range or a string. Whether they fit
# the program (the names, ranks, ranges, min <= max) only compiler.shapes can tell, against the stored model: a 422.
# Each union picks its branch by the value's JSON type (`Discriminator`), so a refusal names that branch's problem
# alone; the branch tags (UNION_TAGS) are left out of the error's location.
Size = Annotated[int, Field(ge=0, le=INT64_MAX), JSON_INT]


def _json_number(value: Any) -> Any:
    if isinstance(value, (bool, str, bytes)):  # pydantic's lax floats take true and "1.5"; JSON Schema does not
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


JSON_NUMBER = BeforeValidator(_json_number)  # after the bounds, as compiler.options.JSON_INT


@with_config(ConfigDict(extra="forbid"))
class DimRange(TypedDict):
    """A dynamic dim: every size from min to max. Validated into a plain dict, the form compiler.shapes reads."""

    min: Size
    max: Size


def _json_kind(value: Any) -> str | None:
    if isinstance(value, bool):  # JSON's true is no size, though Python's bool is an int
        return None
    if isinstance(value, float) and value.is_integer():  # 8.0 is an integer to JSON Schema
        return "<size>"
    return {int: "<size>", dict: "<range>", str: "<text>", list: "<list>"}.get(type(value))


UNION_TAGS = frozenset({"<size>", "<range>", "<text>", "<list>"})  # no input name: those are identifiers
Dim = Annotated[
    Annotated[Size, Tag("<size>")] | Annotated[DimRange, Tag("<range>")]
    | Annotated[str, StringConstraints(pattern=ONE_DIM), Tag("<text>")],
    Discriminator(_json_kind, custom_error_type="invalid_dim",
                  custom_error_message="a dim is a size (8), a range ({'min': 1, 'max': 32}) or a string ('1..32')"),
]
Dims = Annotated[
    Annotated[list[Dim], Tag("<list>")] | Annotated[str, StringConstraints(pattern=SHAPE), Tag("<text>")],
    Discriminator(_json_kind, custom_error_type="invalid_dims",
                  custom_error_message="an input's dims are a list or a string such as '8x3x224x224'"),
]
InputName = Annotated[str, StringConstraints(pattern=IDENT)]
# pydantic writes the key pattern as `patternProperties`, which leaves other keys free: say they are not.
Shapes = Annotated[dict[InputName, Dims], Field(min_length=1, json_schema_extra={"additionalProperties": False})]


class CompilationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: no "8" for 8, no true for 1

    model_id: str = Field(pattern=MODEL_ID, max_length=64, description="The id POST /v1/models returned (the sha256 "
                          "of the archive), or a unique prefix of it (8+ hex digits).")
    shapes: Shapes = Field(
        description="Per input, its dims: a size (8), a range ({'min': 1, 'max': 32}), or a string '1..32x3x224x224'.",
        examples=[{"x": [8, 3, 224, 224]}, {"x": [{"min": 1, "max": 32}, 3, 224, 224]}],
    )
    target: str = Field(default="cpu", pattern=TARGET, max_length=MAX_TARGET,
                        description="'cpu', 'cuda', or a concrete target: 'cuda-sm90', or an x86-64 level "
                        "'cpu-x86_64-v1' to 'cpu-x86_64-v4' (the old 'cpu-x86_64-default', '-avx2' and '-avx512' "
                        "are read as v1, v3 and v4). 'cpu' gets the level of most live CPU workers' hosts.")
    options: CompileOptions = Field(default_factory=CompileOptions)
    buckets: list[Shapes] = Field(
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
    targets: list[Annotated[str, StringConstraints(pattern=TARGETS_ITEM, max_length=MAX_TARGET)]] | None = Field(
        default=None, min_length=1, max_length=64,
        description="Several targets in one request, instead of `target`: one job per target (and per bucket), "
        "each routed to a worker that serves it. 'all' stands for every concrete target a live worker serves. A "
        "target that no live worker serves is reported in its entry of `targets` and does not fail the others.",
        examples=[["cpu-x86_64-avx2", "cuda-sm90"], ["all"]])
    name: str | None = Field(default=None, max_length=REF_MAX, pattern=REG_WORD,
                             description="Record a new version of this registry "
                             "name (in the caller's namespace) pointing at the model: lowercase letters, digits, "
                             "'.', '_', '-', at most AOTC_MAX_REGISTRY_NAME_CHARS.")
    tags: list[Annotated[str, StringConstraints(max_length=REF_MAX, pattern=REG_WORD)]] = Field(
        default_factory=list, max_length=16, description="Tags to move to the new version (needs `name`).")


Status = Literal["cached", "queued", "joined"]


class BucketAnswer(BaseModel):
    spec: list[InputSpec]
    status: Status
    key: str
    artifact: ArtifactRecord | None = None
    job: JobRecord | None = None


class TargetAnswer(BaseModel):
    """One target of a request with `targets`: as a one-target answer, or `unserved` (no live worker serves it) /
    `refused` (e.g. the job quota) with the error."""

    target: str = Field(description="The target as requested ('cpu', 'cuda-sm90').")
    status: Literal["cached", "queued", "joined", "unserved", "refused"]
    key: str | None = None
    artifact: ArtifactRecord | None = None
    job: JobRecord | None = None
    buckets: list[BucketAnswer] | None = None
    error: ErrorDetail | None = None


class VersionRecord(Record):
    """One version of a registry name: the model it points at, who made it and when, its tags, and the builds its
    compile request asked for (target, key, job)."""

    name: str
    version: int
    ref: str = Field(description="NAME@VERSION")
    model_id: str
    created: float
    by: str = Field(description="The id of the API key that made it.")
    tags: list[str]
    builds: list[dict[str, Any]]


class CompilationAnswer(BaseModel):
    """`cached` with the artifact, or `queued` (a new job) / `joined` (an identical job under way) with the job.
    With `targets`: `cached` when every target is, `queued` when every target has an artifact or a job, `partial`
    when some target is unserved or refused; then `key` is absent and `targets` has one entry per target."""

    status: Literal["cached", "queued", "joined", "partial"]
    key: str | None = Field(default=None, description="The cache key (absent with `targets`).")
    artifact: ArtifactRecord | None = None
    job: JobRecord | None = None
    buckets: list[BucketAnswer] | None = Field(default=None, description="One entry per requested bucket.")
    targets: list[TargetAnswer] | None = Field(default=None, description="With `targets`: one entry per target.")
    version: VersionRecord | None = Field(default=None, description="With `name`: the version recorded.")


# -- workers, caches, health -------------------------------------------------------------------------------------


class WorkerRecord(Record):
    """A live worker, as its last heartbeat described it."""

    device: str | None = None
    device_name: str | None = None
    heartbeat: float | None = None
    host: str | None = None
    id: str
    job: str | None = Field(default=None, description="The job it runs now; None when idle.")
    jobs_done: int | None = None
    pid: int | None = None
    started: float | None = None
    target: str = Field(description="The concrete target it compiles for by default: the highest it serves.")
    targets: list[str] | None = Field(default=None, description="Every target it serves, highest first: a CPU "
                                      "worker serves each x86-64 level at or below its host's (AOTC_WORKER_TARGETS "
                                      "narrows it). Absent for workers that predate levels.")
    build_only: list[str] | None = Field(
        default=None, description="Targets it builds without running them there (AOTC_BUILD_ONLY_TARGETS): their "
        "packages are published 'built, not run on target' until a worker that serves them natively countersigns "
        "them; it takes no verify job for them.")
    built_on: str | None = Field(default=None, description="With build_only: the target of its own host, where it "
                                 "checks what it builds.")
    toolchain: dict[str, Any]
    healthy: bool = Field(default=True, description="False: its compile children keep failing before their work "
                          "starts (a broken environment), so it claims no jobs until a probe child passes.")
    unhealthy_reason: str | None = Field(default=None, description="Why it is unhealthy: the last child's failure "
                                         "and the tail of its stderr.")
    unhealthy_since: float | None = None
    last_disk_full: str | None = Field(default=None, description="While a disk is full: the last job that ran out "
                                       "of space, in its own words (a child's output; /readyz, which needs no key, "
                                       "shows unhealthy_reason alone).")


class WorkerList(BaseModel):
    workers: list[WorkerRecord]


class Stats(BaseModel):
    compiles: int = Field(description="Compiles actually run (a cache hit runs none).")


class GemmTimings(BaseModel):
    namespace: str | None = Field(description="Whose compiles share the table; null for one of before namespaces.")
    target: str
    system: str
    entries: int


class CompileCaches(BaseModel):
    gemm_timings: list[GemmTimings] = Field(
        description="max-autotune's shared timings, per namespace, target and system.")
    inductor_entries: int = Field(description="Entries in Inductor's remote caches (Triton autotune results).")


class RemovedCounts(BaseModel):
    gemm_timings: int
    inductor_entries: int


class CachesRemoved(BaseModel):
    removed: RemovedCounts


class Health(BaseModel):
    ok: bool


class UnhealthyWorker(BaseModel):
    id: str
    target: str
    reason: str = Field(description="The worker's unhealthy_reason.")
    since: float | None = None


class Ready(BaseModel):
    ok: bool = Field(description="This API process can serve: its Redis answers and has room.")
    targets: list[str] = Field(description="The targets that healthy live workers serve.")
    degraded: bool = Field(default=False, description="Some live workers are unhealthy (they claim no jobs).")
    unhealthy_workers: list[UnhealthyWorker] = Field(default_factory=list, description="Those workers, and why.")


# -- signed artifacts (compiler/signing.py) ------------------------------------------------------------------------


class DsseSignature(BaseModel):
    keyid: str = Field(description="The signing key's id: the first 16 hex digits of the sha256 of its raw bytes.")
    sig: str = Field(description="The Ed25519 signature of PAE(payloadType, payload bytes), base64.")


class SignedManifest(BaseModel):
    """A DSSE envelope around an in-toto Statement v1 whose predicateType is https://aotc.dev/artifact-manifest/v1:
    the package's sha256 and size, the cache-key factors, the model's sha256, the toolchain, the target and the
    artifact check, signed by the worker that published it."""

    payloadType: Literal["application/vnd.in-toto+json"]
    payload: str = Field(description="The statement's JSON bytes, exactly as signed, base64.")
    signatures: list[DsseSignature]


class SigningKey(BaseModel):
    """A public key workers sign manifests with. A revoked key's signatures are refused by clients."""

    kid: str
    algorithm: Literal["ed25519"]
    public_key: str = Field(description="The raw 32-byte Ed25519 public key, base64.")
    created: float
    revoked_at: float | None = Field(description="When it was revoked; None while it is active.")


class SigningKeyList(BaseModel):
    keys: list[SigningKey] = Field(description="Every key, active and revoked, oldest first.")


# -- the registry: names, versions, tags (service/api/routes/names.py) ----------------------------------------


class TargetStatus(BaseModel):
    """What a version's model has for one target: `built` (an artifact, its key) or the state of the job its
    compile request queued (`queued`, `running`, `failed`, ...), or `unserved`."""

    target: str
    status: str
    key: str | None = None
    job: str | None = None
    spec: list[InputSpec] | None = None


class VersionDetail(VersionRecord):
    artifacts: list[TargetStatus] = Field(description="Per target: built artifacts, and the jobs still under way.")


class NameVersions(BaseModel):
    name: str
    versions: list[VersionDetail] = Field(description="Newest first; `latest` is on the newest.")


class NameSummary(BaseModel):
    name: str
    versions: int
    latest: int | None
    tags: dict[str, int] = Field(description="tag -> version")


class NameList(BaseModel):
    names: list[NameSummary]


class TagMove(BaseModel):
    """One tag move: `from` is null for a new tag, `to` for a removal (by `aotc untag`, or with its version)."""

    model_config = ConfigDict(populate_by_name=True)

    tag: str
    from_: int | None = Field(default=None, alias="from")
    to: int | None = None
    by: str
    at: float


class TagHistory(BaseModel):
    name: str
    moves: list[TagMove] = Field(description="Newest first, at most AOTC_TAG_HISTORY_LEN.")


class NewVersion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model_id: str = Field(pattern=MODEL_ID, max_length=64, description="A model of the caller's namespace (or a "
                          "unique prefix of its id).")
    tags: list[Annotated[str, StringConstraints(max_length=REG_WORD_MAX, pattern=REG_WORD)]] = Field(
        default_factory=list, max_length=16)


class TagRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    version: Annotated[int, Field(ge=1, le=999_999_999), JSON_INT] = Field(description="The version the tag moves "
                                                                            "to.")


class TagAnswer(BaseModel):
    name: str
    tag: str
    version: int | None = Field(description="The version the tag names now (None: removed).")
    previous: int | None = Field(description="The version it named before (None: a new tag).")


class VersionDeleted(BaseModel):
    ref: str
    tags_removed: list[str]
    model_still_held_by: int = Field(description="How many versions of the caller's namespace still hold the "
                                     "model (its artifacts stay pinned while any version of any namespace does).")


class Rejected(BaseModel):
    key: str
    target: str
    toolchain: dict[str, Any]
    spec: list[InputSpec]
    why: list[str] = Field(description="Each reason it cannot serve this host: target, toolchain, shapes.")


class Pick(BaseModel):
    """The artifact picked for a host, why, and why every other candidate lost."""

    ref: str = Field(description="What was asked for (NAME:TAG, NAME@VERSION).")
    version: VersionRecord
    host: str = Field(description="The host's concrete target the pick was made for.")
    key: str
    target: str
    match: Literal["exact", "compatible"]
    reason: str
    rejected: list[Rejected]
