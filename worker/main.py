"""The worker: reads jobs for its concrete target from a Redis stream, compiles and checks each in a child
process, and publishes checked artifacts.

Delivery is at least once. A claimed job is a lease (service.store.leases) that the heartbeat thread renews; a reaper
in any worker or API process takes back leases left to expire and requeues their jobs, so a worker that dies
loses no job. The attempt is counted at claim time, so a job that keeps killing workers still stops at
max_attempts. Interactive jobs are read before batch jobs.

Signals never interrupt Redis calls: SIGTERM/SIGINT only set a flag. The loop stops reading, the sandbox's poll
loop sees the flag and kills the compile, and the job is handed back with its attempt refunded. A second signal
forces the exit (the job's lease then expires and the reaper requeues it).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast

import redis

from compiler.report import attach_check  # torch-free
from service.store import keys
from service.store.leases import Lease, Reaper, forget_consumer
from service.store import Store
from worker.sandbox import Outcome, run_child
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")
# What xreadgroup returns on the decoded client (redis-py types it loosely): [(stream, [(msg id, fields)])].
_Read = list[tuple[str, list[Any]]]


class Worker:
    def __init__(self, settings: WorkerSettings, info: dict[str, Any]) -> None:
        self.settings = settings
        self.info = info
        self.target: str = info["target"]
        self.id = f"{info['host']}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.store = Store(settings.redis_url, chunk_bytes=settings.chunk_mb * 2**20)
        self.streams = [keys.queue(self.target, p) for p in keys.PRIORITIES]  # most urgent first
        self.started = time.time()
        self.current: tuple[str, Lease] | None = None  # (job id, the lease on its queue entry)
        self._lost: Lease | None = None  # a lease the heartbeat found taken by a reaper
        self.stopping = threading.Event()  # shutdown requested (SIGTERM/SIGINT)
        self._hb_stop = threading.Event()
        self._next_cancel_check = 0.0
        self.reaper = Reaper(self.store, settings.lease_s, settings.reap_interval_s)
        self.jobs_done = 0

    # -- registry and leases --------------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "pid": os.getpid(),
            "started": self.started,
            "jobs_done": self.jobs_done,
            "job": self.current[0] if self.current else None,
            **self.info,
        }

    @property
    def lease_lost(self) -> bool:
        """The current job's lease was taken by a reaper: the job is someone else's now, abandon it."""
        current = self.current
        return current is not None and self._lost == current[1]

    def heartbeat(self) -> None:
        current = self.current
        if current and self._lost != current[1]:
            # Renew the lease (resets the entry's idle time so no reaper takes it), but only while it is ours.
            if not self.store.renew_lease(current[1]):
                self._lost = current[1]
                if self.current is current:
                    log.warning("lost the lease on job %s (a reaper took it); abandoning the job", current[0])
        self.store.heartbeat_worker(self.record(), self.settings.worker_ttl_s)

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

    # -- the loop ----------------------------------------------------------------------------------------------

    def next_message(self) -> tuple[Lease, str] | None:
        """The next job, interactive before batch. Returns (lease, job id), or None after poll_ms without one.

        Reaps expired leases first (at most every reap_interval_s), so lost jobs are back in line."""
        self.reaper.maybe_run()
        r = self.store.r
        got: list[tuple[str, str, str]] = []  # (stream, msg id, job id)
        for stream in self._reading_order():  # a non-blocking look at each stream, most urgent first
            res = cast(_Read, r.xreadgroup(keys.QUEUE_GROUP, self.id, {stream: ">"}, count=1))
            if res:
                got = [(stream, *self._entry(res[0][1][0]))]
                break
        else:  # all empty: block on all of them at once
            res = cast(_Read, r.xreadgroup(keys.QUEUE_GROUP, self.id, {s: ">" for s in self.streams}, count=1,
                                           block=self.settings.poll_ms))
            got = sorted(((s, *self._entry(entries[0])) for s, entries in res or [] if entries),
                         key=lambda g: self.streams.index(g[0]))
        if not got:
            return None
        for stream, msg_id, job_id in got[1:]:  # a multi-stream read can return one entry per stream
            self.store.requeue_job(job_id, Lease(stream, msg_id, self.id), expect_state="queued")
        stream, msg_id, job_id = got[0]
        return Lease(stream, msg_id, self.id), job_id

    def _reading_order(self) -> list[str]:
        """Most urgent first, except that a job waiting in a less urgent queue for longer than batch_max_wait_s
        goes first (one at a time), so a steady stream of interactive work cannot starve batch work forever."""
        order = list(self.streams)
        now_ms = time.time() * 1000
        for stream in self.streams[1:]:
            waiting = self.store.oldest_waiting_ms(stream)
            if waiting is not None and now_ms - waiting > self.settings.batch_max_wait_s * 1000:
                order.remove(stream)
                return [stream, *order]
        return order

    @staticmethod
    def _entry(entry: Any) -> tuple[str, str]:
        msg_id, fields = entry
        return msg_id, (fields or {}).get("job", "")

    def run(self, max_jobs: int | None = None) -> None:
        self._until_redis(lambda: self.store.ensure_group(self.target), "create the queue")
        self._until_redis(self.heartbeat, "register")
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
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
                    self._until_redis(lambda: self.store.requeue_job(msg[1], msg[0], expect_state="queued"),
                                      "hand back")
                    break
                self.process(*msg)
                if max_jobs is not None and self.jobs_done >= max_jobs:
                    break
        finally:
            self._hb_stop.set()
            try:
                self.store.remove_worker(self.id)
                forget_consumer(self.store, self.streams, self.id)
            except Exception:
                pass

    def _until_redis(self, fn: Any, what: str) -> Any:
        """Call `fn`, retrying with capped exponential backoff while Redis is unreachable (never exits for that).
        Returns None if a shutdown begins while waiting."""
        delay, down_since = 0.5, None
        while True:
            try:
                out = fn()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("cannot reach Redis to %s (%s); retrying with backoff", what, e)
                if self.stopping.wait(delay * random.uniform(0.8, 1.2)):
                    return None
                delay = min(delay * 2, 10.0)
                continue
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):  # Redis came back empty (no persistence): recreate the queue
                    raise
                self.store.ensure_group(self.target)
                continue
            if down_since is not None:
                log.info("Redis is back after %.1f s", time.monotonic() - down_since)
            return out

    # -- one job -----------------------------------------------------------------------------------------------

    def process(self, lease: Lease, job_id: str) -> None:
        try:
            self._process(lease, job_id)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # Redis went away mid-job: once it is back, hand the job back unspent (it was not the job's fault).
            # If that cannot happen within a lease, the reaper requeues it as a lost worker's job.
            log.warning("lost Redis during job %s (%s); handing it back when Redis returns", job_id, e)
            deadline = time.monotonic() + self.settings.lease_s
            while time.monotonic() < deadline and not self.lease_lost:
                try:
                    if self.store.renew_lease(lease):
                        self.hand_back(job_id, lease)
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(1.0)
        except Exception as e:
            # A fault in the worker itself, not in the compile (which runs in a child): fail this attempt with
            # what happened, rather than leaving the lease to expire as if the worker were lost.
            log.exception("job %s: the worker failed", job_id)
            job = self.store.get_job(job_id) or {}
            if job.get("state") == "running" and job.get("worker") == self.id:
                self.store.retry_or_fail(job, lease, {
                    "type": "WorkerError", "message": f"the worker failed: {type(e).__name__}: {e}",
                    "stage": job.get("stage", ""), "retryable": True, "excerpt": ""})
        finally:
            self.current = None

    def _process(self, lease: Lease, job_id: str) -> None:
        store = self.store
        job = store.get_job(job_id) if job_id else None
        if job is None:
            store.drop_entry(lease)
            return
        started, attempt = store.start_job(job_id, lease)
        if started == "cancel":
            store.finish_job(job_id, "cancelled", lease=lease,
                             error={"type": "Cancelled", "message": "cancelled before it started"})
            return
        if started != "running":  # ended meanwhile, or a stale duplicate entry: start_job dropped it
            log.info("skipped job %s (%s)", job_id, started)
            return
        job = {**job, "state": "running", "attempt": attempt, "worker": self.id}
        max_attempts = int(job.get("max_attempts", 3))
        if attempt > max_attempts:  # only reachable through odd histories (e.g. refunds racing a reaper)
            last = (job.get("failures") or [{}])[-1]
            store.retry_or_fail(job, lease, {**last, "retryable": False, "excerpt": "",
                                             "message": f"gave up after {max_attempts} attempts; "
                                                        f"last: {last.get('message', 'worker lost')}"})
            return
        if job["toolchain"] != self.info["toolchain"]:
            store.finish_job(job_id, "failed", lease=lease, error={
                "type": "ToolchainMismatch", "stage": "claim", "retryable": False, "excerpt": "",
                "message": f"job was keyed for toolchain {job['toolchain']}, but this worker runs {self.info['toolchain']}"})
            return
        if store.get_artifact(job["key"]):  # an earlier delivery already finished the work
            store.finish_job(job_id, "succeeded", lease=lease, artifact=job["key"])
            return

        self.current = (job_id, lease)
        log.info("job %s attempt %d of %d (%s)", job_id, attempt, max_attempts, lease.stream.rsplit(":", 1)[-1])
        workdir = self.settings.work_dir / f"{job_id}-{attempt}"
        try:
            outcome, result = self._compile_and_check(job, workdir)
            if self.lease_lost:  # a reaper requeued the job: it is someone else's now
                log.warning("job %s: lease lost mid-job; result discarded", job_id)
            elif outcome.cancelled and self.stopping.is_set() and not store.cancel_requested(job_id):
                self.hand_back(job_id, lease)
            elif outcome.cancelled:
                store.finish_job(job_id, "cancelled", lease=lease, error=outcome.error)
            elif outcome.ok:
                store.finish_job(job_id, "succeeded", lease=lease, artifact=result["key"], timings=result["timings"],
                                 check=result["check"])
            else:
                what = store.retry_or_fail(job, lease, outcome.error)
                log.info("job %s attempt %d: %s (%s)", job_id, attempt, outcome.error.get("message"), what)
        finally:
            self.jobs_done += 1
            if not self.settings.keep_work:
                shutil.rmtree(workdir, ignore_errors=True)

    def hand_back(self, job_id: str, lease: Lease) -> None:
        """Put a job back in line and refund the attempt it was charged: a shutdown wastes no attempt."""
        if self.store.requeue_job(job_id, lease, refund=True, expect_state="running",
                                  reason=f"handed back by {self.id} (shutting down)"):
            log.info("handed job %s back on shutdown", job_id)

    def _set_stage(self, job_id: str, stage: str) -> None:
        try:
            self.store.set_stage(job_id, self.id, stage)
        except redis.RedisError as e:  # progress is best effort: a Redis blip must not fail the compile
            log.warning("could not record stage %s of job %s: %s", stage, job_id, e)

    def _should_stop(self, job_id: str) -> bool:
        """Polled by the sandbox while a child runs: shutdown, a lost lease, or a cancel (Redis at most 1/s)."""
        if self.stopping.is_set() or self.lease_lost:
            return True
        now = time.monotonic()
        if now < self._next_cancel_check:
            return False
        self._next_cancel_check = now + 1.0
        try:
            return self.store.cancel_requested(job_id)
        except redis.RedisError:
            return False

    def _inductor_remote_cache_env(self) -> dict[str, str]:
        """Point Inductor's own remote caches at the service's Redis (compile children only). torch reads these
        when it starts, in the child and in its compile subprocesses alike; a Redis it cannot reach only turns
        the cache off for that compile."""
        if not self.settings.inductor_remote_cache:
            return {"TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "0", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0"}
        return {"TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
                "TORCHINDUCTOR_REDIS_URL": self.settings.redis_url}

    def _compile_and_check(self, job: dict[str, Any], workdir: Path) -> tuple[Outcome, dict[str, Any]]:
        store, job_id = self.store, job["id"]
        workdir.mkdir(parents=True, exist_ok=True)
        model = store.get_model(job["model_id"])
        if model is None:
            return Outcome(False, error={"type": "NotFound", "stage": "fetch", "retryable": False, "excerpt": "",
                                         "message": f"model {job['model_id']} is gone from the store"}), {}
        model_path = workdir / "model.pt2"
        store.blob_to_file("model", job["model_id"], model_path)

        def on_stage(stage: str) -> None:
            self._set_stage(job_id, stage)

        def cancelled() -> bool:
            return self._should_stop(job_id)

        # Inductor's caches live in the work dir, and so does the temp dir: AOTInductor keeps its precompiled
        # headers under tempfile.gettempdir() whatever TORCHINDUCTOR_CACHE_DIR says, and building them is most of
        # a fresh worker's first compile (13 s of 27 s for a tiny CPU model here; about 60 s on the GPU machine).
        # A work dir on a volume (docker-compose.yml) keeps them across restarts.
        tmp = (self.settings.work_dir / "tmp").resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        env = {"TORCHINDUCTOR_CACHE_DIR": str((self.settings.work_dir / "inductor-cache").resolve()), "TMPDIR": str(tmp)}
        if self.settings.child_ld_preload:
            env["LD_PRELOAD"] = self.settings.child_ld_preload
        device = self.info["device"]
        package = workdir / "artifact.pt2"
        store.incr_compiles()
        compiled = run_child(
            {"kind": "compile", "model_path": str(model_path), "spec": job["spec"], "options": job["options"],
             "program_inputs": model["inputs"], "device": device, "out_path": str(package),
             "share_gemm_timings": ({"redis_url": self.settings.redis_url, "target": self.target}
                                    if self.settings.share_gemm_timings else None)},
            workdir, timeout_s=self.settings.compile_timeout_s, on_stage=on_stage, should_cancel=cancelled,
            env={**env, **self._inductor_remote_cache_env()},
        )
        if not compiled.ok:
            return compiled, {}
        check: dict[str, Any] | None = None
        timings = {**compiled.result["timings"], "compile_total": round(compiled.seconds, 3)}
        if compiled.result.get("package"):  # mode=training produces a report and graphs only: nothing to check
            checked = run_child(
                {"kind": "check", "model_path": str(model_path), "package_path": compiled.result["package"],
                 "spec": job["spec"], "device": device, "options": job["options"]},
                workdir, timeout_s=self.settings.check_timeout_s, on_stage=on_stage, should_cancel=cancelled, env=env,
            )
            if not checked.ok:
                return checked, {}
            check, timings["check"] = checked.result, round(checked.seconds, 3)
        on_stage("publish")
        # The stage report and the generated sources go in before the record, which is written last.
        report = attach_check(json.loads(Path(compiled.result["report"]).read_text()), check)
        report["key"] = job["key"]
        report["caches"] = compiled.result.get("caches")
        artifact = store.put_artifact({
            "key": job["key"],
            "factors": job["factors"],
            "model_id": job["model_id"],
            "target": self.target,
            "spec": job["spec"],
            "options": job["options"],
            "dynamic_dims": compiled.result["dynamic_dims"],
            "timings": timings,
            "caches": compiled.result.get("caches"),
            "check": check,
            "job_id": job_id,
            "worker": {"id": self.id, "device_name": self.info["device_name"], "host": self.info["host"]},
        }, Path(compiled.result["package"]) if compiled.result.get("package") else None,
            report=report, sources=Path(compiled.result["sources"]))
        return Outcome(True), {"key": artifact["key"], "timings": timings, "check": check}


def serve(settings: WorkerSettings, max_jobs: int | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT. A signal mid-job kills the child and hands the job back unspent."""
    from compiler.device import detect

    info = detect(settings.device)
    w = Worker(settings, info)

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
