"""Deploy-time lookup: the stored artifact that serves (model, shapes, target), without knowing its key.

`rank` is the rule; `find_artifact` applies it to what the store holds (POST /v1/compilations), and
`lookup_answer` is GET /v1/artifacts/lookup's hot path: one async round trip reads the model and its artifacts, and
the answer is rendered once per (query, artifact records) and kept in memory (service/api/cache.py says why that
can never serve an artifact that is gone).
"""

from __future__ import annotations

import json
import re
from typing import Any, get_args
from urllib.parse import parse_qsl

from starlette.datastructures import URLPath
from starlette.requests import Request
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Receive, Scope, Send

from compiler import cachekey, ontarget, speed
from compiler import shapes as specs
from compiler.errors import NotFound
from compiler.options import Mode
from compiler.targets import Target
from service.api import schemas
from service.api.auth import LOOPBACK, OPEN, Keyring, Principal
from service.api.cache import Reads
from service.api.deps import find_model, own_model_id
from service.store import Store


def _width(spec: list[dict[str, Any]]) -> int:
    """How much a spec's ranges span; 0 for a static spec. Narrower artifacts are more specialised."""
    return sum(d["max"] - d["min"] for inp in spec for d in inp["shape"] if isinstance(d, dict))


def rank(
    artifacts: list[dict[str, Any]], target: Target, spec: list[dict[str, Any]],
    options: dict[str, Any] | None = None, *, mode: str | None = None, graphs: bool = False,
    allow_unverified: bool = False,
) -> dict[str, Any] | None:
    """The best of a model's `artifacts` for `target` whose spec covers `spec`: static before dynamic, then the
    narrowest range, then the fastest (median) where the checks timed them all the same way on one kind of device,
    else the newest. `options`, when given, must match exactly; without them, report-only records (mode=training, no
    package) are never picked, nor train-step packages unless `mode` is "training". `mode`, when given, must be the
    artifact's compile mode. `graphs`: the caller will
    replay CUDA graphs (Client.load(cuda_graphs=True)), so the check's graph-replay medians rank, where every
    candidate has one that passed; otherwise the plain medians do. An artifact built before today's bounds (forced
    index asserts, compiler.bounds; `cachekey.bounded`) is never picked, nor is a CPU package built under an old
    label with -march=native (`cachekey.pinned`): only its own key reaches them. An artifact its check timed slower
    than eager (compiler.speed) is picked only where every candidate is: it never outranks one that is not, however
    specialised or new. A dynamic artifact's graph figure never ranks: a dynamic artifact is not replayed
    (compiler.speed.NOT_REPLAYABLE). A package built for the target without being run on it (compiler.ontarget) is
    picked only with `allow_unverified`, and then only where no countersigned or native build fits. A self-contained
    build (options.embed_weights) is picked only where no equally specialised weightless one fits."""
    fits = [
        a
        for a in artifacts
        if cachekey.bounded(a["factors"])
        and cachekey.pinned(a["factors"])
        and target.matches(a["factors"]["target"])
        and specs.covers(a["factors"]["spec"], [i["shape"] for i in spec])
        and (a["factors"]["options"] == options if options is not None
             else a.get("package", True) and (mode == "training") == _train_step(a))
        and (mode is None or a["factors"]["options"].get("mode") == mode)
    ]
    fits = ontarget.prefer(fits, allow_unverified)
    if not fits:
        return None
    fits = [a for a in fits if not _slower(a)] or fits
    widths = [_width(a["factors"]["spec"]) for a in fits]
    best = [a for a, w in zip(fits, widths, strict=True) if w == min(widths)]
    # A self-contained build (weights inside: `self-contained`, for tools that cannot bind a blob) serves only where
    # no package that binds the shared weights blob is as specialised: that one is the service's own answer.
    best = [a for a in best if not a["factors"]["options"].get("embed_weights")] or best
    timed = [(t, a) for a in best if (t := _measured(a, graphs)) is not None]
    if graphs and len(timed) < len(best):
        timed = [(t, a) for a in best if (t := _measured(a)) is not None]
    if len(best) > 1 and len(timed) == len(best) and len({t[0] for t, _ in timed}) == 1:
        # Equally specialised artifacts (say default and max-autotune of the same shapes) whose checks ran on the
        # same kind of device, timed the same way: serve the one whose median was fastest there. max-autotune wins
        # on some models and loses on others (bench/results/tuning-*), so the measured time, not the mode, decides.
        return min(timed, key=lambda ta: (ta[0][1], -ta[1]["created"]))[1]
    return max(best, key=lambda a: a["created"])


def _train_step(a: dict[str, Any]) -> bool:
    """A train-step package (mode=training): never served to an inference load, nor the reverse."""
    return bool(a["factors"]["options"].get("mode") == "training")


def _slower(a: dict[str, Any]) -> bool:
    return speed.verdict(a.get("check"), a["factors"]["spec"])["slower_than_eager"] is True


