"""A job's stage timeline, from its event stream (`job:{id}:events`, what GET /v1/jobs/{id}/events replays).

Each event opens a step that lasts until the next one: waits in the queue, each stage of each attempt, and the
end. An attempt starts where a worker claims the job (`running`/`fetch` with `attempt`); a `queued` event after
one is a retry (its `reason` is why, and `not_before` its backoff).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from service.store.jobs import TERMINAL


@dataclass
class Step:
    stage: str
    start: float
    end: float | None  # None: still going
    kind: str  # "wait", "stage" or "end"

    def seconds(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)


@dataclass
class Attempt:
    number: int  # 0: a wait in line (before the first claim, or after a retry)
    label: str = "queued"
    worker: str = ""
    steps: list[Step] = field(default_factory=list)
    outcome: str = "running"  # running, retried, or the job's final state
    reason: str = ""  # why it was retried or how it ended
    not_before: float | None = None


@dataclass
class Timeline:
    attempts: list[Attempt]
    start: float
    end: float | None
    state: str

    def span(self, now: float | None = None) -> float:
        return max(1e-3, (self.end if self.end is not None else (now or time.time())) - self.start)


def build(events: list[tuple[str, dict[str, str]]], job: dict[str, Any]) -> Timeline:
    """The timeline of one job from its events (oldest first) and its record (for when events were trimmed)."""
    attempts = [Attempt(0)]
    open_step: Step | None = None
    start = float(job.get("created") or 0.0)
    state = str(job.get("state") or "queued")
    end: float | None = None
    for _, ev in events:
        ts = float(ev.get("ts") or 0.0)
        if not start:
            start = ts
        if open_step is not None:
            open_step.end = ts
        st, stage = ev.get("state", ""), ev.get("stage", "")
        current = attempts[-1]
        if st == "running" and ev.get("attempt"):
            n, worker = int(ev["attempt"]), ev.get("worker", "")
            current = Attempt(n, f"attempt {n}" + (f" on {worker}" if worker else ""), worker)
            attempts.append(current)
        elif st == "queued" and current.number > 0:  # a running attempt went back in line: a retry
            current.outcome, current.reason = "retried", ev.get("reason", "")
            if ev.get("not_before"):
                current.not_before = float(ev["not_before"])
            current = Attempt(0, f"back in line after attempt {current.number}", outcome="waiting")
            attempts.append(current)
        if st in TERMINAL:
            current.outcome, current.reason = st, ev.get("reason", "")
            current.steps.append(Step(st, ts, ts, "end"))
            open_step, end = None, ts
            continue
        open_step = Step(stage or st, ts, None, "wait" if st == "queued" else "stage")
        current.steps.append(open_step)
    if state in TERMINAL and end is None:  # trimmed or missing events: close with the record's own times
        end = float(job.get("finished") or start)
        if open_step is not None:
            open_step.end = end
    kept = [a for a in attempts if a.steps]
    return Timeline(kept, start or time.time(), end, state)
