"""The tmpfs probe of worker.scratch, with real mounts: workers started together share a work dir."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from worker import scratch


def _probe_rounds(probe_dir: str, start: object, results: object, rounds: int) -> None:
    start.wait()  # type: ignore[attr-defined]
    out: list[str | None] = []
    for _ in range(rounds):
        try:
            out.append(scratch.can_mount(Path(probe_dir)))
        except OSError as e:  # what the shared mount point raised (EBUSY from rmdir)
            out.append(f"raised {e}")
    results.put(out)  # type: ignore[attr-defined]


def test_workers_that_probe_the_same_work_dir_at_once_all_can_mount(tmp_path):
    if (why := scratch.can_mount(tmp_path)) is not None:
        pytest.skip(f"this process cannot mount a tmpfs: {why}")
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_probe_rounds, args=(str(tmp_path), start, results, 20)) for _ in range(6)]
    for p in procs:
        p.start()
    got = [r for _ in procs for r in results.get(timeout=120)]
    for p in procs:
        p.join(30)
    assert got == [None] * 120
    assert list(tmp_path.iterdir()) == []  # every probe's mount point is gone
    assert not any(point.startswith(str(tmp_path)) for point, _ in scratch._mounts())
