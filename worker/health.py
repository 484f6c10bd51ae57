"""A worker that knows when it is broken.

Every child (compile, check, warm-up, probe) appends the stage READY to its events once it has imported torch and
the compiler and touched its device, before it reads anything of the job (worker.child). The worker sees it live,
as the sandbox relays the child's stages. A child that fails before it failed because of this worker's environment
(a broken torch or CUDA install, a missing library, the sandbox, a limit too small to import torch), never because
of the model, whose bytes it had not yet read. Then:

- its failure becomes `BrokenEnvironment` (compiler.errors), naming the cause: the child's own error, or how it
  died, with its output;
- the job goes back in line with its attempt refunded (worker.job), for a healthy worker to take;
- after AOTC_WORKER_MAX_EARLY_CRASHES such children in a row the worker is unhealthy: it stops claiming jobs; its
  heartbeats go on (no reaper takes it for lost) and its registry record says `healthy: false`, with
  `unhealthy_reason` (the last child's failure and the tail of its stderr) and `unhealthy_since`. GET /v1/workers,
  /readyz and `aotc workers` show it;
- an unhealthy worker runs a probe child (the handshake alone) every AOTC_WORKER_REPROBE_S, and serves again once
  one gets through.

A child that got through the handshake resets the count, whatever became of its job. A child cancelled before it
does not count.

A device can also stop working under a child that got through its handshake (a GPU that falls off the bus
mid-check: the check's own error is then "CUDA error: unknown error", or a probe's "CUDA-capable device(s) is/are
busy or unavailable"). Such a failure would be charged to the model, and a CheckFailed verdict read from a dying
device would be wrong. So after a child fails once its work started, on a device AOTC_WORKER_DEVICE_RECHECK covers
(CUDA, by default), a probe child tries the device at once. Where the probe fails:

- the failure becomes `DeviceLost`, naming the probe's error and the child's own; the job goes back with its
  attempt refunded, once: a second device lost under the same job fails it, final, since an upload that takes
  GPUs down would otherwise take one more each try (worker.job);
- the worker is unhealthy at once (the evidence is the device failing now, not a count), and the reprobes above
  bring it back.

Where the probe gets through, the child's failure stands. The decision rests on the probe, never on the words of
an error a hostile package could print.

A full disk (worker.disk) is the other way a worker is unhealthy: before every claim it measures its work dir and
its file blob store, and while one has less free than AOTC_DISK_LOW_WATER_MB it claims nothing and says so
(`unhealthy_reason`: which path, its free bytes and the setting; `last_disk_full`: the last job that ran out of
space, in its own words, which only an admin's GET /v1/workers shows, never the keyless /readyz), re-measuring
every AOTC_POLL_MS until there is room again, by itself. A child whose failure was a full disk (its output says
so, or a disk is below the mark when it dies) fails with `DiskFull` rather than its own error, handshake or not.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compiler.errors import Failure
from service.store.disk import Space, is_disk_full, mb
from worker.child import READY
from worker.disk import DiskWatch, says_full
from worker.sandbox import Outcome, excerpt, read_untrusted, run_child

log = logging.getLogger("aotc.worker")

REASON_MAX_CHARS = 4000  # unhealthy_reason: the message, then the tail of the child's stderr
RESULT_SCAN_BYTES = 4 * 2**20  # how much of a failed child's result.json is searched for a full disk
STDERR_TAIL_CHARS = 2000
RECHECK_TIMEOUT_S = 300.0  # the device probe after a failed child: importing torch on a loaded host, a context


def printable(text: str) -> str:
    """`text` with every character that could drive a terminal escaped (line breaks and tabs stay)."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text)


class Handshake:
    """A child's stage relay: passes every stage on to `on_stage` but the handshake, which it notes."""

    def __init__(self, on_stage: Callable[[str], None]) -> None:
        self.on_stage = on_stage
        self.seen = False

    def __call__(self, stage: str) -> None:
        if stage == READY:
            self.seen = True
        else:
            self.on_stage(stage)


def cause_of(failure: Failure) -> str:
    """What a failure before the handshake says happened, in one line."""
    if failure.type in ("Crashed", "Timeout", "LimitExceeded"):
        return failure.message  # how it died, or the limit it hit (naming the setting)
    return f"{failure.type}: {failure.message}"  # the exception the child reported (ImportError: ...)


