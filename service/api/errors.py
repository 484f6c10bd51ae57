"""How the API answers when something goes wrong: always JSON `{"error": {"code", "message", ...}}` (schemas.ErrorBody),
never a plain-text 500.

    request validation ........................ 422 invalid, naming each parameter and its bound; an id that
                                                cannot name a record (outside its pattern) is 404 not_found
    HTTP errors (no route, an unparseable body) their status: 404 not_found, 405, 400 bad_request
    AotcError (compiler.errors) ............... its status and code (app.py)
    Redis unreachable or too slow ............. 503 redis_unavailable, Retry-After
    Redis out of memory ....................... 507 insufficient_storage, Retry-After
    Redis cannot write its disk (MISCONF) ..... 507 insufficient_storage, Retry-After
    a disk or blob store with no room ......... 507 disk_full, Retry-After (service/api/disk.py: ENOSPC, EDQUOT,
                                                an S3 store's refusal), naming the disk, its free space and
                                                AOTC_DISK_LOW_WATER_MB
    Redis refused a command (WRONGTYPE, ...) .. 503 redis_error, Retry-After, logged under a request id
    anything else ............................. 500 internal, logged (with its traceback) under a request id

The request id is the caller's `X-Request-ID` when it is a short token, else a fresh one; the answer carries it in
`error.request_id` and the `X-Request-ID` header, so an operator finds the log line a client quotes.

A full Redis also refuses workers' heartbeats, so their registry records expire and a compile request would be
told that no live worker serves its target. When Redis is out of memory, that 503 becomes the 507 too: the
workers are not gone, Redis cannot hear them.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from compiler.errors import AotcError, Unavailable
from service.api.disk import full_disk
from service.api.schemas import ID_PARAMS, INT64_MAX, PATTERN_RULES, UNION_TAGS
from service.api.settings import Settings
from service.store import Store
from service.store.disk import is_disk_full
from service.store.memory import is_out_of_memory, oom_message, out_of_memory

log = logging.getLogger("aotc.api")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_ID_MISMATCH = {"string_pattern_mismatch", "string_too_long", "string_too_short"}
_MISCONF = re.compile(r"^MISCONF |of pipeline caused error: MISCONF ")  # alone, or inside a pipeline's error
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
               413: "too_large"}


class InsufficientStorage(AotcError):
    """Redis is out of memory (507). Not in compiler.errors' tree: only the API meets Redis."""

    status, code = 507, "insufficient_storage"


def insufficient_storage(message: str) -> JSONResponse:
    return JSONResponse(InsufficientStorage(message).to_json(), status_code=507, headers={"Retry-After": "30"})


def cannot_persist(exc: BaseException) -> bool:
    """Redis refuses writes because it cannot write its AOF or RDB file (a full disk, most often): MISCONF."""
    return isinstance(exc, redis.ResponseError) and _MISCONF.search(str(exc)) is not None


def request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _unknown_id(problems: Sequence[Any]) -> str | None:
    """The 404 message when every problem is an id that cannot name a record (ID_PARAMS), else None."""
    found = []
    for e in problems:
        loc = tuple(e.get("loc", ()))
        if not (len(loc) == 2 and loc[0] in ("path", "query", "body") and loc[1] in ID_PARAMS
                and e.get("type") in _ID_MISMATCH):
            return None
        noun, rule = ID_PARAMS[str(loc[1])]
        found.append(f"no {noun} {_shown(e.get('input'))} ({rule})")
    return "; ".join(found) if found else None


def _explained(e: Any) -> str:
    """Pydantic's message, or for a value outside one of the API's grammars or past int64, what the rule is."""
    ctx = e.get("ctx") or {}
    if e.get("type") == "string_pattern_mismatch" and ctx.get("pattern") in PATTERN_RULES:
        return PATTERN_RULES[ctx["pattern"]].format(value=_shown(e.get("input")))
    if e.get("type") == "less_than_equal" and ctx.get("le") == INT64_MAX:
        return f"{_shown(e.get('input'))} does not fit in int64 (at most {INT64_MAX})"
    return str(e.get("msg"))


