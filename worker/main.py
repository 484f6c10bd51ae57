"""The worker: reads jobs for its concrete target from a Redis stream, compiles and checks each in a child
process, and publishes checked artifacts.

Delivery is at least once. A claimed job is a lease that the heartbeat thread renews (XCLAIM resets the idle
time); any worker reclaims leases left to expire (XAUTOCLAIM), so a worker that dies loses no job. The attempt
is counted at claim time, so a job that keeps killing workers still stops at max_attempts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from compiler.report import attach_check  # torch-free
from service import keys
from service.store import TERMINAL, Store
from worker.sandbox import Outcome, run_child
from worker.settings import WorkerSettings

log = logging.getLogger("aotc.worker")


class Worker:
    def __init__(self, settings: WorkerSettings, info: dict[str, Any]) -> None:
        self.settings = settings
        self.info = info
        self.target: str = info["target"]
        self.id = f"{info['host']}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.store = Store(settings.redis_url, chunk_bytes=settings.chunk_mb * 2**20)
        self.stream = keys.queue(self.target)
        self.started = time.time()
        self.current: tuple[str, str] | None = None  # (job id, stream message id) under lease
        self.stopping = threading.Event()
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

    def heartbeat(self) -> None:
        self.store.heartbeat_worker(self.record(), self.settings.worker_ttl_s)
        if self.current:
            # Renew the lease: resets the pending entry's idle time so no reaper takes it.
            self.store.r.xclaim(self.stream, keys.QUEUE_GROUP, self.id, 0, [self.current[1]], justid=True)

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.settings.heartbeat_s):
            try:
                self.heartbeat()
            except Exception as e:  # Redis blips must not kill the heartbeat
                log.warning("heartbeat failed: %s", e)

    # -- the loop ----------------------------------------------------------------------------------------------

    def next_message(self) -> tuple[str, str] | None:
        """A reclaimed expired lease first, else a new message. Returns (message id, job id)."""
        lease_ms = int(self.settings.lease_s * 1000)
        _, claimed, *_ = self.store.r.xautoclaim(
            self.stream, keys.QUEUE_GROUP, self.id, lease_ms, start_id="0-0", count=1
        )
        if claimed:
            msg_id, fields = claimed[0]
            if fields:  # deleted entries come back empty
                log.info("reclaimed job %s after its lease expired", fields.get("job"))
                return msg_id, fields["job"]
            self.store.r.xack(self.stream, keys.QUEUE_GROUP, msg_id)
        res = self.store.r.xreadgroup(
            keys.QUEUE_GROUP, self.id, {self.stream: ">"}, count=1, block=self.settings.poll_ms
        )
        if not res:
            return None
        msg_id, fields = res[0][1][0]
        return msg_id, fields["job"]

    def run(self, max_jobs: int | None = None) -> None:
        self.store.ensure_group(self.target)
        self.heartbeat()
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info("worker %s serving %s (%s)", self.id, self.target, self.info["device_name"])
        try:
            while not self.stopping.is_set():
                try:
                    msg = self.next_message()
                except Exception as e:  # Redis down: back off and retry, never exit
                    log.warning("queue read failed (%s); retrying", e)
                    self.stopping.wait(2.0)
                    continue
                if msg is None:
                    continue
                self.process(*msg)
                if max_jobs is not None and self.jobs_done >= max_jobs:
                    break
        finally:
            self.stopping.set()
            try:
                self.store.remove_worker(self.id)
            except Exception:
                pass

    def ack(self, msg_id: str) -> None:
        self.store.r.xack(self.stream, keys.QUEUE_GROUP, msg_id)

    # -- one job -----------------------------------------------------------------------------------------------

    def process(self, msg_id: str, job_id: str) -> None:
        store = self.store
        job = store.get_job(job_id)
        if job is None or job["state"] in TERMINAL:
            self.ack(msg_id)
            return
        attempt = store.claim_attempt(job_id)
        max_attempts = int(job.get("max_attempts", 3))
        if attempt > max_attempts:
            last = job.get("error") or {}
            store.finish_job(job_id, "failed", error={
                **last, "message": f"gave up after {max_attempts} attempts; last: {last.get('message', 'worker lost')}"})
            self.ack(msg_id)
            return
        if job["toolchain"] != self.info["toolchain"]:
            store.finish_job(job_id, "failed", error={
                "type": "ToolchainMismatch", "stage": "claim", "retryable": False, "excerpt": "",
                "message": f"job was keyed for toolchain {job['toolchain']}, but this worker runs {self.info['toolchain']}"})
            self.ack(msg_id)
            return
        if store.get_artifact(job["key"]):  # an earlier delivery already finished the work
            store.finish_job(job_id, "succeeded", artifact=job["key"])
            self.ack(msg_id)
            return

        self.current = (job_id, msg_id)
        store.update_job(job_id, state="running", stage="fetch", started=time.time(), worker=self.id, attempt=attempt)
        workdir = self.settings.work_dir / f"{job_id}-{attempt}"
        try:
            outcome, result = self._compile_and_check(job, workdir)
            if outcome.cancelled:
                store.finish_job(job_id, "cancelled", error=outcome.error)
            elif outcome.ok:
                store.finish_job(job_id, "succeeded", artifact=result["key"], timings=result["timings"],
                                 check=result["check"])
            elif outcome.error.get("retryable") and attempt < max_attempts:
                store.update_job(job_id, state="queued", stage="queued", error=outcome.error)
                store.r.xadd(self.stream, {"job": job_id})  # back in line for any worker of this target
            else:
                store.finish_job(job_id, "failed", error=outcome.error)
            self.ack(msg_id)
        except KeyboardInterrupt:  # SIGTERM/SIGINT mid-job: the child is dead already (run_child kills it)
            self.hand_back(job_id, msg_id)
            raise
        finally:
            self.current = None
            self.jobs_done += 1
            if not self.settings.keep_work:
                shutil.rmtree(workdir, ignore_errors=True)

    def hand_back(self, job_id: str, msg_id: str) -> None:
        """Put a job back in line and refund the attempt it was charged: a shutdown wastes no attempt."""
        self.store.r.hincrby(keys.job(job_id), "attempts", -1)
        self.store.update_job(job_id, state="queued", stage="queued")
        self.store.r.xadd(self.stream, {"job": job_id})
        self.ack(msg_id)
        log.info("handed job %s back on shutdown", job_id)

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
            store.update_job(job_id, stage=stage)

        def cancelled() -> bool:
            return store.cancel_requested(job_id)

        env = {"TORCHINDUCTOR_CACHE_DIR": str((self.settings.work_dir / "inductor-cache").resolve())}
        if self.settings.child_ld_preload:
            env["LD_PRELOAD"] = self.settings.child_ld_preload
        device = self.info["device"]
        package = workdir / "artifact.pt2"
        store.incr_compiles()
        compiled = run_child(
            {"kind": "compile", "model_path": str(model_path), "spec": job["spec"], "options": job["options"],
             "program_inputs": model["inputs"], "device": device, "out_path": str(package)},
            workdir, timeout_s=self.settings.compile_timeout_s, on_stage=on_stage, should_cancel=cancelled, env=env,
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
        artifact = store.put_artifact({
            "key": job["key"],
            "factors": job["factors"],
            "model_id": job["model_id"],
            "target": self.target,
            "spec": job["spec"],
            "options": job["options"],
            "dynamic_dims": compiled.result["dynamic_dims"],
            "timings": timings,
            "check": check,
            "job_id": job_id,
            "worker": {"id": self.id, "device_name": self.info["device_name"], "host": self.info["host"]},
        }, Path(compiled.result["package"]) if compiled.result.get("package") else None,
            report=report, sources=Path(compiled.result["sources"]))
        return Outcome(True), {"key": artifact["key"], "timings": timings, "check": check}


def serve(settings: WorkerSettings, max_jobs: int | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT. A signal mid-job kills the child and hands the job back unspent."""
    from compiler.target import detect

    info = detect(settings.device)
    w = Worker(settings, info)

    def _stop(signum: int, frame: Any) -> None:
        w.stopping.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        w.run(max_jobs=max_jobs)
    except KeyboardInterrupt:
        log.info("worker %s stopped", w.id)
