"""A job's progress as Server-Sent Events.

The stream replays the job's event history (its `job:{id}:events` Redis stream), then follows it live with
blocking reads, so a client that connects late or reconnects with `Last-Event-ID` misses nothing:

    id: 1763771323244-0
    event: state
    data: {"state": "running", "stage": "compile", "ts": "1763771323.244"}

    event: end
    data: {...the whole job record, with its artifact or its error...}

It ends after `end`. It also ends (without `end`) when the API shuts down or Redis goes away, after an
`unavailable` event; clients reconnect with `Last-Event-ID`. A `: keepalive` comment goes out every few seconds
while nothing happens, which keeps proxies from closing an idle stream.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from service.store import keys
from service.store.jobs import TERMINAL

_BLOCK_MS = 1000  # one blocking read; also how soon a shutdown ends open streams
_KEEPALIVE_S = 10.0


def _pairs(res: Any) -> list[tuple[Any, Any]]:
    """XREAD's reply as (stream, entries) pairs: a dict under RESP3, a list of pairs under RESP2."""
    if not res:
        return []
    return list(res.items()) if isinstance(res, dict) else [(s, es) for s, es in res]


def _frame(event: str, data: Any, event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def job_stream(
    r: aioredis.Redis,
    job_id: str,
    load_job: Callable[[], Any],
    *,
    after: str = "0-0",
    stopping: Callable[[], bool] = lambda: False,
) -> AsyncIterator[str]:
    """Yield SSE frames for one job until it ends. `load_job` is an async callable returning the job record."""
    stream = keys.job_events(job_id)
    yield "retry: 1000\n\n"
    idle, first = 0.0, True
    try:
        while not stopping():
            # The first read replays the history without waiting; later ones block for new events.
            res = await r.xread({stream: after}, block=None if first else _BLOCK_MS, count=100)
            entries = [e for _, es in _pairs(res) for e in es]
            if not entries:
                idle += 0 if first else _BLOCK_MS / 1000
                # A job that ended without its end event in the stream (trimmed, or written before events
                # existed) still ends the stream: look at the record now and then.
                if first or idle >= _KEEPALIVE_S:
                    first, idle = False, 0.0
                    job = await load_job()
                    if job is None or job["state"] in TERMINAL:
                        yield _frame("end", job)
                        return
                    yield ": keepalive\n\n"
                continue
            idle = 0.0
            first = first and len(entries) == 100  # keep replaying without blocking while history remains
            for event_id, fields in entries:
                after = event_id
                yield _frame("state", fields, event_id)
                if fields.get("state") in TERMINAL:
                    yield _frame("end", await load_job(), event_id)
                    return
        yield _frame("unavailable", {"message": "the API is shutting down; reconnect with Last-Event-ID"})
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        yield _frame("unavailable", {"message": f"the service cannot reach its Redis ({e}); reconnect shortly"})
