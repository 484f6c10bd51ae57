"""A job's check started beside its compile (AOTC_CHECK_EARLY), so that only the part that needs the package waits
for the compile.

Most of a check on a GPU needs no package. On an H200 DistilBERT's check child spent about 4 s importing torch
and making its CUDA context, 4 s loading the program onto the device and running it eagerly, and a second or more
deciding eager's verdict on the adversarial cases on a CPU copy of the program (bench/README.md). Started with the
compile, the child does all of that while Inductor generates code, then waits for the worker's word: a file in the
job's dir (read-only to the child, as the model is) that names the package and whether the check times itself.
Eager is timed only after the word (compiler.check.prepare_check), so no figure is taken beside the compile.

What does not change: the child is the check child (worker.child, kind "check") in the same sandbox, with the same
limits and the check's cores; its time limit (AOTC_CHECK_TIMEOUT_S) starts when the word comes (the compile's own
limit bounds the wait); the stages the job shows say "check" only from then on. Where the compile fails or the job
is cancelled, the child is killed. Where the child ends before its word (its part before the package failed: a
device short of memory for two copies of the weights, say), the worker runs the check as before, in a fresh child,
and the record says so; only a child that failed before its handshake (a broken environment, which a fresh child
would meet too) ends the check."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.health import Handshake, Health
from worker.sandbox import Outcome, run_child

log = logging.getLogger("aotc.worker")

GO_NAME = "check-go.json"


class EarlyCheck:
    """The check child of one job, started before its package exists (in a thread of the worker's). `go` hands it
    the package and returns its outcome; `cancel` kills it where no package will come."""

    def __init__(self, health: Health, task: dict[str, Any], jobdir: Path, *, timeout_s: float,
                 on_stage: Callable[[str], None], should_cancel: Callable[[], bool],
                 pause: Callable[[], bool] | None = None, **child: Any) -> None:
        """`task`: the check's task without its package (model_path, spec, device, options, cpus); `child`: the
        sandbox's arguments (sandbox, device, limits, hide) as for any child."""
        self.health, self.jobdir, self.on_stage = health, jobdir, on_stage
        self.go_path = jobdir / GO_NAME
        self.task = {"kind": "check", **task, "go_path": str(self.go_path)}
        self._went, self._abort = threading.Event(), threading.Event()
        self.kwargs: dict[str, Any] = {**child, "timeout_s": timeout_s,
                                       "should_cancel": lambda: self._abort.is_set() or should_cancel()}
        self._pause = pause
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self.seen = False  # the child's handshake came
        self.took = False  # the child said "check": it read its word
        self.fell_back: str | None = None  # why the worker ran the check itself
        self.thread = threading.Thread(target=self._run, name="early-check", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        handshake = Handshake(self._stage)
        pause = self._pause
        try:
            self.outcome = run_child(self.task, self.jobdir, on_stage=handshake,
                                     waiting=lambda: not self._went.is_set(),
                                     pause=(lambda: not self._went.is_set() and pause()) if pause else None,
                                     **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the job's thread (go)
            self.error = e
        self.seen = handshake.seen

    def _stage(self, stage: str) -> None:
        if not self._went.is_set():  # the compile's stages are the job's until the word
            return
        self.took = self.took or stage == "check"
        self.on_stage(stage)

    def go(self, package_path: str, untimed: bool, cpus: list[int] | None) -> Outcome | None:
        """Give the child its package: `untimed` as a check beside others, on `cpus` (None: every core, a check that
        times itself). Returns its outcome, settled as `Health.run_child` settles one; None where the child ended
        before it took the word (`fell_back` says why): the caller runs the check itself."""
        if self.thread.is_alive():
            self._went.set()  # first: the stage the child writes on reading the word must be relayed
            tmp = self.go_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"package_path": package_path, "untimed": untimed, "cpus": cpus}))
            os.chmod(tmp, 0o644)
            tmp.rename(self.go_path)
        self.thread.join()
        if self.error is not None:
            raise self.error
        outcome = self.outcome
        assert outcome is not None
        if outcome.ok or self.took or outcome.cancelled or not self.seen:
            # Its check's outcome; or it failed before its handshake, which a fresh child would too (judged a
            # broken environment: the job goes back without spending an attempt).
            return self.health.settle(self.task, outcome, self.seen, self.jobdir, **self.kwargs)
        self.fell_back = (f"the early check ended before its package came: "
                          f"{outcome.failure.message if outcome.failure else 'no result'}")[:500]
        log.warning("%s; the check runs again, in a fresh child", self.fell_back)
        return None

    def cancel(self) -> None:
        """Kill the child (a no-op once it has ended) and wait for its thread."""
        self._abort.set()
        self.thread.join()
