"""The worker: reads jobs for the concrete targets it serves from the queue (worker.queue), runs each (worker.job),
and keeps its registry record and its current lease alive from a heartbeat thread.

Delivery is at least once. A claimed job is a lease (service.store.leases) that the heartbeat renews; a reaper in
any worker or API process (service.store.reaper) takes back leases left to expire and requeues their jobs, so a
worker that dies loses no job. The attempt is counted at claim time, so a job that keeps killing workers still
stops at max_attempts. A worker never exits because Redis is down: it waits (worker.backoff).

Before it serves, a worker sets up the sandbox its children run in (worker.isolation: it refuses to start when
none can be set up, unless AOTC_SANDBOX=off) and, once registered, finds the trusted precompiled headers or
builds them (worker.headers: in the background by default, taking jobs meanwhile); its registry record says whether
its children are sandboxed.

A worker knows when it is broken (worker.health): after AOTC_WORKER_MAX_EARLY_CRASHES children in a row fail
before their work starts (in `import torch`, or before), it stops claiming jobs and says so in its registry record
(healthy: false, unhealthy_reason), heartbeating on; the jobs those children failed went back unspent. Every
AOTC_WORKER_REPROBE_S it runs a probe child, and serves again once one gets through. It also claims nothing while
its work dir or file blob store has less free than AOTC_DISK_LOW_WATER_MB, measured before every claim and every
AOTC_POLL_MS while unhealthy, and serves again once there is room (worker.disk).

Signals never interrupt Redis calls: SIGTERM/SIGINT only set a flag. The loop stops reading, the sandbox's poll
loop sees the flag and kills the compile, and the job is handed back with its attempt refunded. A second signal
forces the exit (the job's lease then expires and the reaper requeues it).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import redis

from compiler.signing import Signer, key_record
from service.store import Lease, StorageOptions, Store, keys
from service.store.reaper import Reaper
from worker.backoff import until_redis
from worker.isolation import Sandbox, SandboxUnavailable, setup
from worker.job import JobRunner, requeue_failed_verifies
from worker.queue import Reader
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")
T = TypeVar("T")


class Worker:
    def __init__(self, settings: WorkerSettings, info: dict[str, Any], sandbox: Sandbox | None = None,
                 signer: Signer | None = None) -> None:
        """`sandbox`: how children are confined (worker.isolation.setup, which probes it, when not given).
        `signer`: the key that signs manifests (`signing_key`); a worker without one publishes nothing."""
        self.settings = settings
        self.info = info
        self.target: str = info["target"]
        self.targets: list[str] = list(info.get("targets") or [self.target])  # every level it serves, own first
        # Verify jobs (compiler/ontarget.py) only for the targets it serves natively: never for one it builds blind.
        build_only = set(info.get("build_only") or ())
        self.verifies = [t for t in self.targets if t not in build_only]
        self.queue_names = [*self.targets, *(keys.verify_target(t) for t in self.verifies)]
        self.id = f"{info['host']}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.store = Store(settings.redis_url, storage=StorageOptions.from_settings(settings))
        self.started = time.time()
        self.stopping = threading.Event()  # shutdown requested (SIGTERM/SIGINT)
        self._hb_stop = threading.Event()
        self.reader = Reader(self.store, self.queue_names, self.id, batch_max_wait_s=settings.batch_max_wait_s,
                             poll_ms=settings.poll_ms)
        self.reaper = Reaper(self.store, settings.lease_s, settings.reap_interval_s)
        self.sandbox = sandbox or setup(settings, info["device"])
        self.runner = JobRunner(self.store, settings, info, self.id, self.stopping, self.sandbox)
        self.runner.signer = signer
        self._said_unhealthy = False  # the registry was told this worker is unhealthy
        self._next_probe = 0.0  # when an unhealthy worker runs its next probe child

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
            **self.runner.health.describe(),
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
        every reap_interval_s), so lost jobs are back in line, and queues the retried jobs whose backoff is over."""
        self.reaper.maybe_run()
        self.store.jobs.promote_due()
        try:
            return self.reader.next()
        except redis.ResponseError as e:
            # A stream nobody made yet (a verify queue before any worker ensured it) or that Redis lost: make them.
            if "NOGROUP" not in str(e):
                raise
            self.ensure_queues()
            return self.reader.next()

    def while_unhealthy(self) -> None:
        """One turn of the loop of a worker that claims nothing: the heartbeat thread goes on (so no reaper takes
        the worker for lost), this thread still reaps and promotes for the others, and every reprobe_s it runs the
        probe child, which makes the worker healthy again once one gets through its imports. A full disk needs no
        probe: the loop measures it again each turn."""
        health = self.runner.health
        if not self._said_unhealthy:
            self._said_unhealthy = True
            self._next_probe = time.monotonic() + self.settings.worker_reprobe_s
            self._beat_now()  # /v1/workers and /readyz say so now, not at the next heartbeat
        self.stopping.wait(self.settings.poll_ms / 1000)
        try:
            self.reaper.maybe_run()
            self.store.jobs.promote_due()
        except Exception as e:  # Redis down: the heartbeat thread reports it; nothing here must stop the loop
            log.debug("while unhealthy: %s", e)
        if (health.reason is not None and self.settings.worker_reprobe_s and time.monotonic() >= self._next_probe
                and not self.stopping.is_set()):
            self._next_probe = time.monotonic() + self.settings.worker_reprobe_s
            jobdir = (self.settings.work_dir / f"probe-{os.getpid()}").resolve()
            try:
                health.probe(jobdir, sandbox=self.sandbox, device=self.info["device"], limits=self.runner.limits(),
                             timeout_s=self.settings.compile_timeout_s, should_cancel=self.stopping.is_set)
            finally:
                shutil.rmtree(jobdir, ignore_errors=True)
        if health.check_disk() and health.healthy:
            self._said_unhealthy = False
            self._beat_now()

    def _beat_now(self) -> None:
        try:
            self.heartbeat()
        except Exception as e:
            log.warning("heartbeat failed: %s", e)

    def run(self, max_jobs: int | None = None) -> None:
        for warning in self._until_redis(self.store.check_redis, "check Redis's settings") or []:  # noeviction
            log.warning("%s", warning)
        if self.runner.signer is not None:
            self._until_redis(self.publish_signing_key, "publish the signing key")
        self._until_redis(self.ensure_queues, "create the queues")
        if self.runner.signer is not None and self.verifies:  # it can countersign: what verifiers gave up on is its
            self._until_redis(partial(requeue_failed_verifies, self.store, self.verifies,
                                      self.settings.verify_max_attempts), "queue failed verify jobs again")
        self._until_redis(self.heartbeat, "register")  # last: a registered worker has done its start-up's work
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        self.runner.prepare()  # the trusted precompiled headers: found, built now, or building in a thread
        log.info("worker %s serving %s (%s)", self.id, ", ".join(self.targets), self.info["device_name"])
        try:
            while not self.stopping.is_set():
                if not self.runner.health.check_disk() or not self.runner.health.healthy:
                    self.while_unhealthy()
                    continue
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

    def publish_signing_key(self) -> None:
        """Put this worker's public key in Redis (GET /v1/signing-keys), where clients that do not pin keys find
        it. A key revoked earlier stays revoked: the worker refuses to sign with it, and stops."""
        signer = self.runner.signer
        assert signer is not None
        record = self.store.signing.publish(key_record(signer.public))
        if record.get("revoked_at") is not None:
            raise SystemExit(f"aotc-worker: refusing to start: signing key {signer.kid} ({signer.path}) was revoked; "
                             "give the worker a new key (AOTC_SIGNING_KEY_FILE), or delete the one it made so that "
                             "it makes another")
        log.info("signing manifests with key %s (%s)", signer.kid, signer.path)

    def _until_redis(self, fn: Callable[[], T], what: str) -> T | None:
        """`fn` once Redis answers; None if a shutdown begins while waiting. A queue that Redis lost (it came back
        empty) is created again."""
        return until_redis(fn, what, self.stopping.wait, recover=self.ensure_queues)

    def ensure_queues(self) -> None:
        for name in self.queue_names:
            self.store.queues.ensure(name)


