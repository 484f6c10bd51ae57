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
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compiler.errors import Failure
from worker.child import READY
from worker.sandbox import Outcome, excerpt, run_child

log = logging.getLogger("aotc.worker")

REASON_MAX_CHARS = 4000  # unhealthy_reason: the message, then the tail of the child's stderr
STDERR_TAIL_CHARS = 2000


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


def cause(failure: Failure) -> str:
    """What a failure before the handshake says happened, in one line."""
    if failure.type in ("Crashed", "Timeout", "LimitExceeded"):
        return failure.message  # how it died, or the limit it hit (naming the setting)
    return f"{failure.type}: {failure.message}"  # the exception the child reported (ImportError: ...)


class Health:
    """Counts children in a row that failed before their work started, and says when the worker is unhealthy."""

    def __init__(self, max_early_crashes: int) -> None:
        self.max_early_crashes = max_early_crashes
        self.early_crashes = 0  # in a row
        self.reason: str | None = None  # set while unhealthy
        self.since: float | None = None

    @property
    def healthy(self) -> bool:
        return self.reason is None

    def describe(self) -> dict[str, Any]:
        """For the worker's registry record (GET /v1/workers)."""
        return {"healthy": self.healthy, "unhealthy_reason": self.reason, "unhealthy_since": self.since,
                "early_crashes": self.early_crashes}

    def run_child(self, task: dict[str, Any], jobdir: Path, *, on_stage: Callable[[str], None] = lambda s: None,
                  **kwargs: Any) -> Outcome:
        """worker.sandbox.run_child, watching for the handshake: a failure before it is a BrokenEnvironment."""
        handshake = Handshake(on_stage)
        outcome = run_child(task, jobdir, on_stage=handshake, **kwargs)
        return self.judge(task["kind"], outcome, handshake.seen, jobdir / f"{task['kind']}.log")

    def judge(self, kind: str, outcome: Outcome, started: bool, log_path: Path | None = None) -> Outcome:
        """The outcome of a `kind` child, and whether it `started`: counted, and turned into a BrokenEnvironment
        failure when it failed before its work started."""
        if started or outcome.ok:
            if not self.healthy:
                log.info("a %s child got through its imports again: this worker serves again", kind)
            self.early_crashes, self.reason, self.since = 0, None, None
            return outcome
        if outcome.cancelled or outcome.failure is None:
            return outcome
        failure = Failure.broken_environment(kind, cause(outcome.failure), outcome.failure.excerpt)
        self.early_crashes += 1
        stderr = excerpt(log_path, STDERR_TAIL_CHARS) if log_path else ""
        if not self.healthy:  # a probe of a worker already unhealthy: its reason already says all this
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
