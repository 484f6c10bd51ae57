"""One job, from its queue entry to its end: claim -> compile -> check -> publish.

The claim starts the job (counting the attempt) and checks it can run here; the compile and the check each run
in a sandboxed child process (worker.sandbox, worker.isolation), and this trusted parent does their I/O: it fetches
the model, seeds and collects the shared max-autotune timings (worker.tuning), and takes the outputs out of the
child's dir once it is dead; a checked artifact is published write-then-record, so a job delivered twice
finds its own result. Every way an attempt ends is a job transition: succeeded, cancelled, a failure (retried or
final, compiler.errors.Failure decides which; a retry waits out a backoff), or handed back unspent when the worker
shuts down, loses Redis, finds its environment broken (a child that failed before its work started:
worker.health), or runs out of disk space (ENOSPC anywhere: worker.disk; refunded at most the job's max_attempts
times, so a job that fills any disk by itself still ends). A job whose lease a reaper took is abandoned: it is
someone else's now.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import redis

from compiler import ontarget, speed  # torch-free
from compiler.digests import file_digests
from compiler.errors import RETRYABLE, BadSignature, Failure
from compiler.report import attach_check  # torch-free
from compiler.signing import ARTIFACT_KEY, Signer, TrustedKey, countersign_statement, key_record, statement
from compiler.signing import verify as verify_manifest
from compiler.weightsfile import FormatError, describe, read_header_file
from service.store import Lease, Store, keys
from service.store.blobstore import local_root
from service.store.disk import is_disk_full
from worker import cpus as cpus_mod
from worker.backoff import retry_delay, until_redis
from worker.devlock import exclusive, lock_path, shared, timing_now
from worker.disk import DiskWatch
from worker.earlycheck import EarlyCheck
from worker.headers import Headers, header_dir
from worker.health import Health
from worker.isolation import Sandbox, headers_dir
from worker.limits import GIB, MIB, Limits
from worker.sandbox import Outcome, take
from worker.settings import WorkerSettings
from worker.tuning import GemmTimingShare

log = logging.getLogger("aotc.worker")
T = TypeVar("T")


class JobRunner:
    """Runs a worker's jobs one at a time, and keeps the lease on the current one (its heartbeat calls
    renew_lease)."""

    def __init__(self, store: Store, settings: WorkerSettings, info: dict[str, Any], worker_id: str,
                 stopping: threading.Event, sandbox: Sandbox) -> None:
        self.store = store
        self.settings = settings
        self.info = info
        self.sandbox = sandbox
        self.headers = Headers(headers_dir(settings), info)
        self.target: str = info["target"]
        self.id = worker_id
        self.stopping = stopping  # shutdown requested (SIGTERM/SIGINT)
        self.current: tuple[str, Lease] | None = None  # (job id, the lease on its queue entry)
        self._lost: Lease | None = None  # a lease the heartbeat found taken by a reaper
        self._next_cancel_check = 0.0
        self.jobs_done = 0
        self._blob_root: Path | None = None
        # Children that fail before their work starts, and disks without room (the work dir, a file blob store).
        self.health = Health(settings.worker_max_early_crashes, DiskWatch(self._disk_paths, settings.disk_low_water_mb),
                             settings.worker_device_recheck)
        self.stage = ""  # the current job's stage, as last recorded
        self.signer: Signer | None = None  # set at start (worker.main): the key that signs each published manifest
        # The timing pass's own cores and every other child's (AOTC_TIMING_CPUS): a quiet device is not a quiet host.
        try:
            self.cpus = cpus_mod.plan(settings.timing_cpus, str(info["device"]))
        except ValueError as e:
            raise SystemExit(f"aotc-worker: {e}") from None
        if self.cpus.timing is not None:
            log.info("timing passes on cores %s, other children on %s (%s)", list(self.cpus.timing),
                     list(self.cpus.others or ()), self.cpus.why)

    # -- the lease ----------------------------------------------------------------------------------------------

    @property
    def lease_lost(self) -> bool:
        """The current job's lease was taken by a reaper: the job is someone else's now, abandon it."""
        current = self.current
        return current is not None and self._lost == current[1]

    def renew_lease(self) -> None:
        """Renew the current job's lease (resets its entry's idle time so no reaper takes it), while it is ours."""
        current = self.current
        if current and self._lost != current[1] and not self.store.leases.renew(current[1]):
            self._lost = current[1]
            if self.current is current:
                log.warning("lost the lease on job %s (a reaper took it); abandoning the job", current[0])

    def _wait_for_redis(self, delay: float) -> bool:
        """until_redis's wait while a job is in hand: True (give up) only once the lease is lost, i.e. a reaper
        took the job and it is someone else's. Neither the outage's length nor a shutdown ends it: the lease cannot
        expire while Redis is down (service/store/reaper.py), and a second signal still forces the exit."""
        time.sleep(delay)
        return self.lease_lost

    def _once_redis_answers(self, fn: Callable[[], T], what: str) -> T:
        """`fn`, retried while Redis is down, so that a compile and check already done are published, not thrown
        away, when Redis comes back (publishing is idempotent). ConnectionError if the lease is lost meanwhile."""
        done = until_redis(lambda: (fn(),), what, self._wait_for_redis, cap_s=2.0)
        if done is None:
            raise redis.ConnectionError(f"lost the lease while waiting for Redis to {what}")
        return done[0]

    def hand_back(self, job_id: str, lease: Lease, why: str = "shutting down", **fields: Any) -> None:
        """Put a job back in line and refund the attempt it was charged: neither a shutdown nor a broken worker
        spends one. `fields` go on the job's record."""
        if self.store.jobs.requeue(job_id, lease, refund=True, expect_state="running",
                                   reason=f"handed back by {self.id} ({why})", **fields):
            log.info("handed job %s back (%s)", job_id, why[:200])

    def _disk_paths(self) -> list[Path]:
        """Where this worker writes: its work dir, and a file blob store's dir once the store is known."""
        if self._blob_root is None:
            try:
                self._blob_root = local_root(self.store.blobs)
            except Exception as e:  # Redis down or no store announced yet: the work dir alone, for now
                log.debug("blob store not known yet: %s", e)
        return [self.settings.work_dir, *([self._blob_root] if self._blob_root is not None else [])]

    # The machine's faults, refunded (the job record's counter) up to a limit: a full disk as often as the job may be
    # attempted (None), then charged like any retryable failure, so that a job that fills every disk still ends; a
    # lost device once. A device lost under the same job twice is more likely the job's doing (a package that
    # takes the GPU down) than chance, and every try takes a device out of service: the job fails, final.
    REFUNDED: dict[str, tuple[str, str, int | None]] = {"DiskFull": ("disk_full_refunds", "a full disk", None),
                                                       "DeviceLost": ("device_lost_refunds", "a lost device", 1)}

    def _refund(self, job: dict[str, Any], lease: Lease, failure: Failure) -> None:
        """A full disk or a device that stopped working is not (at first) the job's fault: hand it back, refunded,
        unless it has been refunded for that as often as REFUNDED allows; then charge it."""
        counter, what_for, limit = self.REFUNDED[failure.type]
        refunds, max_attempts = int(job.get(counter) or 0), int(job.get("max_attempts", 3))
        if refunds < (max_attempts if limit is None else limit):
            self.hand_back(job["id"], lease, failure.message, **{counter: refunds + 1})
            return
        if limit is not None:  # a fixed limit (a lost device): past it, the job's doing, final
            final = dataclasses.replace(failure, retry=False, message=(
                f"the device stopped working under this job on {refunds + 1} attempts, so it is not tried again "
                f"(each took a device out of service); the last: {failure.message}"))
            self.store.jobs.finish(job["id"], "failed", lease=lease, error=final)
            log.error("job %s failed: %s", job["id"], final.message[:500])
            return
        attempt = int(job["attempt"])
        delay = retry_delay(attempt, self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        what = self.store.jobs.retry_or_fail(job, lease, failure, delay_s=delay)
        log.info("job %s attempt %d: %s (refunded %d times for %s already: %s)", job["id"], attempt,
                 failure.message, refunds, what_for, what)

    # -- one job ------------------------------------------------------------------------------------------------

    def process(self, lease: Lease, job_id: str) -> None:
        try:
            self._process(lease, job_id)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # Redis went away in the job's bookkeeping: once it is back, hand the job back unspent (it was not the
            # job's fault). The lease cannot expire meanwhile (the reaper waits a lease after Redis comes back).
            log.warning("lost Redis during job %s (%s); handing it back when Redis returns", job_id, e)

            def hand_back_if_held() -> None:
                if self.store.leases.renew(lease):
                    self.hand_back(job_id, lease)

            if not self.lease_lost:
                until_redis(hand_back_if_held, f"hand job {job_id} back", self._wait_for_redis, cap_s=1.0)
        except Exception as e:
            # A fault in the worker itself, not in the compile (which runs in a child): fail this attempt with
            # what happened, rather than leaving the lease to expire as if the worker were lost.
            log.exception("job %s: the worker failed", job_id)
            job = self.store.jobs.get(job_id) or {}
            if job.get("state") == "running" and job.get("worker") == self.id:
                self.store.jobs.retry_or_fail(job, lease, Failure.worker_error(e, job.get("stage", "")))
        finally:
            self.current = None

    def _process(self, lease: Lease, job_id: str) -> None:
        jobs = self.store.jobs
        job = jobs.get(job_id) if job_id else None
        if job is None:
            self.store.leases.drop(lease)
            return
        started, attempt = jobs.start(job_id, lease)
        if started == "cancel":
            jobs.finish(job_id, "cancelled", lease=lease, error=Failure.cancelled("cancelled before it started"))
            return
        if started != "running":  # ended meanwhile, or a stale duplicate entry: start dropped it
            log.info("skipped job %s (%s)", job_id, started)
            return
        job = {**job, "state": "running", "attempt": attempt, "worker": self.id}
        max_attempts = int(job.get("max_attempts", 3))
        if attempt > max_attempts:  # only reachable through odd histories (e.g. refunds racing a reaper)
            jobs.retry_or_fail(job, lease, Failure.gave_up(max_attempts, (job.get("failures") or [{}])[-1]))
            return
        if job["toolchain"] != self.info["toolchain"]:
            jobs.finish(job_id, "failed", lease=lease,
                        error=Failure.toolchain_mismatch(job["toolchain"], self.info["toolchain"]))
            return
        if self.store.artifacts.get(job["key"]):  # an earlier delivery already finished the work
            jobs.finish(job_id, "succeeded", lease=lease, artifact=job["key"])
            return

        self.current = (job_id, lease)
        log.info("job %s attempt %d of %d (%s)", job_id, attempt, max_attempts, lease.stream.rsplit(":", 1)[-1])
        if not self.sandbox.on:
            log.warning("job %s runs UNCONFINED: AOTC_SANDBOX=off, so its compile and check run with this worker's "
                        "uid, network and files", job_id)
        workdir = (self.settings.work_dir / f"{job_id}-{attempt}").resolve()
        self.stage = "fetch"
        try:
            try:
                work = self._verify_on_target if job.get("kind") == "verify" else self._compile_and_check
                outcome, result = work(job, workdir)
            except Exception as e:  # the worker's own write: the model, a child's task, the outputs, publishing
                if not is_disk_full(e):  # ENOSPC anywhere in the cause chain; else process() reports it
                    raise
                outcome, result = Outcome(False, failure=self.health.disk_failure(self.stage, e)), {}
            if self.lease_lost:  # a reaper requeued the job: it is someone else's now
                log.warning("job %s: lease lost mid-job; result discarded", job_id)
            elif outcome.cancelled and self.stopping.is_set() and not jobs.cancel_requested(job_id):
                self.hand_back(job_id, lease)
            elif outcome.cancelled:
                jobs.finish(job_id, "cancelled", lease=lease, error=outcome.failure)
            elif outcome.ok:
                self._once_redis_answers(partial(
                    jobs.finish, job_id, "succeeded", lease=lease, artifact=result["key"], timings=result["timings"],
                    check=result["check"]), f"record job {job_id} succeeded")
            elif outcome.failure is not None and outcome.failure.type == "BrokenEnvironment":  # not the job's fault
                self.hand_back(job_id, lease, outcome.failure.message)
            elif outcome.failure is not None and outcome.failure.type in self.REFUNDED:  # the machine's fault
                self._refund(job, lease, outcome.failure)
            else:
                assert outcome.failure is not None
                cap = (self.settings.verify_backoff_max_s if job.get("kind") == "verify"
                       else self.settings.retry_backoff_max_s)
                delay = retry_delay(attempt, self.settings.retry_backoff_s, cap)
                what = jobs.retry_or_fail(job, lease, outcome.failure, delay_s=delay)
                log.info("job %s attempt %d: %s (%s%s)", job_id, attempt, outcome.failure.message, what,
                         f"; next attempt in {delay:.1f} s at the earliest" if what == "requeued" and delay else "")
        finally:
            self.jobs_done += 1
            if not self.settings.keep_work:
                shutil.rmtree(workdir, ignore_errors=True)

    # -- compile, check, publish --------------------------------------------------------------------------------

    def _set_stage(self, job_id: str, stage: str) -> None:
        self.stage = stage
        try:
            self.store.jobs.set_stage(job_id, self.id, stage)
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
            return self.store.jobs.cancel_requested(job_id)
        except redis.RedisError:
            return False

    # -- the sandbox's inputs ---------------------------------------------------------------------------------

    def limits(self) -> Limits:
        """The children's limits, from the settings (0 turns one off); the sandbox picks what holds each
        (worker.isolation: a cgroup, a tmpfs, rlimits)."""
        s = self.settings
        return Limits(
            memory_bytes=int(s.compile_max_memory_gb * GIB) if s.compile_max_memory_gb else None,
            cpu_s=s.child_max_cpu_s or None,
            file_bytes=s.child_max_file_mb * MIB if s.child_max_file_mb else None,
            procs=s.child_max_procs or None,
            open_files=s.child_max_open_files or None,
            disk_bytes=s.child_max_disk_mb * MIB if s.child_max_disk_mb else None,
        )

    def _hide(self) -> list[Path]:
        """Besides the sandbox's own list: a file blob store's dir (every user's models and packages)."""
        blobs = getattr(self.store.blobs, "primary", self.store.blobs)
        root = getattr(blobs, "root", None)
        return [root] if isinstance(root, Path) else []

    def _headers(self, childdir: Path) -> list[tuple[Path, Path]]:
        """The trusted precompiled headers, bound read-only into the child's private header dir."""
        tmp = childdir / "tmp"
        header_dir(tmp).mkdir(parents=True, exist_ok=True)
        if not self.sandbox.on:
            self.headers.link_into(tmp)
            return []
        return self.headers.binds(tmp)

    def prepare(self) -> threading.Thread | None:
        """At start: find the trusted precompiled headers built, or build them, before the first job
        (AOTC_HEADERS_WARMUP=before) or in a thread while jobs compile without them (background: the thread)."""
        if self.headers.found():
            log.info("precompiled headers: %d files in %s", len(self.headers.files), self.headers.dir)
            return None
        background = self.settings.headers_warmup == "background"
        # The warm-up's own health record in the background: its child must not race the jobs' children on the
        # early-crash count (a broken environment fails those too, and they count).
        health = Health(self.settings.worker_max_early_crashes) if background else self.health

        def warm_up(adopt: Callable[[Path], None]) -> bool:
            jobdir = (self.settings.work_dir / f"warmup-{os.getpid()}").resolve()
            try:
                outcome = health.run_child({"kind": "warmup", "device": self.info["device"],
                                            "target": self.target, "cpus": self.cpus.for_kind("warmup")}, jobdir,
                                           sandbox=self.sandbox, timeout_s=self.settings.compile_timeout_s,
                                           device=self.info["device"], hide=self._hide(),
                                           keep=lambda: [f"{header_dir(Path('tmp'))}/"],
                                           should_cancel=self.stopping.is_set, **self._pause(self.info["device"]))
                if not outcome.ok:
                    assert outcome.failure is not None
                    log.warning("warm-up compile failed: %s\n%s", outcome.failure.message, outcome.failure.excerpt)
                    return False
                built = jobdir / "headers"  # the worker's: out of the (dead) child's reach before they are adopted
                built.mkdir()
                found = header_dir(jobdir / "warmup" / "tmp")
                for name in os.listdir(found) if found.is_dir() else []:
                    take(found, name, built)
                adopt(built)
                return True
            finally:
                if not self.settings.keep_work:
                    shutil.rmtree(jobdir, ignore_errors=True)

        if not background:
            self.headers.ensure(warm_up)
            return None
        log.info("precompiled headers: building them in the background; compiles go without until they are ready")
        def build() -> None:
            try:
                self.headers.ensure(warm_up)
            except Exception:  # the worker's own fault (its headers dir): compiles go on without, as before
                log.exception("precompiled headers: building them failed; compiles go on without")

        thread = threading.Thread(target=build, name="headers", daemon=True)
        thread.start()
        return thread

    def _compile_and_check(self, job: dict[str, Any], workdir: Path) -> tuple[Outcome, dict[str, Any]]:
        store, job_id = self.store, job["id"]
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o755)  # the worker's: children read the model and their task here, and write nothing
        model = store.models.get(job["model_id"])
        if model is None:
            return Outcome(False, failure=Failure.not_found(f"model {job['model_id']} is gone from the store",
                                                            "fetch")), {}
        model_path = workdir / "model.pt2"
        store.blobs.to_file("model", job["model_id"], model_path)
        os.chmod(model_path, 0o644)

        def on_stage(stage: str) -> None:
            self._set_stage(job_id, stage)

        def cancelled() -> bool:
            return self._should_stop(job_id)

        device = self.info["device"]
        # The job's own target: a CPU worker serves every level at or below its host's, each pinned (compiler.isa).
        target = str(job.get("target") or self.target)
        run = partial(self.health.run_child, sandbox=self.sandbox, device=device, limits=self.limits(),
                      hide=self._hide(), on_stage=on_stage, should_cancel=cancelled)
        options = job["options"] or {}
        tuned = options.get("mode") == "max-autotune" or bool(options.get("autotune"))
        # Within the namespace that created the job (worker/tuning.py); a job queued before jobs recorded it shares
        # nothing.
        ns = store.jobs.namespace_of(job_id) if self.settings.share_gemm_timings and tuned else None
        share = GemmTimingShare(store.r, ns, target) if ns is not None else None

        def prepare(childdir: Path) -> list[tuple[Path, Path]]:
            if share is not None:
                share.seed(childdir)
            return self._headers(childdir)

        # The check's child starts now, beside the compile, where AOTC_CHECK_EARLY says so (worker/earlycheck.py).
        early = self._early_check(job, model_path, workdir, on_stage, cancelled)
        try:
            compile_dir = workdir / "compile"
            store.caches.record_compile()
            compiled = run(
                {"kind": "compile", "model_path": str(model_path), "spec": job["spec"], "options": job["options"],
                 "program_inputs": model["inputs"], "device": device, "out_path": str(compile_dir / "artifact.pt2"),
                 "target": target, "isa_scan_timeout_s": self.settings.isa_scan_timeout_s,
                 "precompiled_headers": self.headers.ready, "cpus": self.cpus.for_kind("compile")},
                workdir, timeout_s=self.settings.compile_timeout_s, prepare=prepare,
                keep=lambda: [*OUTPUTS.values(), *(share.files() if share is not None else [])],
                **self._pause(device),
            )
            if share is not None:
                share.collect(compile_dir)
            if not compiled.ok:
                return compiled, {}
            outputs = _take_outputs(compiled.result, compile_dir, workdir / "results")
            if isinstance(outputs, Failure):
                return Outcome(False, failure=outputs), {}
            caches = {**(compiled.result.get("caches") or {}), "gemm_timings": share.stats if share else None}
            check: dict[str, Any] | None = None
            timings = {**compiled.result["timings"], "compile_total": round(compiled.seconds, 3)}
            if compiled.paused_s:
                timings["compile_paused"] = compiled.paused_s
            if outputs["package"] is not None:  # always, since mode=training builds a package too
                # Correctness beside compiles and other checks: no lock. Its figures were taken on a busy device, so
                # the timing pass replaces them, under the device lock (compiler/timing.py).
                task = {"model_path": str(model_path), "package_path": str(outputs["package"]), "spec": job["spec"],
                        "device": device, "options": job["options"]}
                lock = lock_path(self.settings.data_dir, device) if self.settings.check_exclusive else None
                # No lock at all, or AOTC_TIMING_PASS=auto (alone: and no other worker on this device): a check that
                # finds the device free times itself under the lock (one child fewer); otherwise it runs beside the
                # others, untimed. With AOTC_TIMING_WINDOWS above 1 the timing pass always takes the figures.
                with exclusive(lock, 0) as held:
                    alone = (lock is None and self.settings.timing_windows == 1) or (
                        held["exclusive"] and self._times_itself())
                    if alone:
                        checked = self._check(early, run, task, workdir, timed=True)
                if not alone:
                    # Where compiles pause for the timing (AOTC_TIMING_PAUSE), checks hold the device shared: beside
                    # each other, never beside a timing pass. A check is not paused: its probes keep wall-clock limits.
                    pauses = self._pauses(device)
                    if pauses:
                        self._set_stage(job_id, "check")  # while it waits for a timing pass to end, too
                    with shared(lock if pauses else None, self.settings.check_timeout_s, cancelled) as sh:
                        checked = self._check(early, run, task, workdir, timed=False)
                if not checked.ok:
                    return checked, {}
                timings["check"] = round(checked.seconds, 3)
                if alone:
                    check = {**checked.result, "host": held, "timing": {**held, "pass": "check",
                                                                          "compiles": self._compiles(device)}}
                    timings["check_wait"] = 0.0
                elif options.get("mode") == "training":  # no timing pass for train steps yet: untimed
                    check = {**checked.result, "host": {**held, "exclusive": False}}
                else:
                    host = {**held, "exclusive": False, "waited_s": sh["waited_s"],
                            "reason": "the check holds the device shared: beside other checks, never a timing pass"
                            if sh["shared"]
                            else sh.get("reason") or "the check takes no device lock: the timing pass does"}
                    timed = self._timing_pass(job_id, task, {**checked.result, "host": host}, workdir, run, cancelled)
                    if isinstance(timed, Outcome):
                        return timed, {}
                    check, timings["timing"], timings["check_wait"] = timed
                    check["timing"]["cores"] = {"compile": compiled.cpus, "check": checked.cpus,
                                               **check["timing"].get("cores", {}), "why": self.cpus.why}
                if speed.is_dynamic(job["spec"]):  # no client replays it: its graph figure would promise nothing
                    check = speed.not_replayable(check)
            weights: dict[str, Any] | None = None
            if outputs["weights"] is not None:
                found = _weights_manifest(outputs["weights"], check, self.settings.weights_max_header_mb * 2**20)
                if isinstance(found, Failure):
                    return Outcome(False, failure=found), {}
                weights = found
            on_stage("publish")
            # The stage report and the generated sources go in before the record, which is written last.
            report_path = outputs["report"]
            assert report_path is not None
            report = attach_check(json.loads(report_path.read_text()), check)
            report["key"] = job["key"]
            report["caches"] = caches
            record: dict[str, Any] = {
                "key": job["key"],
                "factors": job["factors"],
                "model_id": job["model_id"],
                "target": target,
                "spec": job["spec"],
                "options": job["options"],
                "dynamic_dims": compiled.result["dynamic_dims"],
                "timings": timings,
                "caches": caches,
                "check": check,
                "job_id": job_id,
                "worker": {"id": self.id, "device_name": self.info["device_name"], "host": self.info["host"]},
            }
            if weights is not None:
                record["weights"] = {"sha256": weights["sha256"], "size": weights["size"],
                                     "constants": len(weights["constants"])}
            # A target it builds but does not serve natively: checked here, on its own device, not on the target.
            blind = outputs["package"] is not None and target in (self.info.get("build_only") or ())
            built_on = str(self.info.get("built_on") or self.target)
            if blind:
                record["on_target"] = {"state": ontarget.UNVERIFIED, "built_on": built_on}

            def publish() -> dict[str, Any]:
                if outputs["package"] is not None:  # a report-only record (mode=training) has no package to sign
                    record["manifest"] = self._sign(job, outputs["package"], check, weights,
                                                    {"run": False, "built_on": built_on} if blind else None)
                return store.artifacts.put(record, outputs["package"], report=report, sources=outputs["sources"],
                                           weights=outputs["weights"])

            artifact = self._once_redis_answers(publish, f"publish job {job_id}")
            if ontarget.state(artifact) == ontarget.UNVERIFIED:
                self._once_redis_answers(partial(self._ask_verify, job, artifact), f"queue the verify job of {job_id}")
            return Outcome(True), {"key": artifact["key"], "timings": timings, "check": check}
        finally:
            if early is not None:
                early.cancel()

    def _early_check(self, job: dict[str, Any], model_path: Path, workdir: Path, on_stage: Callable[[str], None],
                     cancelled: Callable[[], bool]) -> EarlyCheck | None:
        """The job's check child, started beside its compile (worker/earlycheck.py), where AOTC_CHECK_EARLY says
        so: on a CUDA device (auto), never for a train step."""
        device, mode = self.info["device"], self.settings.check_early
        if mode == "off" or (mode == "auto" and not device.startswith("cuda")) or \
                (job["options"] or {}).get("mode") == "training":
            return None
        # Its part before the package waits out other workers' timing passes, as a compile does (AOTC_TIMING_PAUSE).
        paused = self._pause(device)
        return EarlyCheck(self.health, {"model_path": str(model_path), "spec": job["spec"], "device": device,
                                        "options": job["options"], "cpus": self.cpus.for_kind("check")},
                          workdir, timeout_s=self.settings.check_timeout_s, on_stage=on_stage,
                          should_cancel=cancelled, pause=paused.get("pause"), sandbox=self.sandbox, device=device,
                          limits=self.limits(), hide=self._hide(),
                          **({"pause_max_s": paused["pause_max_s"]} if paused else {}))

    def _check(self, early: EarlyCheck | None, run: Callable[..., Outcome], task: dict[str, Any], workdir: Path,
               timed: bool) -> Outcome:
        """The check of `task`'s package: by the early check where one runs, else by a child started now. `timed`:
        it takes the figures itself (unpinned), else it runs untimed on the untimed check's cores."""
        cpus = None if timed else self.cpus.for_kind("check")
        if early is not None:
            took = early.go(task["package_path"], not timed, cpus)
            if took is not None:
                return took
        untimed = {} if timed else {"untimed": True, "cpus": cpus}
        checked: Outcome = run({"kind": "check", **task, **untimed}, workdir, timeout_s=self.settings.check_timeout_s)
        if early is not None and early.fell_back and checked.ok:
            checked.result["early"] = {"fell_back": early.fell_back}
        return checked

    def _ask_verify(self, job: dict[str, Any], artifact: dict[str, Any]) -> None:
        """Queue the job that has a worker serving the artifact's target natively check it there and countersign
        (compiler/ontarget.py). One per artifact at a time (its key is the artifact's)."""
        job_id, created = submit_verify(self.store, artifact["key"], str(artifact["factors"]["target"]), {
            "model_id": artifact["model_id"], "spec": job["spec"], "options": job["options"],
            "toolchain": job["toolchain"], "factors": job["factors"],
            "max_attempts": self.settings.verify_max_attempts,
            "priority": str(job.get("priority") or keys.PRIORITIES[0])})
        if created:
            log.info("artifact %s was built for %s on %s, not run there: verify job %s queued", artifact["key"],
                     artifact["factors"]["target"], artifact["on_target"].get("built_on"), job_id)

    def _verify_on_target(self, job: dict[str, Any], workdir: Path) -> tuple[Outcome, dict[str, Any]]:
        """A verify job: check, on this worker's device (which serves the target natively), a package another
        worker built for it without running it there, and countersign it with this worker's key. The package and
        its weights are the stored bytes its builder's manifest signed (verified here first against the service's
        keys), checked by the same sandboxed check child as a compile's."""
        store, key = self.store, str(job["artifact"])
        art = store.artifacts.get(key)
        if art is None:
            return Outcome(False, failure=Failure.not_found(f"artifact {key} is gone from the store", "fetch")), {}
        done: dict[str, Any] = {"key": key, "timings": {}, "check": None}
        if ontarget.state(art) != ontarget.UNVERIFIED:  # verified (or failed) by an earlier delivery
            return Outcome(True), done
        if self.signer is None:
            raise RuntimeError("this worker has no signing key (worker.main loads one at start)")
        trusted = []
        for rec in store.signing.all():
            try:
                trusted.append(TrustedKey.from_record(rec))
            except (ValueError, TypeError):
                continue
        try:
            manifest = verify_manifest(art.get("manifest"), trusted)
            manifest.expect(key=key, sha256=str(art.get("sha256")), size=int(art.get("size") or 0))
        except BadSignature as e:
            return Outcome(False, failure=Failure.bad_output("fetch", f"refusing to verify artifact {key}: {e}")), {}
        if manifest.target != self._native(manifest.target):
            return Outcome(False, failure=Failure.bad_output(
                "fetch", f"artifact {key} is for {manifest.target}, which this worker does not serve natively")), {}
        workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(workdir, 0o755)  # the worker's: children read the model, the package and their task here
        results = workdir / "results"
        results.mkdir()
        os.chmod(results, 0o755)
        package = results / OUTPUTS["package"]
        self._set_stage(job["id"], "fetch")
        if store.blobs.to_file("artifact", store.artifacts.blob_id(art), package) != manifest.sha256:
            return Outcome(False, failure=Failure.bad_output("fetch", f"artifact {key}'s stored package is not "
                                                                      "the one its manifest signed")), {}
        if manifest.weights is not None:
            sidecar = results / OUTPUTS["weights"]
            if store.blobs.to_file("weights", str(manifest.weights["sha256"]), sidecar) != manifest.weights["sha256"]:
                return Outcome(False, failure=Failure.bad_output("fetch", f"artifact {key}'s weights blob is not "
                                                                          "the one its manifest signed")), {}
            os.chmod(sidecar, 0o644)
        os.chmod(package, 0o644)
        model_path = workdir / "model.pt2"
        if store.models.get(job["model_id"]) is None:
            return Outcome(False, failure=Failure.not_found(f"model {job['model_id']} is gone from the store",
                                                            "fetch")), {}
        store.blobs.to_file("model", job["model_id"], model_path)
        os.chmod(model_path, 0o644)
        checked = self.health.run_child(
            {"kind": "check", "model_path": str(model_path), "package_path": str(package), "spec": job["spec"],
             "device": self.info["device"], "options": job["options"], "untimed": True,
             "cpus": self.cpus.for_kind("check")},
            workdir, sandbox=self.sandbox, device=self.info["device"], limits=self.limits(), hide=self._hide(),
            timeout_s=self.settings.check_timeout_s, on_stage=partial(self._set_stage, job["id"]),
            should_cancel=partial(self._should_stop, job["id"]))
        mark = {**art["on_target"], "worker": self.id, "at": time.time()}
        if not checked.ok:
            if checked.failure is not None and checked.failure.type == "CheckFailed":  # the package, not the machine
                self._once_redis_answers(partial(store.artifacts.set_on_target, key, {
                    **mark, "state": ontarget.FAILED, "checked_on": manifest.target,
                    "why": checked.failure.message[:500]}), f"record artifact {key}'s failed check")
            return checked, {}
        result = checked.result
        summary = {"passed": result.get("passed") is True, "max_abs_err": result.get("max_abs_err"),
                   "max_rel_err": result.get("max_rel_err"), "points": len(result.get("points") or []),
                   "device": self.info["device_name"], "seconds": round(checked.seconds, 3)}
        envelope = self.signer.sign(countersign_statement(
            manifest=manifest, checked_on=manifest.target, check=summary,
            verifier={"id": self.id, "host": self.info["host"], "device_name": self.info["device_name"]}))
        marked = self._once_redis_answers(partial(store.artifacts.set_on_target, key, {
            **mark, "state": ontarget.VERIFIED, "checked_on": manifest.target, "by": self.signer.kid}, envelope),
            f"countersign artifact {key}")
        if marked is None:
            return Outcome(False, failure=Failure.not_found(f"artifact {key} went from the store meanwhile",
                                                            "publish")), {}
        log.info("artifact %s checked on %s and countersigned with key %s", key, manifest.target, self.signer.kid)
        return Outcome(True), {**done, "timings": {"check": round(checked.seconds, 3)}, "check": summary}

    def _native(self, target: str) -> str | None:
        """`target` if this worker serves it natively (not build-only), else None."""
        served = self.info.get("targets") or [self.target]
        return target if target in served and target not in (self.info.get("build_only") or ()) else None

    def _pauses(self, device: str) -> bool:
        """Whether this worker's compiles stop while another's timing pass holds `device` (AOTC_TIMING_PAUSE)."""
        mode = self.settings.timing_pause
        return self.settings.check_exclusive and (mode == "always" or
                                                  (mode == "auto" and not device.startswith("cuda")))

    def _pause(self, device: str) -> dict[str, Any]:
        """run_child's arguments that stop a compile while another worker's timing pass holds `device`."""
        if not self._pauses(device):
            return {}
        return {"pause": partial(timing_now, lock_path(self.settings.data_dir, device)),
                "pause_max_s": self.settings.timing_pause_max_s}

    def _compiles(self, device: str) -> str:
        """What the record says of the compiles of workers like this one while a timing pass held `device`."""
        return ("paused, and checks held off (AOTC_TIMING_PAUSE)" if self._pauses(device)
                else "ran beside it, on the cores AOTC_TIMING_CPUS left them" if self.cpus.timing is not None
                else "ran beside it")

    def _times_itself(self) -> bool:
        """Whether a check that holds the device lock takes the figures itself (one child fewer: no timing pass).
        With AOTC_TIMING_PASS=alone, only while no other live worker shares this device: one that does would wait
        for the lock through this whole check, not just a timing pass; the figures are taken under the lock
        either way. Never with AOTC_TIMING_WINDOWS above 1: only the timing pass takes windows."""
        mode = self.settings.timing_pass
        if self.settings.timing_windows > 1:  # windows are the timing pass's (compiler/timing.py)
            return False
        if mode != "alone":
            return mode == "auto"
        try:
            others = [w for w in self.store.workers.live() if w.get("id") != self.id
                      and w.get("host") == self.info["host"] and w.get("device") == self.info["device"]]
        except redis.RedisError:
            return False
        return not others

    def _timing_pass(self, job_id: str, task: dict[str, Any], check: dict[str, Any], workdir: Path,
                     run: Callable[..., Any], cancelled: Callable[[], bool]
                     ) -> tuple[dict[str, Any], float, float] | Outcome:
        """The check with the timing pass's figures (compiler.speed.with_timing), the pass's seconds and its wait
        for the device lock. A pass that fails in its own work (a crash, its time limit) leaves the check's own
        figures, and the record says so; a cancelled job, or a child that never started (a broken environment, a
        full disk), ends the job as a check's would (the Outcome)."""
        self._set_stage(job_id, "timing")  # while it waits for the lock too
        lock = lock_path(self.settings.data_dir, task["device"]) if self.settings.check_exclusive else None
        with exclusive(lock, self.settings.check_timeout_s, cancelled, announce=self._pauses(task["device"])) as held:
            timed = run({"kind": "time", **task, "cpus": self.cpus.for_kind("time"),
                         "windows": self.settings.timing_windows}, workdir,
                        timeout_s=self.settings.check_timeout_s)
        seconds = round(timed.seconds, 3)
        if timed.cancelled or (timed.failure is not None and timed.failure.type in ("BrokenEnvironment", "DiskFull")):
            return cast(Outcome, timed)
        if not timed.ok:
            log.warning("job %s: the timing pass failed; the check's own figures stay: %s", job_id, timed.failure)
            return speed.with_timing(check, None, {**held, "pass": "failed"}), seconds, held["waited_s"]
        windows = {"windows": self.settings.timing_windows} if self.settings.timing_windows > 1 else {}
        return (speed.with_timing(check, timed.result, {**held, "seconds": seconds, "cores": {"timing": timed.cpus},
                                                        "compiles": self._compiles(task["device"]), **windows}),
                seconds, held["waited_s"])

    def _sign(self, job: dict[str, Any], package: Path, check: dict[str, Any] | None,
              weights: dict[str, Any] | None = None, on_target: dict[str, Any] | None = None) -> dict[str, Any]:
        """The signed manifest (compiler/signing.py) of a package about to be published. Signed here, in the trusted
        worker, from the file the dead child left: the key never reaches a child, and Redis only stores the result.
        The key it signs for comes from the job record in Redis, so it must be one (32 lowercase hex digits): the
        signature would otherwise vouch for a name that consumers turn into a path (client/verify.py refuses one
        too)."""
        if not isinstance(job.get("key"), str) or not ARTIFACT_KEY.fullmatch(job["key"]):
            raise RuntimeError(f"job key {str(job.get('key'))[:80]!r} is not an artifact key: nothing signed")
        signer = self.signer
        if signer is None:
            raise RuntimeError("this worker has no signing key (worker.main loads one at start)")
        # Published again in case Redis lost it (idempotent: a known key keeps its record, revoked or not).
        if self.store.signing.publish(key_record(signer.public)).get("revoked_at") is not None:
            raise RuntimeError(f"this worker's signing key {signer.kid} was revoked: restart the worker with a new "
                               "key (AOTC_SIGNING_KEY_FILE, or delete the one it made to have it make another)")
        size = package.stat().st_size
        digests = file_digests(package)  # sha256, and BLAKE3: what clients verify fastest (compiler/digests.py)
        return signer.sign(statement(
            artifact_key=job["key"], package_sha256=digests["sha256"], package_blake3=digests.get("blake3"),
            package_size=size,
            model_sha256=str(job["factors"].get("model") or job["model_id"]), factors=job["factors"],
            toolchain=self.info["toolchain"], target=str(job.get("target") or self.target), check=check,
            worker={"id": self.id, "host": self.info["host"], "device_name": self.info["device_name"]},
            weights=weights, on_target=on_target))