def find_artifact(
    store: Store, model_id: str, target: Target, spec: list[dict[str, Any]], options: dict[str, Any] | None = None,
    *, mode: str | None = None,
) -> dict[str, Any] | None:
    """`rank` over every artifact stored for `model_id`. A compile request asks what is built, so a build not yet
    run on its target counts (the pull refuses it until it is countersigned, compiler/ontarget.py)."""
    return rank(store.artifacts.for_model(model_id), target, spec, options, mode=mode, allow_unverified=True)


def _measured(a: dict[str, Any], graphs: bool = False) -> tuple[tuple[str, str], float] | None:
    """((device kind, timing method), the check's median latency in ms at the spec's first point), if the check
    timed it. Figures are comparable only with the same key: the same kind of device (its name, e.g. 'NVIDIA H100
    80GB HBM3') timed the same way (CUDA events with L2 flushed, wall clock; records from before the check kept
    its spread have no method and compare only with each other, by their median `compiled_ms`). With `graphs`, the
    CUDA-graph replay's median, if one was captured and agreed with eager (a replay does no CPU work, so this figure
    moves far less with the worker's load than a launch-bound plain run's: bench/README.md)."""
    check = a.get("check") or {}
    latency = check.get("latency") or {}
    if graphs and speed.is_dynamic(a["factors"]["spec"]):
        return None  # replayed by no client: its graph figure (if an old record holds one) promises nothing
    if graphs:  # no fallback to compiled_ms: that is the plain run's
        figure = (latency.get("graph") or {}) if (check.get("graphs") or {}).get("ok") else {}
        ms = figure.get("median_ms")
    else:
        figure = latency.get("compiled") or {}
        ms = figure.get("median_ms", check.get("compiled_ms"))
    device = (check.get("device_info") or {}).get("name") or (a.get("worker") or {}).get("device_name")
    if not isinstance(ms, (int, float)) or ms <= 0 or not device:
        return None
    return (str(device), str(figure.get("method") or "legacy")), float(ms)


def _unverified_note(records: list[dict[str, Any]], wanted: Target, spec: list[dict[str, Any]], mode: str | None,
                     allow_unverified: bool) -> str:
    """Why a 404 when only a build not run on its target (compiler.ontarget) fits: it says so, and how to take it."""
    if allow_unverified:
        return ""
    blind = rank(records, wanted, spec, mode=mode, allow_unverified=True)
    return f" that ran on its target; artifact {blind['key'][:12]} fits but was {ontarget.why_not(blind)}" if blind \
        else ""


async def lookup_answer(reads: Reads, model_id: str, target: str, shape: list[str], mode: str | None,
                        graphs: bool = False, allow_unverified: bool = False) -> bytes:
    """GET /v1/artifacts/lookup's JSON body: the artifact record `rank` picks; NotFound when none fits.

    One round trip reads the model and its artifact records as they are now. The rendered answer is kept per
    (model, target, shapes, mode, graphs) together with the artifact records it was ranked from, and served again only
    while Redis returns exactly those records: a published, deleted or rewritten artifact ranks afresh."""
    found = await find_model(reads, model_id, with_artifacts=True, trust_id=True)
    query = (found.model_id, target, tuple(shape), mode, graphs, allow_unverified)
    fingerprint = found.fingerprint
    body = reads.answers.get(query, fingerprint)
    if body is not None:
        return body
    spec = specs.canonical_spec(found.model["inputs"], specs.parse_shape_args(shape))
    wanted = Target.parse(target)
    records = {key: json.loads(raw) for key, raw in found.artifacts}
    art = rank(list(records.values()), wanted, spec, mode=mode, graphs=graphs, allow_unverified=allow_unverified)
    if art is None:
        note = _unverified_note(list(records.values()), wanted, spec, mode, allow_unverified)
        raise NotFound(f"no artifact of model {found.model_id[:12]} for {specs.format_spec(spec)} on "
                       f"{str(wanted)!r}{note}; request one with POST /v1/compilations")
    key = next(k for k, r in records.items() if r is art)
    return reads.answers.put(query, fingerprint, reads.meta(key, dict(found.artifacts)[key]))


_MODEL_ID = re.compile(schemas.MODEL_ID)
_TARGET = re.compile(schemas.TARGET)
_SHAPE_ARG = re.compile(schemas.SHAPE_ARG)
_MODES = frozenset(get_args(Mode))
BOOLS = {"true": True, "false": False, "1": True, "0": False}  # a subset of what a route reads as a bool
_SCALARS = frozenset({"model_id", "target", "mode", "graphs", "allow_unverified"})
_JSON = [(b"content-type", b"application/json")]