def _validation_answer(exc: RequestValidationError) -> JSONResponse:
    problems = exc.errors()
    if (missing := _unknown_id(problems)) is not None:
        return JSONResponse({"error": {"code": "not_found", "message": missing}}, status_code=404)
    parts, issues = [], []
    for e in problems:
        loc = [p for p in e.get("loc", ()) if p not in UNION_TAGS]
        where, msg = ".".join(str(p) for p in loc if p != "body"), _explained(e)
        parts.append(f"{where}: {msg}" if where else msg)
        issues.append({"loc": loc, "msg": msg})
    body = {"error": {"code": "invalid", "message": "; ".join(parts), "errors": issues}}
    return JSONResponse(body, status_code=422)


def _logged(request: Request, status: int, code: str, message: str, **headers: str) -> JSONResponse:
    rid = request_id(request)
    return JSONResponse({"error": {"code": code, "message": f"{message} (logged as request {rid})",
                                   "request_id": rid}}, status_code=status, headers={"X-Request-ID": rid, **headers})


def install(app: FastAPI) -> None:
    """The exception handlers above, on `app` (AotcError's own is in app.py)."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_answer(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        path = _shown(request.url.path)
        message = {404: f"no route {request.method} {path}; the API's routes are listed at /docs",
                   405: f"{request.method} is not allowed on {path}"}.get(status, str(exc.detail))
        return JSONResponse({"error": {"code": _HTTP_CODES.get(status, "http_error"), "message": message}},
                            status_code=status, headers=exc.headers)

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        msg = f"the service cannot reach its Redis ({exc}); try again shortly"
        return JSONResponse({"error": {"code": "redis_unavailable", "message": msg}}, status_code=503,
                            headers={"Retry-After": "2"})

    @app.exception_handler(redis.ResponseError)
    async def _redis_refused(request: Request, exc: redis.ResponseError) -> JSONResponse:
        if is_out_of_memory(exc):
            store: Store = request.app.state.store
            return insufficient_storage(await run_in_threadpool(oom_message, store.r))
        if cannot_persist(exc):
            said = str(exc)[str(exc).find("MISCONF"):][:300]
            return insufficient_storage(f"Redis refuses writes: it cannot write to its disk ({said}). "
                                        "Free space where Redis keeps its data (the embedded Redis: "
                                        "AOTC_DATA_DIR/redis); it takes writes again once a write of its file works")
        answer = _logged(request, 503, "redis_error", f"Redis refused a command this request needed "
                         f"({str(exc)[:100] or type(exc).__name__}); try again shortly, and report it if it "
                         "persists", **{"Retry-After": "2"})
        log.error("request %s: %s %s: Redis refused a command: %s", answer.headers["x-request-id"],
                  request.method, request.url.path, exc)
        return answer

    @app.exception_handler(redis.RedisError)
    async def _redis_failed(request: Request, exc: redis.RedisError) -> JSONResponse:
        answer = _logged(request, 503, "redis_error", f"the service's Redis client failed ({type(exc).__name__}); "
                         "try again shortly", **{"Retry-After": "2"})
        log.error("request %s: %s %s: Redis client error: %r", answer.headers["x-request-id"], request.method,
                  request.url.path, exc)
        return answer

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        store: Store = request.app.state.store
        try:
            full = await run_in_threadpool(out_of_memory, store.r)
        except redis.RedisError:
            full = None
        if full:
            return insufficient_storage(f"{full}. ({exc.message}: Redis refuses the workers' heartbeats, so none "
                                        "looks live.)")
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=getattr(exc, "headers", None))

    @app.exception_handler(OSError)
    async def _os_error(request: Request, exc: OSError) -> JSONResponse:
        # A write anywhere in a request that failed for want of room (the upload's own path says more, in
        # service/api/disk.py); any other OSError is a failure of ours, as below.
        if not is_disk_full(exc):
            return _internal_error(request, exc)
        settings: Settings = request.app.state.settings
        full = full_disk(settings.data_dir, settings, exc, f"answering {request.method} {request.url.path[:80]}")
        log.warning("%s %s: %s", request.method, request.url.path[:80], full.message)
        return JSONResponse(full.to_json(), status_code=full.status, headers=full.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request, exc)


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # The last resort (Starlette's ServerErrorMiddleware calls it, then re-raises for the server's own log).
    # It should never run: every failure a request can meet has its answer above.
    # Connection: close, since the server closes the connection after this (its error handling re-raises):
    # a client that reused it would meet a reset.
    answer = _logged(request, 500, "internal", "the server failed to answer this request", Connection="close")
    log.error("request %s: %s %s failed", answer.headers["x-request-id"], request.method, request.url.path,
              exc_info=exc)
    return answer
