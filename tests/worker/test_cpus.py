"""Cores kept for the timing pass (worker/cpus.py, AOTC_TIMING_CPUS): the split a worker plans, and a real child in
the real sandbox (bwrap, seccomp) pinning itself to the cores its task names, and saying so in its result."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from worker import cpus
from worker.isolation import setup
from worker.sandbox import run_child
from worker.settings import WorkerSettings

SIXTEEN = set(range(16))
NO_SMT: dict[int, set[int]] = {}  # every core its own physical core


def test_auto_keeps_whole_physical_cores_for_timing_where_the_host_has_smt_siblings():
    # Siblings numbered apart (cpu n and n+8 one physical core, as many x86 hosts number them): the last two cores,
    # 14 and 15, are halves of the cores 6 and 7 would share with compiles; all four go to the timing.
    apart = {c: {c % 8, c % 8 + 8} for c in SIXTEEN}
    plan = cpus.plan("auto", "cuda:0", SIXTEEN, apart)
    assert plan.timing == (6, 7, 14, 15) and plan.others == (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)
    assert "SMT siblings (6,7,14,15)" in plan.why
    # Siblings side by side (2n and 2n+1): the last two physical cores are 12-15.
    plan = cpus.plan("auto", "cuda:0", SIXTEEN, {c: {c - c % 2, c - c % 2 + 1} for c in SIXTEEN})
    assert plan.timing == (12, 13, 14, 15) and len(plan.others) == 12
    # A lane's worker (taskset 8-15 of the first host): siblings outside its cores stay the other lane's.
    plan = cpus.plan("auto", "cuda:1", set(range(8, 16)), apart)
    assert plan.timing == (14, 15) and plan.others == tuple(range(8, 14))
    # Eight logical cores that are four physical ones: two kept for timing leave two for the compiles.
    four = {c: {c % 4, c % 4 + 4} for c in range(8)}
    assert cpus.plan("auto", "cuda:0", set(range(8)), four).timing == (2, 3, 6, 7)
    # This host's own siblings, read from sysfs, cover every core this process may run on.
    assert set(cpus.host_siblings()) == os.sched_getaffinity(0)


def test_auto_keeps_the_last_two_cores_for_timing_on_a_gpu_host_and_splits_nothing_else():
    plan = cpus.plan("auto", "cuda:0", SIXTEEN, NO_SMT)
    assert plan.timing == (14, 15) and plan.others == tuple(range(14))
    assert plan.for_kind("time") == [14, 15] and plan.for_kind("compile") == list(range(14))
    assert plan.for_kind("check") == list(range(14)) and plan.for_kind("warmup") == list(range(14))
    # A check that times itself (alone on its device) keeps every core; the health probe is never pinned.
    assert plan.for_kind("check", timed=True) is None and plan.for_kind("probe") is None
    # A lane's worker (taskset 16-31) keeps the last two of its own cores.
    assert cpus.plan("auto", "cuda:1", set(range(16, 32)), NO_SMT).timing == (30, 31)
    for device, cores, why in (("cpu", SIXTEEN, "CPU device"), ("cuda:0", set(range(4)), "fewer than 8")):
        plan = cpus.plan("auto", device, cores, NO_SMT)
        assert plan.timing is None and plan.for_kind("time") is None and plan.for_kind("compile") is None
        assert why in plan.why
    assert cpus.plan("off", "cuda:0", SIXTEEN).for_kind("time") is None


def test_an_explicit_list_applies_on_any_device_and_a_list_that_cannot_work_is_refused_by_name():
    plan = cpus.plan("3,7-8", "cpu", SIXTEEN)
    assert plan.timing == (3, 7, 8) and 3 not in plan.others and len(plan.others) == 13
    with pytest.raises(ValueError, match="none of those cores is this worker's"):
        cpus.plan("40-41", "cuda:0", SIXTEEN)
    with pytest.raises(ValueError, match="leaves no core"):
        cpus.plan("0-15", "cuda:0", SIXTEEN)
    with pytest.raises(ValueError, match="'x' is not a core number"):
        cpus.plan("1,x", "cuda:0", SIXTEEN)
    with pytest.raises(ValueError, match="'5-2' is not a range"):
        cpus.parse("5-2")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin a child to one")
def test_a_sandboxed_child_pins_itself_to_its_tasks_cores_and_reports_them(tmp_path: Path):
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("needs root and bubblewrap for the sandbox the worker runs children in")
    sandbox = setup(WorkerSettings(work_dir=tmp_path / "work", data_dir=tmp_path / "data"), "cpu")
    mine = sorted(os.sched_getaffinity(0))
    for want in ([mine[-1]], [mine[0]]):
        out = run_child({"kind": "probe", "device": "cpu", "cpus": want}, tmp_path / f"job-{want[0]}",
                        sandbox=sandbox, timeout_s=120)
        assert out.ok and out.cpus == want, (out.failure, out.cpus)
    out = run_child({"kind": "probe", "device": "cpu"}, tmp_path / "job-all", sandbox=sandbox, timeout_s=120)
    assert out.ok and out.cpus == mine  # no cores named: the worker's own
