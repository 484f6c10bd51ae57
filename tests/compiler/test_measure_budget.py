"""compiler.check.measure keeps its wall-clock budget on a CPU when calls turn slower than its estimate said (a
CPU shared with other processes: OpenMP threads waiting their turn). Pure timing logic: no compile."""

from __future__ import annotations

import time

from compiler.check import measure


def test_calls_that_slow_down_after_the_estimate_stay_within_the_budget() -> None:
    calls = [0]

    def fn() -> None:  # fast for the estimate's calls, then 20 ms each: 2,000 planned reps would take 80 s
        calls[0] += 1
        if calls[0] > 7:
            time.sleep(0.02)

    t0 = time.perf_counter()
    got = measure(fn, "cpu", budget_s=1.0)
    took = time.perf_counter() - t0
    assert took < 5.0, (took, got)
    assert got["reps"] >= 3 and got["median_ms"] >= 20.0, got
    assert got["reps"] < 2000, got  # stopped by the budget, not by the planned count
