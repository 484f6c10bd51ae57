"""A job's progress as Server-Sent Events.

The stream replays the job's event history (its `job:{id}:events` Redis stream), then follows it live, so a client
that connects late or reconnects with `Last-Event-ID` misses nothing:

    id: 1763771323244-0
    event: state
    data: {"state": "running", "stage": "compile", "ts": "1763771323.244"}

    event: end
    data: {...the whole job record, with its artifact or its error...}

It ends after `end`. It also ends (without `end`) when the API shuts down or Redis goes away, after an
`unavailable` event; clients reconnect with `Last-Event-ID`. A `: keepalive` comment goes out every few seconds
while nothing happens, which keeps proxies from closing an idle stream.

No stream holds a Redis connection while it waits. One reader per API process (`EventHub`) follows every stream
that a client watches, in one blocking XREAD on a connection of its own, and hands what it reads to each watcher:

    client ─ job_stream ─┬─ history: short XREADs on the shared pool, then subscribe at the last id read
                         └─ live: waits on its own inbox ◀── EventHub: XREAD BLOCK {watched streams..., wake}

So a thousand open streams cost one connection and one blocking read, and the pool that deploy-time lookups use
stays free. A new subscription wakes a blocked reader by adding to the process's own `api:{instance}:wake` stream,
which every read includes; a watcher that falls far behind (a client that stopped reading) is dropped from the
reader and rereads its backlog from Redis itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from service.store import keys
from service.store.jobs import TERMINAL

log = logging.getLogger("aotc.api")

_WAIT_S = 1.0  # how often an idle stream looks at the shutdown flag: how soon a shutdown ends open streams
_KEEPALIVE_S = 10.0
_READ_BLOCK_MS = 5000  # the reader's blocking read; new subscriptions wake it, so this only bounds an idle loop
_COUNT = 100  # entries per stream per read
_INBOX_MAX = 1000  # entries a watcher may leave unread before it rereads them from Redis itself
_WAKE_MAXLEN = 16
_WAKE_TTL_MS = 600_000
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


def _pairs(res: Any) -> list[tuple[Any, Any]]:
    """XREAD's reply as (stream, entries) pairs: a dict under RESP3, a list of pairs under RESP2."""
    if not res:
        return []
    return list(res.items()) if isinstance(res, dict) else [(s, es) for s, es in res]


