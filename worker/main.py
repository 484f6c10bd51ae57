"""The worker: reads jobs for its concrete target from the queue (worker.queue), runs each (worker.job), and keeps
its registry record and its current lease alive from a heartbeat thread.

Delivery is at least once. A claimed job is a lease (service.store.leases) that the heartbeat renews; a reaper in
any worker or API process (service.store.reaper) takes back leases left to expire and requeues their jobs, so a
worker that dies loses no job. The attempt is counted at claim time, so a job that keeps killing workers still
stops at max_attempts. A worker never exits because Redis is down: it waits (worker.backoff).

Before it serves, a worker sets up the sandbox its children run in (worker.isolation: it refuses to start when
none can be set up, unless AOTC_SANDBOX=off) and, once registered, builds or finds the trusted precompiled
headers (worker.headers); its registry record says whether its children are sandboxed.

Signals never interrupt Redis calls: SIGTERM/SIGINT only set a flag. The loop stops reading, the sandbox's poll
loop sees the flag and kills the compile, and the job is handed back with its attempt refunded. A second signal
forces the exit (the job's lease then expires and the reaper requeues it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from service.store import Lease, StorageOptions, Store
from service.store.reaper import Reaper
from worker.backoff import until_redis
from worker.isolation import Sandbox, SandboxUnavailable, setup
from worker.job import JobRunner
from worker.queue import Reader
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")
T = TypeVar("T")


class Worker:
    def __init__(self, settings: WorkerSettings, info: dict[str, Any], sandbox: Sandbox | None = None) -> None:
        """`sandbox`: how children are confined (worker.isolation.setup, which probes it, when not given)."""
        self.settings = settings
        self.info = info
        self.target: str = info["target"]
        self.id = f"{info['host']}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.store = Store(settings.redis_url, storage=StorageOptions.from_settings(settings))
        self.started = time.time()
        self.stopping = threading.Event()  # shutdown requested (SIGTERM/SIGINT)
        self._hb_stop = threading.Event()
        self.reader = Reader(self.store, self.target, self.id, batch_max_wait_s=settings.batch_max_wait_s,
                             poll_ms=settings.poll_ms)
        self.reaper = Reaper(self.store, settings.lease_s, settings.reap_interval_s)
        self.sandbox = sandbox or setup(settings, info["device"])
        self.runner = JobRunner(self.store, settings, info, self.id, self.stopping, self.sandbox)

    @property
    def streams(self) -> list[str]:
        """This worker's queue streams, most urgent first."""
        return self.reader.streams

    # -- registry and heartbeat ---------------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        current = self.runner.current
        return {
            "id": self.id,
            "pid": os.getpid(),
            "started": self.started,
            "jobs_done": self.runner.jobs_done,
            "job": current[0] if current else None,
            **self.sandbox.describe(),
            **self.info,
        }

    def heartbeat(self) -> None:
        self.runner.renew_lease()
        self.store.workers.heartbeat(self.record(), self.settings.worker_ttl_s)

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._hb_stop.wait(self.settings.heartbeat_s):
            try:
                self.heartbeat()
                if failing:
                    log.info("heartbeat works again")
                failing = False
            except Exception as e:  # Redis blips must not kill the heartbeat
                if not failing:
                    log.warning("heartbeat failed: %s", e)
                failing = True

    # -- the loop -----------------------------------------------------------------------------------------------

    def next_message(self) -> tuple[Lease, str] | None:
        """The next job as (lease, job id), or None after poll_ms without one. Reaps expired leases first (at most
        every reap_interval_s), so lost jobs are back in line."""
        self.reaper.maybe_run()
        return self.reader.next()

    def run(self, max_jobs: int | None = None) -> None:
        for warning in self._until_redis(self.store.check_redis, "check Redis's settings") or []:  # noeviction
            log.warning("%s", warning)
        self._until_redis(lambda: self.store.queues.ensure(self.target), "create the queue")
        self._until_redis(self.heartbeat, "register")
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self.runner.prepare()  # the trusted precompiled headers, before the first job (registered meanwhile)
        log.info("worker %s serving %s (%s)", self.id, self.target, self.info["device_name"])
        try:
            while not self.stopping.is_set():
                try:
                    msg = self._until_redis(self.next_message, "read the queue")
                except Exception:  # a bug or an odd reply must not take the worker down: log it, go on
                    log.exception("reading the queue failed")
                    self.stopping.wait(2.0)
                    continue
                if msg is None:
                    continue
                if self.stopping.is_set():  # read just as the shutdown began: put it back untouched
                    lease, job_id = msg
                    self._until_redis(partial(self.store.jobs.requeue, job_id, lease, expect_state="queued"),
                                      "hand back")
                    break
                self.runner.process(*msg)
                if max_jobs is not None and self.runner.jobs_done >= max_jobs:
                    break
        finally:
            self._hb_stop.set()
            try:
                self.store.workers.remove(self.id)
                self.store.queues.forget_consumer(self.id, self.streams)
            except Exception:
                pass

    def _until_redis(self, fn: Callable[[], T], what: str) -> T | None:
        """`fn` once Redis answers; None if a shutdown begins while waiting. A queue that Redis lost (it came back
        empty) is created again."""
        return until_redis(fn, what, self.stopping.wait, recover=lambda: self.store.queues.ensure(self.target))


def serve(settings: WorkerSettings, max_jobs: int | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT. A signal mid-job kills the child and hands the job back unspent."""
    from compiler.device import detect

    info = detect(settings.device)
    try:
        sandbox = setup(settings, info["device"])
    except SandboxUnavailable as e:
        log.error("%s", e)
        raise SystemExit(f"aotc-worker: refusing to start: {e}") from None
    w = Worker(settings, info, sandbox)

    def _stop(signum: int, frame: Any) -> None:
        if w.stopping.is_set():  # the second signal: leave now; the lease expires and the reaper requeues
            raise KeyboardInterrupt
        log.info("worker %s: %s received; finishing up", w.id, signal.Signals(signum).name)
        w.stopping.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        w.run(max_jobs=max_jobs)
    except KeyboardInterrupt:
        log.info("worker %s stopped", w.id)