def serve(settings: WorkerSettings, max_jobs: int | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT. A signal mid-job kills the child and hands the job back unspent."""
    from compiler.device import detect, host_target

    try:
        info = detect(settings.device, settings.worker_targets)
    except ValueError as e:  # AOTC_WORKER_TARGETS names a level above this host's
        raise SystemExit(f"aotc-worker: refusing to start: {e}") from None
    if settings.build_only_targets:
        unserved = [t for t in settings.build_only_targets if t not in info["targets"]]
        if unserved:
            raise SystemExit(f"aotc-worker: refusing to start: AOTC_BUILD_ONLY_TARGETS names {', '.join(unserved)}, "
                             f"which this worker does not build (it serves {', '.join(info['targets'])}; "
                             "AOTC_WORKER_TARGETS)")
        # What its build-only artifacts are marked as built (and checked) on: the host itself, not the target.
        info["build_only"] = list(settings.build_only_targets)
        info["built_on"] = str(host_target(info["device"]))
    try:
        sandbox = setup(settings, info["device"])
    except SandboxUnavailable as e:
        log.error("%s", e)
        raise SystemExit(f"aotc-worker: refusing to start: {e}") from None
    try:
        signer = signing_key(settings, sandbox)
    except (OSError, ValueError) as e:
        log.error("%s", e)
        raise SystemExit(f"aotc-worker: refusing to start: {e}") from None
    w = Worker(settings, info, sandbox, signer)

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


def signing_key(settings: WorkerSettings, sandbox: Sandbox) -> Signer:
    """The key this worker signs manifests with: AOTC_SIGNING_KEY_FILE, else AOTC_DATA_DIR/signing/worker-ed25519.pem,
    made on first start. ValueError when it cannot be read, or when it lies where compile and check children could
    read it (a sandboxed child sees every path the sandbox does not hide)."""
    given = settings.signing_key_file
    path = Path(os.path.realpath(given or settings.data_dir / "signing" / "worker-ed25519.pem"))
    if sandbox.on and sandbox.visible(path):
        raise ValueError(f"the signing key {path} is where compile and check children could read it: put it under "
                         "AOTC_DATA_DIR or /run (e.g. /run/secrets), or add its dir to AOTC_SANDBOX_HIDE")
    if given is not None and not path.is_file():
        raise ValueError(f"AOTC_SIGNING_KEY_FILE={given}: no such file")
    signer = Signer.from_file(path, create=given is None)
    if path.stat().st_mode & 0o077:
        log.warning("the signing key %s can be read by other users (mode %o): chmod 600 it", path,
                    path.stat().st_mode & 0o777)
    return signer