class Health:
    """Counts children in a row that failed before their work started, watches the disks (`disk`, when given), and
    says when the worker is unhealthy."""

    def __init__(self, max_early_crashes: int, disk: DiskWatch | None = None, device_recheck: str = "auto") -> None:
        self.max_early_crashes = max_early_crashes
        self.device_recheck = device_recheck  # AOTC_WORKER_DEVICE_RECHECK
        self.early_crashes = 0  # in a row
        self.reason: str | None = None  # set while the environment is broken
        self.since: float | None = None
        self.disk = disk
        self.disk_reason: str | None = None  # set while a disk is below the low-water mark
        self.disk_since: float | None = None
        self.last_full: str | None = None  # the last failure that was a full disk: `last_disk_full`

    @property
    def healthy(self) -> bool:
        return self.reason is None and self.disk_reason is None

    def describe(self) -> dict[str, Any]:
        """For the worker's registry record (GET /v1/workers)."""
        reasons = [r for r in (self.disk_reason, self.reason) if r]
        since = [t for t in (self.disk_since, self.since) if t is not None]
        return {"healthy": self.healthy, "unhealthy_reason": "\n".join(reasons)[:REASON_MAX_CHARS] or None,
                "unhealthy_since": min(since) if since else None, "early_crashes": self.early_crashes,
                "last_disk_full": self.last_full if self.disk_reason else None}

    # -- the disks ------------------------------------------------------------------------------------------------

    def check_disk(self) -> bool:
        """Measure the disks: unhealthy while one is below the low-water mark, healthy again once all have room.
        Returns whether the disks have room."""
        if self.disk is None:
            return True
        short = self.disk.short()
        if short is None:
            if self.disk_reason is not None:
                log.info("the disks have room again (%s): this worker serves again", self.disk.reserve())
            self.disk_reason, self.disk_since, self.last_full = None, None, None
            return True
        reason = printable(
            f"disk full: {short.describe()}, below {self.disk.reserve()} ({mb(self.disk.low_water)}), so this "
            "worker claims no jobs until there is room there; it re-measures every AOTC_POLL_MS")[:REASON_MAX_CHARS]
        if self.disk_reason is None:
            self.disk_since = time.time()
            log.error("worker unhealthy: %s", reason)
        self.disk_reason = reason
        return False

    def disk_failure(self, stage: str, e: BaseException) -> Failure:
        """The DiskFull failure of the trusted worker's own write (fetching the model, a child's task, publishing)."""
        assert is_disk_full(e)
        short = self.disk.short() if self.disk is not None else None
        cause = f"{type(e).__name__}: {e}" + (f" ({short.describe()})" if short is not None else "")
        return self._full(Failure.disk_full(stage, cause))

    def _full(self, failure: Failure) -> Failure:
        self.last_full = failure.message[:1000]
        log.error("%s", failure.message)
        return failure

    def _child_full(self, kind: str, failure: Failure, log_path: Path | None, childdir: Path | None) -> Failure | None:
        """DiskFull when a failed child's output reports a full disk, or a disk is below the mark now that it is
        dead (before its files are removed); else None. The output: its log's tail, and its whole result, whose
        error message the job record keeps only the start of (g++ says "No space left on device" last, after pages
        of warnings)."""
        raw = read_untrusted(childdir, "result.json", RESULT_SCAN_BYTES) if childdir is not None else None
        text = "\n".join((failure.message, failure.excerpt, excerpt(log_path, 64 * 1024) if log_path else "",
                          (raw or b"").decode("utf-8", "replace")))
        said = says_full(text)
        short: Space | None = self.disk.short() if self.disk is not None else None
        if said is None and short is None:
            return None
        where = (f"{short.describe()} ({self.disk.reserve()})" if short is not None and self.disk is not None
                 else "")
        cause = printable("; ".join(p for p in (f"its output says {said!r}" if said else "", where) if p))
        return self._full(Failure.disk_full(kind, f"{cause}; the {kind} child's own error: {cause_of(failure)[:300]}",
                                            failure.excerpt))

    def run_child(self, task: dict[str, Any], jobdir: Path, *, on_stage: Callable[[str], None] = lambda s: None,
                  **kwargs: Any) -> Outcome:
        """worker.sandbox.run_child, watching for the handshake: a failure before it is a BrokenEnvironment."""
        handshake = Handshake(on_stage)
        outcome = run_child(task, jobdir, on_stage=handshake, **kwargs)
        return self.settle(task, outcome, handshake.seen, jobdir, **kwargs)

    def settle(self, task: dict[str, Any], outcome: Outcome, started: bool, jobdir: Path, **kwargs: Any) -> Outcome:
        """What `run_child` makes of a child's outcome, for a child run apart (worker.earlycheck runs its own in a
        thread, and settles it here, in the job's): judged, and its device rechecked where it failed after its
        handshake."""
        outcome = self.judge(task["kind"], outcome, started, jobdir / f"{task['kind']}.log", jobdir / task["kind"])
        if started and self._recheck(task["kind"], str(task.get("device") or "cpu"), outcome):
            return self.recheck(task, outcome, jobdir, **kwargs)
        return outcome

    def _recheck(self, kind: str, device: str, outcome: Outcome) -> bool:
        """Whether a failed child's device is tried again: a failure the job could owe to a device that stopped
        working, on a device AOTC_WORKER_DEVICE_RECHECK covers."""
        if outcome.ok or outcome.cancelled or outcome.failure is None or kind == "probe":
            return False
        if outcome.failure.type in ("LimitExceeded", "DiskFull", "BrokenEnvironment", "Cancelled"):
            return False
        return self.device_recheck == "always" or (self.device_recheck == "auto" and device.startswith("cuda"))

    def recheck(self, task: dict[str, Any], outcome: Outcome, jobdir: Path, **kwargs: Any) -> Outcome:
        """`task`'s child failed after its handshake: run a probe child on its device (in a dir of its own under
        `jobdir`). If the probe gets through, `outcome` stands; if it fails, the device stopped working under the
        job: DeviceLost, and this worker is unhealthy until a reprobe gets through."""
        assert outcome.failure is not None
        kind, device = task["kind"], str(task.get("device") or "cpu")
        probe_kwargs = {**kwargs, "timeout_s": min(float(kwargs.get("timeout_s") or RECHECK_TIMEOUT_S),
                                                   RECHECK_TIMEOUT_S)}
        probed = run_child({"kind": "probe", "device": device}, jobdir / f"{kind}-device-probe", **probe_kwargs)
        if probed.ok or probed.cancelled or probed.failure is None:
            log.info("the %s child failed (%s) and %s still works: the failure stands", kind, outcome.failure.type,
                     device)
            return outcome
        cause = cause_of(probed.failure)
        failure = Failure.device_lost(kind, device, cause, outcome.failure)
        self.since = self.since or time.time()
        self.reason = printable(f"{device} stopped working under a {kind}: a probe child right after it failed "
                                f"({cause}), so this worker claims no jobs until a reprobe gets through "
                                f"(AOTC_WORKER_REPROBE_S)")[:REASON_MAX_CHARS]
        log.error("worker unhealthy: %s; the %s's own error: %s", self.reason, kind, outcome.failure.message[:500])
        return dataclasses.replace(outcome, failure=failure)

    def judge(self, kind: str, outcome: Outcome, started: bool, log_path: Path | None = None,
              childdir: Path | None = None) -> Outcome:
        """The outcome of a `kind` child, and whether it `started`: counted, and turned into a BrokenEnvironment
        failure when it failed before its work started, or a DiskFull one when it ran out of disk space."""
        if started or outcome.ok:
            if self.reason is not None:
                log.info("a %s child got through its imports again: this worker serves again", kind)
            self.early_crashes, self.reason, self.since = 0, None, None
        if outcome.ok or outcome.cancelled or outcome.failure is None:
            return outcome
        # A child that filled its own sandbox's tmpfs went past AOTC_CHILD_MAX_DISK_MB: the job's fault, final, even
        # though its output says "No space left on device" as a full host disk would.
        if outcome.failure.type != "LimitExceeded" and \
                (full := self._child_full(kind, outcome.failure, log_path, childdir)) is not None:
            return Outcome(False, failure=full, seconds=outcome.seconds)
        if started:
            return outcome
        failure = Failure.broken_environment(kind, cause_of(outcome.failure), outcome.failure.excerpt)
        self.early_crashes += 1
        stderr = excerpt(log_path, STDERR_TAIL_CHARS) if log_path else ""
        if self.reason is not None:  # a probe of a worker already unhealthy: its reason already says all this
            log.warning("still unhealthy: %s", failure.message)
            return Outcome(False, failure=failure, seconds=outcome.seconds)
        log.error("%s (%d in a row; the worker stops claiming jobs at AOTC_WORKER_MAX_EARLY_CRASHES=%d)\n%s",
                  failure.message, self.early_crashes, self.max_early_crashes, stderr or failure.excerpt[-2000:])
        if self.early_crashes >= self.max_early_crashes:
            self.since = time.time()
            self.reason = printable(
                f"{self.early_crashes} children in a row failed before their work started "
                f"(AOTC_WORKER_MAX_EARLY_CRASHES={self.max_early_crashes}), so this worker claims no jobs; "
                f"the last: {failure.message} [python: {sys.executable}]"
                + (f"\n--- its stderr, last lines ---\n{stderr.strip()}" if stderr.strip() else ""))[:REASON_MAX_CHARS]
            log.error("worker unhealthy: %s", self.reason)
        return Outcome(False, failure=failure, seconds=outcome.seconds)

    def probe(self, jobdir: Path, **kwargs: Any) -> bool:
        """Run the health probe (a child that does the handshake and nothing else) in `jobdir`; True when it got
        through, and then the worker is healthy again. `kwargs` go to run_child (sandbox, device, limits...)."""
        outcome = self.run_child({"kind": "probe", "device": kwargs.get("device", "cpu")}, jobdir, **kwargs)
        return outcome.ok