class PlainGet(BaseRoute):
    """A GET route served without FastAPI's per-request dependency and parameter solving, which was about 43 % of a
    lookup's time (bench/README.md): a plain Starlette route placed before every other (app.py), in front of the
    FastAPI route of the same path, which stays the one OpenAPI documents.

    It answers only a request that the FastAPI route would answer the same way: one whose parameters are all within
    the route's declared grammar (`parse`: the same patterns and limits, on ASCII only, with `fullmatch`, which is
    never looser than the route's validator; at most one of each scalar), from a key that `Keyring` knows with scope
    pull or more (or the open server's loopback caller). Everything else (a value outside the grammar, a second
    scalar, no key, a revoked one, scope short) is routed again past this route, to the FastAPI route itself, so
    every 401, 403 and 422 is the route's, word for word. `answer` runs the route's own code; its errors reach the
    app's handlers as the route's do."""

    def path_matches(self, path: str) -> bool:
        raise NotImplementedError

    def parse(self, scope: Scope) -> Any:
        """The request's parameters if every one is within the route's grammar, else None (the route answers)."""
        raise NotImplementedError

    async def answer(self, scope: Scope, who: Principal, parsed: Any) -> bytes:
        raise NotImplementedError

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (scope["type"] == "http" and scope["method"] == "GET" and _PASSED not in scope
                and self.path_matches(scope["path"])):
            return Match.FULL, {}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> URLPath:
        raise NoMatchFound(name, path_params)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        parsed = self.parse(scope)
        who = await _caller(scope) if parsed is not None else None
        if parsed is None or who is None:
            scope[_PASSED] = True  # no plain route matches it now: the router finds the FastAPI route
            await scope["router"](scope, receive, send)
            return
        body = await self.answer(scope, who, parsed)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode()), *_JSON]})
        await send({"type": "http.response.body", "body": body})


class FastLookup(PlainGet):
    """GET /v1/artifacts/lookup as a PlainGet: `own_model_id` (tenancy: another namespace's model answers 404), then
    `lookup_answer`."""

    def path_matches(self, path: str) -> bool:
        return path == PATH

    def parse(self, scope: Scope) -> Query | None:
        return _query(scope["query_string"])

    async def answer(self, scope: Scope, who: Principal, parsed: Query) -> bytes:
        model_id, target, shape, mode, graphs, unverified = parsed
        model_id = await own_model_id(Request(scope), who, model_id)
        return await lookup_answer(scope["app"].state.reads, model_id, target, shape, mode, graphs, unverified)


PATH = "/v1/artifacts/lookup"
_PASSED = "aotc.plain_get_passed"


Query = tuple[str, str, list[str], str | None, bool, bool]


def query_params(raw: bytes, scalars: frozenset[str]) -> tuple[dict[str, str], list[str]] | None:
    """A query string's `scalars` (at most one of each) and its `shape` arguments (each within SHAPE_ARG, at most
    MAX_SHAPE_ARGS), read as Starlette reads them (its QueryParams: names the route does not declare are ignored,
    as there); None where a value is not ASCII, a shape argument is outside its grammar, or a scalar comes twice
    (which of two the route takes is its business)."""
    values: dict[str, str] = {}
    shape: list[str] = []
    for name, value in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
        if not value.isascii():
            return None
        if name == "shape":
            if len(value) > schemas.MAX_SHAPE_ARG or not _SHAPE_ARG.fullmatch(value):
                return None
            shape.append(value)
        elif name in scalars:
            if name in values:
                return None
            values[name] = value
    return (values, shape) if len(shape) <= schemas.MAX_SHAPE_ARGS else None


def _query(raw: bytes) -> Query | None:
    """The lookup's parameters if every one is within the route's grammar, else None (the route answers)."""
    if (got := query_params(raw, _SCALARS)) is None:
        return None
    values, shape = got
    model_id, target = values.get("model_id"), values.get("target", "cpu")
    mode, graphs = values.get("mode"), BOOLS.get(values.get("graphs", "false"))
    unverified = BOOLS.get(values.get("allow_unverified", "false"))
    if (model_id is None or not _MODEL_ID.fullmatch(model_id) or len(target) > schemas.MAX_TARGET
            or not _TARGET.fullmatch(target) or (mode is not None and mode not in _MODES) or graphs is None
            or unverified is None):
        return None
    return model_id, target, shape, mode, graphs, unverified


async def _caller(scope: Scope) -> Principal | None:
    """The caller if it may look up (scope pull or more), else None: the route says why not."""
    keyring: Keyring = scope["app"].state.keyring
    if keyring.open:
        client = scope.get("client")
        host = client[0] if client else ""
        return OPEN if keyring.insecure or not host or host.startswith(LOOPBACK) else None
    token = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if token is not None:
                return None
            token = value
    if token is None or not token.startswith(b"Bearer ") or not token.isascii():
        return None
    secret = token[7:].decode("ascii")
    if not secret or secret != secret.strip() or " " in secret:
        return None
    who = await keyring.principal(secret)
    return who if who is not None and who.allows("pull") else None
