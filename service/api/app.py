"""The FastAPI application. It never imports torch and never unpickles anything a user sent."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import redis
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import Receive, Scope, Send

from compiler.errors import AotcError
from service import ui
from service.api import errors, openapi
from service.api.auth import Keyring
from service.api.cache import Reads
from service.api.events import EventHub
from service.api.http import BodyDeadlines
from service.api.liveness import Liveness
from service.api.lookup import FastLookup
from service.api.routes import artifacts, compilations, health, jobs, keys, metrics, models, names, signing, workers
from service.api.routes.metrics import CountRequests, Scraper
from service.api.settings import Settings, get_settings
from service.api.slots import Slots
from service.api.storage import on_start, storage_options
from service.store import Store
from service.store.reaper import reap_all


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.redis_url:
            raise RuntimeError(
                "AOTC_REDIS_URL is not set: run `aotc-server`, which starts an embedded Redis, or set it")
        app.state.store = store = Store(settings.redis_url, storage=storage_options(settings))
        await run_in_threadpool(on_start, store)  # noeviction or refuse; announce the blob store
        # A bounded pool that makes a request wait for a free connection: the default pool refuses past 100
        # connections, which 128 concurrent lookups on one process reach (503s). Redis is one thread: more
        # connections add no throughput.
        # Retries as the sync client's (service/store): a connection that a Redis restart broke is replaced at its
        # next use, not answered with a 503.
        app.state.aredis = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=64, timeout=5, decode_responses=True, socket_connect_timeout=2.0,
            socket_timeout=10.0, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=3)))
        app.state.reads = Reads(app.state.aredis)  # the hot read paths: lookup, meta, model get
        # Event streams wait on one reader with its own connection, never on the pool (service/api/events.py).
        app.state.events = EventHub(settings.redis_url, app.state.aredis).start()
        app.state.slots = slots = Slots(app.state.aredis, settings.slot_lease_s)  # per-key caps
        admin_key = settings.bootstrap_admin_key()
        app.state.keyring = Keyring(app.state.aredis, admin_key, settings.auth_cache_s, insecure=settings.insecure)
        if admin_key is None:
            log.warning("AOTC_ADMIN_KEY is unset: the API runs open, without keys, and answers only clients on "
                        "loopback")
        app.state.scraper = Scraper(store)  # /metrics
        await run_in_threadpool(_backfill_model_ids, store)
        gc.freeze()  # what start-up made lives as long as the process: full collections need not walk it
        _watch_shutdown(app.state.draining)
        app.state.liveness = liveness = Liveness(settings.liveness_stall_s)  # /healthz
        liveness.start_monitor()
        if settings.reaper:
            liveness.start("reaper", partial(_reap_forever, store, settings), settings.reap_interval_s)
        liveness.start("slot renewer", slots.renew_forever, settings.slot_lease_s / 3)
        liveness.watch("event reader", app.state.events.task)  # idle while no one streams: only its end counts
        yield
        await liveness.stop()
        await app.state.events.close()
        await slots.close()
        await app.state.aredis.aclose()
        store.close()

    app = FastAPI(
        title="aotc",
        version="0.1.0",
        summary="Ahead-of-time compilation of torch.export programs into checked AOTInductor packages.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.draining = threading.Event()  # set on SIGTERM/SIGINT: event streams end so the drain can finish

    @app.exception_handler(AotcError)
    async def _aotc_error(request: Request, exc: AotcError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status, headers=getattr(exc, "headers", None))

    # Every other failure answers JSON too: validation (422, or 404 for an id that names nothing), no route, Redis
    # unreachable (503), out of memory (507) or refusing (503), and a last-resort 500 logged under a request id.
    errors.install(app)
    # Routes match in this order: artifacts first, since deploy-time lookups, metas and pulls are most of the
    # traffic (each route tried before the right one costs a match); then names, whose pick by tag is the fleet's
    # deploy-time path (last, it paid ~0.6 ms of matching per request); their paths overlap no other router's.
    routers = [m.router for m in (artifacts, names, health, metrics, models, compilations, jobs, workers, keys,
                                  signing)]
    for router in routers:
        app.include_router(router)
    ours = [route for router in routers for route in router.routes]
    app.router.routes.insert(0, MethodGate(ours, literal=True))
    app.router.routes.append(MethodGate(ours, literal=False))
    # The deploy-time lookup and pick, first: they skip FastAPI's per-request solving and hand the rest of their
    # requests on to the FastAPI routes (service/api/lookup.py PlainGet).
    app.router.routes[:0] = [FastLookup(), names.FastPick()]
    app.include_router(ui.router)  # the web console at /ui (service/ui): after the API's routes, so they match first
    openapi.install(app, settings)
    app.add_middleware(CountRequests)  # cache hits and misses, bytes served: /metrics
    # 408 for request bodies that stall or trickle (the header deadline is the protocol's: service/api/http.py).
    # 413 for a body over AOTC_MAX_BODY_KB on every route but the upload, before FastAPI parses it or checks a key.
    app.add_middleware(BodyDeadlines, idle_s=settings.body_idle_timeout_s, min_rate_kbps=settings.body_min_rate_kbps,
                       max_body_kb=settings.max_body_kb)
    return app


log = logging.getLogger("aotc.api")


class MethodGate(BaseRoute):
    """A 405 for a method the first path that matches a request lacks, with every method of that path in `Allow`.

    Starlette matches path and method together and takes the first route that matches both, so without this a
    method a path lacks fell through to a later route whose pattern also matches (DELETE /v1/jobs/deadletter
    reached DELETE /v1/jobs/{job_id}: a 404 for the id "deadletter"), and a 405 named the methods of one route of
    the path only (GET and HEAD of /v1/artifacts/{key} are two routes: `Allow: HEAD`). Two gates keep the first
    matching path the owner of a request: one before every route for the literal paths (a dictionary look-up, so
    the hot paths pay nothing more), which later parameterised paths can shadow, and one after every route, for
    the rest, which only a request that no route took reaches. A parameterised path that a later one shadows would
    need a third; the API has none (test_contract.py checks every path of the OpenAPI).
    """

    def __init__(self, routes: Sequence[BaseRoute], *, literal: bool) -> None:
        self.literal = literal
        self.paths: dict[str, tuple[re.Pattern[str], set[str]]] = {}
        for route in routes:
            if not isinstance(route, Route) or not route.methods or (literal and "{" in route.path):
                continue
            _, methods = self.paths.setdefault(route.path, (route.path_regex, set()))
            methods |= route.methods

    def _allowed(self, path: str) -> set[str] | None:
        if self.literal:
            found = self.paths.get(path)
            return found[1] if found else None
        return next((methods for regex, methods in self.paths.values() if regex.match(path)), None)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http":
            return Match.NONE, {}
        allowed = self._allowed(scope["path"])
        return (Match.FULL, {}) if allowed is not None and scope["method"] not in allowed else (Match.NONE, {})

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        allowed = self._allowed(scope["path"]) or set()
        raise HTTPException(405, headers={"Allow": ", ".join(sorted(allowed))})  # JSON by errors.py


def _watch_shutdown(draining: threading.Event) -> None:
    """Set `draining` when the server is told to stop, then let the server's own handler run.

    uvicorn drains on SIGTERM: it stops accepting and waits for open responses to end. Event streams never end by
    themselves, so they watch this flag and close (clients reconnect elsewhere with Last-Event-ID). Installed
    during lifespan startup, after the server has installed its handlers; it restores its own on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any, previous: Any = previous) -> None:
            draining.set()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, handler)


def _backfill_model_ids(store: Store) -> None:
    """Models stored before the short-id index existed get indexed once (a no-op after that)."""
    try:
        if n := store.models.backfill_ids():
            log.info("indexed the short ids of %d models stored before the index existed", n)
    except redis.RedisError as e:  # Redis down at start: the next start does it (lookups by full id work)
        log.warning("could not index model ids: %s", e)


async def _reap_forever(store: Store, settings: Settings, done: Callable[[], None]) -> None:
    """Requeue jobs whose worker was lost, wherever they are. Safe beside any number of other reapers. `done()`
    after each round, whatever its outcome, tells /healthz that the reaper is not stuck."""
    failing = False
    while True:
        await asyncio.sleep(settings.reap_interval_s)
        try:
            for job_id, what in await run_in_threadpool(reap_all, store, settings.lease_s):
                log.warning("reaper: job %s %s", job_id, what)
            if failing:
                log.info("reaper: works again")
            failing = False
        except Exception as e:  # Redis down: try again next round (said once, not every round)
            if not failing:
                log.warning("reaper: %s", e)
            failing = True
        done()

