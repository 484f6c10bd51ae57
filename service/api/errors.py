"""How the API answers a Redis that is out of memory: a JSON 507 (insufficient storage) that says so, from any
route, instead of a plain-text 500.

A full Redis also refuses workers' heartbeats, so their registry records expire and a compile request would be
told that no live worker serves its target. When Redis is out of memory, that 503 becomes this 507 too: the
workers are not gone, Redis cannot hear them.
"""

from __future__ import annotations

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from compiler.errors import AotcError, Unavailable
from service.store import Store
from service.store.memory import is_out_of_memory, oom_message, out_of_memory


class InsufficientStorage(AotcError):
    """Redis is out of memory (507). Not in compiler.errors' tree: only the API meets Redis."""

    status, code = 507, "insufficient_storage"


def insufficient_storage(message: str) -> JSONResponse:
    return JSONResponse(InsufficientStorage(message).to_json(), status_code=507, headers={"Retry-After": "30"})


def install(app: FastAPI) -> None:
    @app.exception_handler(redis.ResponseError)
    async def _redis_refused(request: Request, exc: redis.ResponseError) -> JSONResponse:
        if not is_out_of_memory(exc):
            raise exc  # a bug, not the user's nor Redis's state: the server error it always was
        store: Store = request.app.state.store
        return insufficient_storage(await run_in_threadpool(oom_message, store.r))

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
        return JSONResponse(exc.to_json(), status_code=exc.status)
