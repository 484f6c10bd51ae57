"""Cores kept for the timing pass (AOTC_TIMING_CPUS): a quiet device is not a quiet host.

The timing pass holds the device lock (worker.devlock), so no other job's check or timing runs on the GPU while it
times. But the other workers' compiles still run on the same cores, and eager at a serving batch is bound by the host
(one launch per op): on an H200 with 8 workers compiling on 16 cores, the workers' eager figures were within 10 % of
a quiet `do_bench` on only 6 of 20 artifacts (off by 0.56x to 3.46x), while the CUDA-graph figures, one launch a
call, were within 10 % on 19 (bench/README.md, "The farm on an H200").

So the host's cores are split: the timing child runs on a few cores of its own, and every other child (compiles,
untimed checks, the headers' warm-up) on the rest. Each child pins itself first thing (worker.child), so the threads
and processes it starts (OpenMP, Inductor's compile workers, g++) inherit its cores.

- `auto` (the default): on a CUDA device, where the worker has at least MIN_CPUS cores, the last KEEP physical
  cores are kept for timing, each with its SMT siblings (`thread_siblings_list` in sysfs): a timing thread whose
  sibling runs a compile gets half a core, and on a host whose siblings are numbered apart (cpu 6 and 14 one core)
  "the last two cores" would be two halves. Siblings outside the worker's own cores (another lane's) stay where
  they are. On a CPU device nothing is split (a CPU timing needs every core; compiles pause for it instead,
  AOTC_TIMING_PAUSE).
- a list (`14-15`, `3,7`): those cores, on any device.
- `off`: no split.

Every worker of a host computes the same split from the same affinity, so the timing cores of one are the timing
cores of all. It is not a security bound: a child can pin itself elsewhere (cgroup cpusets would enforce it); a
package that did would only disturb the figures, which the record's conditions show.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MIN_CPUS = 8
KEEP = 2


def parse(spec: str) -> set[int]:
    """A cpu list as taskset writes it: `0-3,8,10-11`. ValueError names what it cannot read."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"AOTC_TIMING_CPUS: {part!r} is not a core number or a range (e.g. 14-15)") from None
        if first < 0 or last < first:
            raise ValueError(f"AOTC_TIMING_CPUS: {part!r} is not a range of cores")
        out.update(range(first, last + 1))
    return out


@dataclass(frozen=True)
class CpuPlan:
    """The timing child's cores and every other child's (None: no split), and why."""

    timing: tuple[int, ...] | None
    others: tuple[int, ...] | None
    why: str

    def for_kind(self, kind: str, timed: bool = False) -> list[int] | None:
        """The cores a child of `kind` pins itself to: the timing pass's, or the others' (a compile, an untimed
        check, the warm-up). A check that times itself (`timed`: alone on its device, no timing pass follows) is
        not pinned: it times on a host no other worker compiles on, and its eager runs use every core."""
        if self.timing is None or self.others is None or kind == "probe" or (kind == "check" and timed):
            return None
        return list(self.timing if kind == "time" else self.others)

    def describe(self) -> dict[str, object]:
        return {"timing": list(self.timing) if self.timing else None,
                "others": list(self.others) if self.others else None, "why": self.why}


def host_siblings() -> dict[int, set[int]]:
    """Each core's SMT siblings, itself included, as sysfs lists them; a core sysfs says nothing of stands alone."""
    out: dict[int, set[int]] = {}
    for core in os.sched_getaffinity(0):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text()
            out[core] = parse(text.strip()) | {core}
        except (OSError, ValueError):
            out[core] = {core}
    return out


def _physical(cores: list[int], siblings: dict[int, set[int]]) -> list[list[int]]:
    """`cores` grouped by physical core (their siblings among `cores`), in the order of each group's first core."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in cores:
        key = tuple(sorted(siblings.get(c, {c}) & set(cores) | {c}))
        groups.setdefault(key, list(key))
    return sorted(groups.values(), key=lambda g: g[0])


def plan(setting: str, device: str, available: set[int] | None = None,
         siblings: dict[int, set[int]] | None = None) -> CpuPlan:
    """The split for a worker on `device` whose cores are `available` (its affinity), on a host whose SMT siblings
    are `siblings` (default: sysfs's). ValueError where an explicit list leaves no core for timing or none for the
    rest."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    setting = setting.strip().lower()
    if setting in ("off", "none", ""):
        return CpuPlan(None, None, "AOTC_TIMING_CPUS=off")
    if setting == "auto":
        if not device.startswith("cuda"):
            return CpuPlan(None, None, "auto: a CPU device times on every core")
        if len(cores) < MIN_CPUS:
            return CpuPlan(None, None, f"auto: {len(cores)} cores, fewer than {MIN_CPUS}")
        groups = _physical(cores, host_siblings() if siblings is None else siblings)
        timing = sorted(c for g in groups[-KEEP:] for c in g)
        others = [c for c in cores if c not in timing]
        if len(groups) <= KEEP or not others:
            return CpuPlan(None, None, f"auto: {len(groups)} physical cores, too few to keep {KEEP} for timing")
        paired = len(timing) > KEEP
        why = (f"auto: the last {KEEP} physical cores of {len(cores)} cores, with their SMT siblings ({_span(timing)})"
               if paired else f"auto: the last {KEEP} of {len(cores)} cores")
        return CpuPlan(tuple(timing), tuple(others), why)
    wanted = parse(setting)
    timing = sorted(wanted & set(cores))
    others = sorted(set(cores) - wanted)
    if not timing:
        raise ValueError(f"AOTC_TIMING_CPUS={setting}: none of those cores is this worker's ({_span(cores)})")
    if not others:
        raise ValueError(f"AOTC_TIMING_CPUS={setting}: that leaves no core of {_span(cores)} for compiles")
    return CpuPlan(tuple(timing), tuple(others), f"AOTC_TIMING_CPUS={setting}")


def _span(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores) if len(cores) <= 8 else f"{cores[0]}..{cores[-1]} ({len(cores)})"


def pin(cores: list[int] | None) -> list[int]:
    """Pin this process to `cores` (where given) and return the cores it runs on. A refusal (a kernel or sandbox
    that forbids it) leaves the affinity as it was: the figures are then taken as before, and the result says on
    which cores."""
    if cores:
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass
    return sorted(os.sched_getaffinity(0))


def repin(cores: list[int] | None, everywhere: list[int]) -> list[int]:
    """Pin every thread of this process to `cores`, or back to `everywhere` where None (`pin` pins the caller only,
    before any other thread starts): an early check (worker.earlycheck) starts on an untimed check's cores and learns
    only when its package comes whether it times itself, unpinned. The processes it started (the probes' zygotes)
    keep their cores. Returns the cores it runs on."""
    want = cores or everywhere
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), want)
        except (OSError, ValueError):
            pass
    return sorted(os.sched_getaffinity(0))
