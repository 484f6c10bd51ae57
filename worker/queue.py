"""The order in which a worker reads its queue streams (service.store.queues): interactive before batch, except
that a batch job waiting longer than AOTC_BATCH_MAX_WAIT_S goes first, so steady interactive work cannot starve
batch work forever."""

from __future__ import annotations

import time

from service.store import Lease, Store, keys


class Reader:
    """Reads the next job for one consumer (a worker) from the streams of the targets it serves."""

    def __init__(self, store: Store, targets: list[str], consumer: str, *, batch_max_wait_s: float,
                 poll_ms: int) -> None:
        self.store = store
        self.consumer = consumer
        # Most urgent first; within a priority, the worker's own target first (a v4 host's v4 queue before v3's).
        self.streams = [keys.queue(t, p) for p in keys.PRIORITIES for t in targets]
        self.batch_max_wait_s = batch_max_wait_s
        self.poll_ms = poll_ms

    def next(self) -> tuple[Lease, str] | None:
        """The next entry as (lease, job id), or None after poll_ms without one."""
        queues = self.store.queues
        got: list[tuple[Lease, str]] = []
        for stream in self.reading_order():  # a non-blocking look at each stream, in order
            got = queues.read(self.consumer, [stream])
            if got:
                break
        else:  # all empty: block on all of them at once
            got = queues.read(self.consumer, self.streams, block_ms=self.poll_ms)
        if not got:
            return None
        for lease, job_id in got[1:]:  # a multi-stream read can return one entry per stream: put the rest back
            self.store.jobs.requeue(job_id, lease, expect_state="queued")
        return got[0]

    def reading_order(self) -> list[str]:
        """Most urgent first, except that a job waiting in a less urgent stream for longer than batch_max_wait_s
        goes first (one at a time)."""
        order = list(self.streams)
        now_ms = time.time() * 1000
        for stream in self.streams[1:]:
            waiting = self.store.queues.oldest_waiting_ms(stream)
            if waiting is not None and now_ms - waiting > self.batch_max_wait_s * 1000:
                order.remove(stream)
                return [stream, *order]
        return order
