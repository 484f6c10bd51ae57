"""Liveness: whether this API process can still make progress by itself, which is what `/healthz` answers.

Liveness is what an orchestrator restarts a process for, so it asks only what a restart of *this process* would
mend, and never touches Redis: a Redis that is down or slow makes every API process unready (`/readyz`), and
restarting them all would mend nothing. The process is wedged when:

- **the event loop is blocked** (a call that never returns, run on it): then nothing answers at all, `/healthz`
  included, and the probe's own timeout is the check;
- **a background task ended** (the reaper: jobs of lost workers would wait forever; the slot renewer: this
  process's stream and upload slots would lapse under their holders; the event reader: every event stream would
  stall; or the monitor below);
- **a background task stopped making progress**: a reaper round that has not finished for `AOTC_LIVENESS_STALL_S`
  is stuck, since every Redis call it makes gives up within about 45 s (the clients' timeouts and retries);
- **the thread pool is stuck**: every thread of it has been held by the same callers for `AOTC_LIVENESS_STALL_S`
  (a hung disk or network mount, a deadlock), so every route that runs in it (most do) waits forever.

`/healthz` itself runs on the event loop and never in the thread pool, so it answers even when the pool is full.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from anyio import to_thread

log = logging.getLogger("aotc.api")
MONITOR_INTERVAL_S = 1.0


class Liveness:
    """The background tasks of one API process and the progress of each, and a watch on its thread pool."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.clock = clock
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.expected_s: dict[str, float] = {}  # how often each task says it made progress, at least
        self.progress: dict[str, float] = {}  # when each last did
        self._pool: tuple[tuple[object, ...], float] | None = None  # the full pool's holders, and since when

    def start(self, name: str, work: Callable[[Callable[[], None]], Coroutine[Any, Any, None]],
              every_s: float) -> asyncio.Task[None]:
        """Run `work(done)` as a background task that calls `done()` at least every `every_s` while it is well."""
        self.expected_s[name] = every_s
        self.progress[name] = self.clock()
        task = asyncio.create_task(work(lambda: self._done(name)), name=f"aotc-{name}")
        self.tasks[name] = task
        return task

    def watch(self, name: str, task: asyncio.Task[None]) -> None:
        """Watch a task started elsewhere that may rightly idle for any length of time: only its end is a problem."""
        self.tasks[name] = task
        self.expected_s[name] = math.inf
        self.progress[name] = self.clock()

    def start_monitor(self) -> asyncio.Task[None]:
        """The task that looks at the thread pool every second (and, by running, shows the loop turns)."""
        return self.start("monitor", self._monitor, MONITOR_INTERVAL_S)

    def _done(self, name: str) -> None:
        self.progress[name] = self.clock()

    async def _monitor(self, done: Callable[[], None]) -> None:
        while True:
            self.watch_pool()
            done()
            await asyncio.sleep(MONITOR_INTERVAL_S)

    def watch_pool(self) -> None:
        """Note whether every token of the default thread pool is held, and by whom (call it on the event loop)."""
        stats = to_thread.current_default_thread_limiter().statistics()
        if stats.borrowed_tokens < stats.total_tokens:
            self._pool = None
            return
        holders = stats.borrowers  # held here, so no holder's id is reused while it is compared
        if self._pool is None or {id(h) for h in holders} != {id(h) for h in self._pool[0]}:
            self._pool = (holders, self.clock())

    def problems(self) -> list[str]:
        """What keeps this process from making progress; empty when it is live."""
        now = self.clock()
        found = []
        for name, task in self.tasks.items():
            if task.done():
                exc = None if task.cancelled() else task.exception()
                how = "it was cancelled" if task.cancelled() else f"it raised {exc!r}" if exc else "it returned"
                found.append(f"the {name} task has ended ({how}); restart this API process")
            elif (idle := now - self.progress[name]) > self.stall_s + self.expected_s[name]:
                found.append(f"the {name} task has made no progress for {idle:.1f} s (AOTC_LIVENESS_STALL_S="
                             f"{self.stall_s:g})")
        if self._pool is not None and (held := now - self._pool[1]) >= self.stall_s:
            found.append(f"every one of the {len(self._pool[0])} threads of this API process's pool has been held "
                         f"by the same requests for {held:.0f} s (AOTC_LIVENESS_STALL_S={self.stall_s:g}): routes "
                         "that run in it cannot answer (a hung disk or mount, or a deadlock)")
        return found

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