REPORT_MAX_BYTES = 256 * 2**20
OUTPUTS = {"package": "artifact.pt2", "report": "report.json", "sources": "sources.zip",
           "weights": "artifact.weights.safetensors"}  # compiler.weights.sidecar of the package's name
OPTIONAL = ("package", "weights")  # none for mode=training; no weights for a package that carries its own


def submit_verify(store: Store, artifact_key: str, target: str, fields: dict[str, Any]) -> tuple[str, bool]:
    """Queue (or join) the verify job of an artifact: `fields` are the build's model_id, spec, options, toolchain,
    factors, max_attempts and priority, as a verify job records them."""
    return store.jobs.submit(
        f"verify:{artifact_key}", keys.verify_target(target),
        {"kind": "verify", "artifact": artifact_key,
         **{k: fields[k] for k in ("model_id", "spec", "options", "toolchain", "factors", "max_attempts")}},
        priority=str(fields["priority"]))


def requeue_failed_verifies(store: Store, targets: list[str], max_attempts: int, scan: int = 500) -> list[str]:
    """Verify jobs that ended failed for the machine's reasons (their last failure a retryable type: a crash, a
    timeout, a lost worker; not a failed check) while their artifact is still not run on `targets`, queued again,
    among the newest `scan` failed jobs. A worker that starts serving a target natively calls this: what a broken
    fleet of verifiers gave up on needs no person once one of them works. Returns the new jobs' ids."""
    queued: list[str] = []
    for old in store.jobs.recent(scan, state="failed"):
        error: dict[str, Any] = old["error"] if isinstance(old.get("error"), dict) else {}
        target = str((old.get("factors") or {}).get("target") or "")
        if old.get("kind") != "verify" or target not in targets or error.get("type") not in RETRYABLE:
            continue
        art = store.artifacts.get(str(old.get("artifact")))
        if art is None or ontarget.state(art) != ontarget.UNVERIFIED:
            continue
        job_id, created = submit_verify(store, art["key"], target, {
            **old, "max_attempts": max_attempts, "priority": old.get("priority") or keys.PRIORITIES[0]})
        if created:
            log.warning("artifact %s: its verify job %s failed for the machine's reasons (%s: %s); queued again as "
                        "%s", art["key"], old["id"], error.get("type"), str(error.get("message"))[:200], job_id)
            queued.append(job_id)
    return queued