def _id(stream_id: str) -> tuple[int, int]:
    """A stream id as a comparable pair (`123` means `123-0`, as Redis reads it)."""
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def _frame(event: str, data: Any, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


Entry = tuple[str, dict[str, str]]


class Subscription:
    """One watcher of one stream: what the reader has handed it, and why it must stop."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self.inbox: deque[Entry] = deque()
        self.wake = asyncio.Event()
        self.lagged = False  # the reader dropped what it had for this watcher: reread from Redis
        self.failed: str | None = None  # the reader lost Redis, or the API is stopping: end with `unavailable`

    def deliver(self, entries: list[Entry]) -> bool:
        """Hand over entries; False when the watcher is too far behind (the caller drops it)."""
        if len(self.inbox) + len(entries) > _INBOX_MAX:
            self.inbox.clear()
            self.lagged = True
            self.wake.set()
            return False
        self.inbox.extend(entries)
        self.wake.set()
        return True

    def fail(self, message: str) -> None:
        self.failed = message
        self.wake.set()


class EventHub:
    """The one reader of job event streams in an API process (see the module's docstring)."""

    def __init__(self, url: str, pool: aioredis.Redis) -> None:
        # Its own connection: a blocking read must never wait for, or hold, one of the pool's.
        self._r = aioredis.Redis.from_url(url, decode_responses=True, single_connection_client=True,
                                          socket_connect_timeout=2.0, socket_timeout=_READ_BLOCK_MS / 1000 + 10)
        self._pool = pool
        self._wake_key = keys.api_wake(uuid.uuid4().hex[:16])
        self._wake_last = "0-0"
        self._subs: dict[str, list[Subscription]] = {}
        self._pos: dict[str, str] = {}  # per watched stream: the last id read (or where its first watcher starts)
        self._wanted = asyncio.Event()  # set when there is something to watch
        self._reading = False
        self._task: asyncio.Task[None] | None = None
        self._wakes: set[asyncio.Task[Any]] = set()
        self.reads = 0  # blocking reads made (tests and /metrics-style checks)

    def start(self) -> EventHub:
        self._task = asyncio.create_task(self._run(), name="event-hub")
        return self

    @property
    def task(self) -> asyncio.Task[None]:
        """The reader's task (service/api/liveness.py watches that it has not ended)."""
        assert self._task is not None, "start() first"
        return self._task

    async def close(self, message: str = "the API is shutting down; reconnect with Last-Event-ID") -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._fail_all(message)
        await self._r.aclose()

    @property
    def watchers(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    def subscribe(self, stream: str, after: str) -> Subscription:
        """Watch `stream` from just after `after` (the last id its watcher has read itself)."""
        sub = Subscription(stream)
        self._subs.setdefault(stream, []).append(sub)
        pos = self._pos.get(stream)
        # Start no later than this watcher needs: the reader may already be past `after` (entries written after
        # the watcher's own last read, which the reader took before this watcher existed). Others skip repeats.
        self._pos[stream] = after if pos is None or _id(after) < _id(pos) else pos
        self._wanted.set()
        if self._reading:  # blocked on a read that does not include this stream: wake it
            task = asyncio.create_task(self._wake())
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.stream)
        if subs is None or sub not in subs:
            return
        subs.remove(sub)
        if not subs:
            del self._subs[sub.stream]
            del self._pos[sub.stream]

    async def _wake(self) -> None:
        try:
            pipe = self._pool.pipeline(transaction=False)
            pipe.xadd(self._wake_key, {"w": "1"}, maxlen=_WAKE_MAXLEN, approximate=True)
            pipe.pexpire(self._wake_key, _WAKE_TTL_MS)
            await pipe.execute()
        except redis.RedisError as e:  # the read returns within _READ_BLOCK_MS anyway
            log.debug("event hub: cannot wake the reader: %s", e)

    def _fail_all(self, message: str) -> None:
        for subs in self._subs.values():
            for sub in subs:
                sub.fail(message)
        self._subs.clear()
        self._pos.clear()

    async def _run(self) -> None:
        while True:
            if not self._subs:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            streams: dict[Any, Any] = {**self._pos, self._wake_key: self._wake_last}  # redis-py's key types
            self._reading = True
            try:
                res = await self._r.xread(streams, block=_READ_BLOCK_MS, count=_COUNT)
            except asyncio.CancelledError:
                raise
            except _REDIS_DOWN as e:
                self._fail_all(f"the service cannot reach its Redis ({e}); reconnect shortly")
                await asyncio.sleep(0.5)
                continue
            except Exception as e:  # never let the reader die: its watchers end, later ones start afresh
                log.exception("event hub: read failed")
                self._fail_all(f"the API's event reader failed ({type(e).__name__}); reconnect shortly")
                await asyncio.sleep(0.5)
                continue
            finally:
                self._reading = False
            self.reads += 1
            for stream, entries in _pairs(res):
                if not entries:
                    continue
                if stream == self._wake_key:
                    self._wake_last = entries[-1][0]
                    continue
                if self._pos.get(stream) != streams.get(stream):
                    # Its last watcher left during the read, or one that came meanwhile moved the start back:
                    # the next read goes from there, and hands everything over in order (repeats are skipped).
                    continue
                self._pos[stream] = entries[-1][0]
                for sub in list(self._subs.get(stream, ())):
                    if not sub.deliver(entries):
                        self.unsubscribe(sub)


async def _history(r: aioredis.Redis, stream: str, after: str) -> AsyncIterator[Entry]:
    """Every entry after `after` that the stream holds now, in short non-blocking reads on the pool."""
    while True:
        res = await r.xread({stream: after}, count=_COUNT)
        entries = [e for _, es in _pairs(res) for e in es]
        for entry in entries:
            yield entry
        if len(entries) < _COUNT:
            return
        after = entries[-1][0]


async def job_stream(
    hub: EventHub,
    r: aioredis.Redis,
    job_id: str,
    load_job: Callable[[], Awaitable[Any]],
    *,
    after: str = "0-0",
    stopping: Callable[[], bool] = lambda: False,
) -> AsyncIterator[str]:
    """Yield SSE frames for one job until it ends. `load_job` is an async callable returning the job record; `r`
    the shared pool, used only for short reads."""
    stream = keys.job_events(job_id)
    yield "retry: 1000\n\n"
    sub: Subscription | None = None
    try:
        replayed = False
        while True:  # the history, then live; back here when the reader dropped this watcher
            async for event_id, fields in _history(r, stream, after):
                replayed = True
                after = event_id
                yield _frame("state", fields, event_id)
                if fields.get("state") in TERMINAL:
                    yield _frame("end", await load_job(), event_id)
                    return
            if not replayed:
                # A job that ended without its end event in the stream (trimmed, or written before events existed)
                # still ends the stream.
                replayed = True
                job = await load_job()
                if job is None or job["state"] in TERMINAL:
                    yield _frame("end", job)
                    return
                yield ": keepalive\n\n"
            sub = hub.subscribe(stream, after)
            quiet_since = time.monotonic()
            while not sub.lagged:
                if stopping():
                    yield _frame("unavailable", {"message": "the API is shutting down; reconnect with Last-Event-ID"})
                    return
                if sub.failed:
                    yield _frame("unavailable", {"message": sub.failed})
                    return
                sub.wake.clear()  # before draining: a delivery after this sets it again
                while sub.inbox:
                    event_id, fields = sub.inbox.popleft()
                    if _id(event_id) <= _id(after):
                        continue  # the reader started before this watcher's last read
                    after, quiet_since = event_id, time.monotonic()
                    yield _frame("state", fields, event_id)
                    if fields.get("state") in TERMINAL:
                        yield _frame("end", await load_job(), event_id)
                        return
                if time.monotonic() - quiet_since >= _KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    job = await load_job()
                    if job is None or job["state"] in TERMINAL:
                        yield _frame("end", job)
                        return
                    yield ": keepalive\n\n"
                    continue
                try:
                    await asyncio.wait_for(sub.wake.wait(), _WAIT_S)
                except TimeoutError:
                    pass
            hub.unsubscribe(sub)
            sub = None
    except _REDIS_DOWN as e:
        yield _frame("unavailable", {"message": f"the service cannot reach its Redis ({e}); reconnect shortly"})
    finally:
        if sub is not None:
            hub.unsubscribe(sub)
