"""The FastAPI application. It never imports torch and never unpickles anything a user sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from service.errors import AotcError
from service.routes import artifacts, compilations, health, jobs, models, workers
from service.settings import Settings, get_settings
from service.store import Store


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.redis_url:
            raise RuntimeError("AOTC_REDIS_URL is not set: run `aotc serve`, which starts an embedded Redis, or set it")
        app.state.store = Store(settings.redis_url, chunk_bytes=settings.chunk_mb * 2**20)
        yield
        app.state.store.close()

    app = FastAPI(
        title="aotc",
        version="0.1.0",
        summary="Ahead-of-time compilation of torch.export programs into checked AOTInductor packages.",
        lifespan=lifespan,
    )
    app.state.settings = settings

    @app.exception_handler(AotcError)
    async def _aotc_error(request: Request, exc: AotcError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for e in errors:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
        body = {"error": {"code": "invalid", "message": "; ".join(parts), "errors": [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in errors]}}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        msg = f"the service cannot reach its Redis ({exc}); try again shortly"
        return JSONResponse({"error": {"code": "redis_unavailable", "message": msg}}, status_code=503,
                            headers={"Retry-After": "2"})

    for module in (health, models, compilations, jobs, artifacts, workers):
        app.include_router(module.router)
    return app
