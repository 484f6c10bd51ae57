"""The API's one reader of job event streams (service/api/events.py, EventHub), against a real redis-server: a
watcher that arrives while the reader is already past the point the watcher's own history read ended still gets
every entry after that point, once the reader has been woken."""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis

from service.api.events import EventHub, Subscription
from service.store import keys
from service.store.embedded import EmbeddedRedis


async def _until(sub: Subscription, n: int, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(sub.inbox) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return [event_id for event_id, _ in sub.inbox]


def test_a_watcher_behind_the_reader_misses_nothing(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        pool = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        hub = EventHub(redis_server.url, pool).start()
        try:
            stream = keys.job_events(uuid.uuid4().hex)
            history = [await pool.xadd(stream, {"n": str(i)}) for i in range(3)]
            first = hub.subscribe(stream, history[-1])
            await asyncio.sleep(0.3)  # the reader is blocked on the stream
            ahead = [await pool.xadd(stream, {"n": str(i)}) for i in range(3, 5)]
            assert await _until(first, 2) == ahead  # the reader is past the history now
            await asyncio.sleep(0.3)

            # A watcher whose own read of the history ended before `ahead`; an entry lands while the reader is
            # still blocked on its old position.
            late = hub.subscribe(stream, history[-1])
            last = await pool.xadd(stream, {"n": "5"})
            assert await _until(late, 3) == [*ahead, last]
            assert hub.reads >= 2 and hub.watchers == 2

            hub.unsubscribe(first)
            hub.unsubscribe(late)
            assert hub.watchers == 0
        finally:
            await hub.close()
            await pool.aclose()

    asyncio.run(main())


def test_the_reader_ends_its_watchers_with_a_reason_when_it_closes(redis_server: EmbeddedRedis) -> None:
    async def main() -> None:
        pool = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        hub = EventHub(redis_server.url, pool).start()
        sub = hub.subscribe(keys.job_events(uuid.uuid4().hex), "0-0")
        await asyncio.sleep(0.2)
        await hub.close()
        await pool.aclose()
        assert sub.failed and "shutting down" in sub.failed and sub.wake.is_set()

    asyncio.run(main())
