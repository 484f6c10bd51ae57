"""What one API key may hold open at once: job event streams (AOTC_MAX_STREAMS_PER_KEY) and uploads in progress
(AOTC_MAX_UPLOADS_PER_KEY), counted over every API process.

Each open stream or upload holds a slot: a lease in Redis (`slots:{kind}:{key id}`, a zset of lease tokens scored by
when they lapse, on Redis's clock: SLOT_TAKE in service/store/scripts.py). A request past the cap is answered 429
naming the setting, with Retry-After. A slot is given back when its stream or upload ends; meanwhile its API process
renews every slot it holds in one call every third of AOTC_SLOT_LEASE_S, so the slots of a process that died (or
of a response that was never sent) lapse within AOTC_SLOT_LEASE_S.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import redis
import redis.asyncio as aioredis
from fastapi import Depends, Request

from compiler.errors import AotcError
from service.api.auth import Compile, Principal
from service.api.deps import SettingsDep
from service.store import keys, scripts

log = logging.getLogger("aotc.api")
_RENEW_BATCH = 500


class KeyLimit(AotcError):
    """429: the API key already holds as many streams or uploads open as a setting allows."""

    status, code = 429, "key_limit"

    def __init__(self, message: str, *, retry_after_s: int, **detail: Any) -> None:
        super().__init__(message, **detail)
        self.headers = {"Retry-After": str(retry_after_s)}


class Slot:
    """One held slot; the API process renews it until `Slots.release`, or until nothing refers to it."""

    __slots__ = ("__weakref__", "key", "token")

    def __init__(self, key: str, token: str) -> None:
        self.key, self.token = key, token


class Slots:
    # kind -> (the setting that caps it, what the 429 calls it, its Retry-After in seconds)
    KINDS = {"streams": ("AOTC_MAX_STREAMS_PER_KEY", "event streams open", 5),
             "uploads": ("AOTC_MAX_UPLOADS_PER_KEY", "uploads in progress", 10)}

    def __init__(self, aredis: aioredis.Redis, lease_s: float) -> None:
        self.r = aredis
        self.lease_s = lease_s
        self._take = aredis.register_script(scripts.SLOT_TAKE)
        self._renew = aredis.register_script(scripts.SLOT_RENEW)
        # Weak: a slot whose response was dropped before it was sent stops being renewed, and lapses.
        self._held: weakref.WeakSet[Slot] = weakref.WeakSet()
        self._releases: set[asyncio.Task[Any]] = set()

    async def take(self, kind: str, who: Principal, cap: int) -> Slot:
        """A slot of `kind` for the caller's key, or KeyLimit when it holds `cap` already."""
        setting, what, retry_s = self.KINDS[kind]
        slot = Slot(keys.slots(kind, who.key_id), secrets.token_hex(8))
        held = int(await self._take(keys=[slot.key], args=[cap, int(self.lease_s * 1000), slot.token]))
        if held < 0:
            raise KeyLimit(f"the API key {who.key_id} has {-held} {what}; the limit is {cap} per key ({setting}): "
                           "wait for one to end", retry_after_s=retry_s, setting=setting, limit=cap)
        self._held.add(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """Give a slot back (in the background: it runs where the request may be cancelled). Idempotent."""
        if slot not in self._held:
            return
        self._held.discard(slot)
        task = asyncio.get_running_loop().create_task(self._give_back(slot))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _give_back(self, slot: Slot) -> None:
        try:
            await self.r.zrem(slot.key, slot.token)
        except redis.RedisError as e:  # it lapses by itself within the lease
            log.debug("slots: could not give back %s: %s", slot.key, e)

    @property
    def held(self) -> int:
        return len(self._held)

    async def renew_forever(self, done: Callable[[], None] = lambda: None) -> None:
        """Renew every slot this process holds, every third of the lease; a Redis that is down is tried again.
        `done` is called after each round (service/api/liveness.py watches that it keeps coming)."""
        lease_ms = int(self.lease_s * 1000)
        while True:
            done()
            await asyncio.sleep(self.lease_s / 3)
            held = list(self._held)
            for i in range(0, len(held), _RENEW_BATCH):
                batch = held[i:i + _RENEW_BATCH]
                try:
                    await self._renew(keys=[s.key for s in batch], args=[lease_ms, *[s.token for s in batch]])
                except redis.RedisError as e:
                    log.warning("slots: could not renew %d slot(s): %s", len(batch), e)
                    break

    async def close(self) -> None:
        """Give back every slot held (the API is stopping); the ones that cannot be lapse by themselves."""
        held = list(self._held)
        self._held.clear()
        if held:
            try:
                pipe = self.r.pipeline(transaction=False)
                for s in held:
                    pipe.zrem(s.key, s.token)
                await pipe.execute()
            except redis.RedisError:
                pass
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)


async def _upload_slot(request: Request, who: Compile, settings: SettingsDep) -> AsyncIterator[None]:
    slots: Slots = request.app.state.slots
    slot = await slots.take("uploads", who, settings.max_uploads_per_key)
    try:
        yield
    finally:
        slots.release(slot)


# A route that takes it holds one of its key's upload slots while it runs (429 when there is none).
UploadSlot = Annotated[None, Depends(_upload_slot)]
