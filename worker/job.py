"""One job, from its queue entry to its end: claim -> compile -> check -> publish.

The claim starts the job (counting the attempt) and checks it can run here; the compile and the check each run
in a child process (worker.sandbox); a checked artifact is published write-then-record, so a job delivered twice
finds its own result. Every way an attempt ends is a job transition: succeeded, cancelled, a failure (retried or
final, compiler.errors.Failure decides which), or handed back unspent when the worker shuts down or loses Redis.
A job whose lease a reaper took is abandoned: it is someone else's now.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import redis

from compiler.errors import Failure
from compiler.report import attach_check  # torch-free
from service.store import Lease, Store
from worker.backoff import until_redis
from worker.sandbox import Outcome, run_child
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")


class JobRunner:
    """Runs a worker's jobs one at a time, and keeps the lease on the current one (its heartbeat calls
    renew_lease)."""

    def __init__(self, store: Store, settings: WorkerSettings, info: dict[str, Any], worker_id: str,
                 stopping: threading.Event) -> None:
        self.store = store
        self.settings = settings
        self.info = info
        self.target: str = info["target"]
        self.id = worker_id
        self.stopping = stopping  # shutdown requested (SIGTERM/SIGINT)
        self.current: tuple[str, Lease] | None = None  # (job id, the lease on its queue entry)
        self._lost: Lease | None = None  # a lease the heartbeat found taken by a reaper
        self._next_cancel_check = 0.0
        self.jobs_done = 0

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

    def hand_back(self, job_id: str, lease: Lease) -> None:
        """Put a job back in line and refund the attempt it was charged: a shutdown wastes no attempt."""
        if self.store.jobs.requeue(job_id, lease, refund=True, expect_state="running",
                                   reason=f"handed back by {self.id} (shutting down)"):
            log.info("handed job %s back on shutdown", job_id)

    # -- one job ------------------------------------------------------------------------------------------------

    def process(self, lease: Lease, job_id: str) -> None:
        try:
            self._process(lease, job_id)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # Redis went away mid-job: once it is back, hand the job back unspent (it was not the job's fault).
            # If that cannot happen within a lease, the reaper requeues it as a lost worker's job.
            log.warning("lost Redis during job %s (%s); handing it back when Redis returns", job_id, e)
            deadline = time.monotonic() + self.settings.lease_s

            def give_up(delay: float) -> bool:
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                return self.lease_lost or time.monotonic() >= deadline

            def hand_back_if_held() -> None:
                if self.store.leases.renew(lease):
                    self.hand_back(job_id, lease)

            if not self.lease_lost:
                until_redis(hand_back_if_held, f"hand job {job_id} back", give_up, cap_s=1.0)
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
        workdir = self.settings.work_dir / f"{job_id}-{attempt}"
        try:
            outcome, result = self._compile_and_check(job, workdir)
            if self.lease_lost:  # a reaper requeued the job: it is someone else's now
                log.warning("job %s: lease lost mid-job; result discarded", job_id)
            elif outcome.cancelled and self.stopping.is_set() and not jobs.cancel_requested(job_id):
                self.hand_back(job_id, lease)
            elif outcome.cancelled:
                jobs.finish(job_id, "cancelled", lease=lease, error=outcome.failure)
            elif outcome.ok:
                jobs.finish(job_id, "succeeded", lease=lease, artifact=result["key"], timings=result["timings"],
                            check=result["check"])
            else:
                assert outcome.failure is not None
                what = jobs.retry_or_fail(job, lease, outcome.failure)
                log.info("job %s attempt %d: %s (%s)", job_id, attempt, outcome.failure.message, what)
        finally:
            self.jobs_done += 1
            if not self.settings.keep_work:
                shutil.rmtree(workdir, ignore_errors=True)

    # -- compile, check, publish --------------------------------------------------------------------------------

    def _set_stage(self, job_id: str, stage: str) -> None:
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
        model = store.models.get(job["model_id"])
        if model is None:
            return Outcome(False, failure=Failure.not_found(f"model {job['model_id']} is gone from the store",
                                                            "fetch")), {}
        model_path = workdir / "model.pt2"
        store.blobs.to_file("model", job["model_id"], model_path)

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
        cache_dir = (self.settings.work_dir / "inductor-cache").resolve()
        env = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TMPDIR": str(tmp)}
        if self.settings.child_ld_preload:
            env["LD_PRELOAD"] = self.settings.child_ld_preload
        device = self.info["device"]
        package = workdir / "artifact.pt2"
        store.caches.record_compile()
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
        artifact = store.artifacts.put({
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