def _weights_manifest(path: Path, check: dict[str, Any] | None,
                      max_header_bytes: int | None = None) -> dict[str, Any] | Failure:
    """What the manifest signs of a weights blob the compile left: its sha256, BLAKE3, size and constants, read from its
    header here (torch-free, strictly: compiler.weightsfile). Refused unless the check bound this blob and found the
    package reading exactly these constants."""
    try:
        constants = describe(read_header_file(path, max_header_bytes))
    except (FormatError, OSError) as e:
        return Failure.bad_output("publish", f"the compile's weights blob is not a well-formed safetensors file: {e}")
    bound = (check or {}).get("weights") or {}
    fqns = bound.pop("package_fqns", None)  # the check's full list: compared here, then dropped from the record
    names = sorted(c["fqn"] for c in constants)
    if fqns is None:
        return Failure.bad_output("publish", "publish refused: the check did not bind the package's weights blob")
    if sorted(fqns) != names:
        unread, lacking = sorted(set(names) - set(fqns)), sorted(set(fqns) - set(names))
        return Failure.bad_output("publish", f"publish refused: the package's constants do not match its weights "
                                             f"blob (the package does not read {unread[:5]}; the blob lacks "
                                             f"{lacking[:5]})")
    return {**file_digests(path), "size": path.stat().st_size, "constants": constants}


def _take_outputs(result: dict[str, Any], childdir: Path, results: Path) -> dict[str, Path | None] | Failure:
    """Move the compile's outputs into the worker's `results` dir, where the check child reads the package and
    the publish reads everything. The child names them in its result, but only its own files are taken: any other
    path it names (/etc/shadow, a symlink, a FIFO) fails the job."""
    out: dict[str, Path | None] = {}
    for key, name in OUTPUTS.items():
        claimed = result.get(key)
        if key in OPTIONAL and claimed is None:  # mode=training: no package; an embedded package: no weights
            out[key] = None
            continue
        taken = take(childdir, name, results) if claimed == str(childdir / name) else None
        if taken is None:
            return Failure.bad_output("compile", f"the compile's {key} is not the plain file {name} in its own dir "
                                                 f"(it named {str(claimed)[:200]!r})")
        out[key] = taken
    report = out["report"]
    if report is not None and report.stat().st_size > REPORT_MAX_BYTES:
        return Failure.bad_output("compile", f"the compile's stage report is over {REPORT_MAX_BYTES // 2**20} MiB")
    return out
