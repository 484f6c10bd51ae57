"""Targets: what a request asks for ('cpu', 'cuda', 'cpu-x86_64-v3') and which concrete target serves it.

A concrete target names the device kind and what its generated code depends on: the CUDA arch for GPUs
(cuda-sm90); for x86-64 CPUs, the psABI micro-architecture level the package keeps to:

    cpu-x86_64-v1   the x86-64 baseline (SSE2)
    cpu-x86_64-v2   + SSE3, SSSE3, SSE4.1, SSE4.2, POPCNT, CMPXCHG16B, LAHF/SAHF
    cpu-x86_64-v3   + AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE, XSAVE
    cpu-x86_64-v4   + AVX-512 F, BW, CD, DQ, VL

A package of one level runs on every host of that level or above: the compile pins `-march=x86-64-vN` and
Inductor's vector ISA to the level (compiler.compat.isa), and compiler.isa checks the built package against it.
The old labels were ATen's CPU capability, and a package built under them used `-march=native`; they stay
accepted as aliases of the level that capability requires (`ALIASES`). Other machines (aarch64, ...) keep ATen's
capability as their label and are not pinned.

Each concrete target has its own queue streams; a CPU worker serves every level at or below its host's
(`served_targets`). This module is the one parser of target names; the API, the worker and the client all use
it. Torch-free: `detect_cpu_target` reads /proc/cpuinfo, so the SDK can ask what this machine is without torch.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from compiler.errors import Unprocessable

_TARGET_RE = re.compile(r"^(cpu|cuda)(-[a-z0-9_]+(?:-[a-z0-9_]+)*)?$")

X86 = "x86_64"
# The psABI levels in order (each includes the last), and the /proc/cpuinfo flags each adds: Linux shows a flag
# only when the CPU has it and the kernel enabled it (AVX needs the OS's XSAVE support), so a flag here is usable.
LEVELS = ("v1", "v2", "v3", "v4")
LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "v1": ("lm", "cmov", "cx8", "fpu", "fxsr", "mmx", "syscall", "sse", "sse2"),
    "v2": ("cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"),
    "v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
    "v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
}
# ATen's capability names, as the old targets used them, and the level that capability needs. ATen's AVX2 kernels
# need AVX2 and FMA, and every CPU with both also has the rest of v3; its AVX512 kernels need AVX-512 F, BW, DQ and
# VL, and every CPU with those has CD too: so `avx2` is v3 and `avx512` is v4. `default` is ATen's code for any
# x86-64, built with no -m flags: the baseline, v1.
ALIASES = {"default": "v1", "avx2": "v3", "avx512": "v4"}
_LEVEL_RE = re.compile(r"^v[0-9]+$")


@dataclass(frozen=True)
class IsaPin:
    """What a compile for one x86-64 level pins: gcc's `-march`, and the vector ISA Inductor generates code for
    (None: scalar C++, which gcc may still vectorise within the level). `simdlen` is Inductor's name for the
    vector width. `allowed_m` are the `-m` ISA flags a package of this level may have been built with."""

    level: str
    march: str
    vec_isa: Literal["avx2", "avx512"] | None
    simdlen: int | None
    allowed_m: frozenset[str]

    def factor(self) -> dict[str, Any]:
        """How it enters the cache key (compiler.cachekey): a change to the pin rebuilds rather than serves."""
        return {"level": self.level, "march": self.march, "vec_isa": self.vec_isa, "revision": PIN_REVISION}


# Bump when what a pin does changes (another -march spelling, another vector ISA): it is in every CPU cache key.
PIN_REVISION = 1
_M_V1 = frozenset({"sse", "sse2", "mmx", "fxsr", "cx8", "cmov"})
_M_V2 = _M_V1 | {"sse3", "ssse3", "sse4.1", "sse4.2", "sse4", "popcnt", "cx16", "sahf"}
_M_V3 = _M_V2 | {"avx", "avx2", "bmi", "bmi2", "f16c", "fma", "lzcnt", "movbe", "xsave"}
_M_V4 = _M_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
PINS = {
    "v1": IsaPin("v1", "x86-64", None, None, _M_V1),
    "v2": IsaPin("v2", "x86-64-v2", None, None, _M_V2),
    "v3": IsaPin("v3", "x86-64-v3", "avx2", 256, _M_V3),
    "v4": IsaPin("v4", "x86-64-v4", "avx512", 512, _M_V4),
}


@dataclass(frozen=True)
class Target:
    """A parsed target: its kind ('cpu' or 'cuda') and the parts after it ('sm90'; 'x86_64', 'v3')."""

    kind: Literal["cpu", "cuda"]
    parts: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse a target name; an old x86-64 label (`ALIASES`) becomes its level, so `cpu-x86_64-avx512` and
        `cpu-x86_64-v4` are one target."""
        name = text.strip().lower()
        m = _TARGET_RE.match(name)
        if not m:
            raise Unprocessable(
                f"unknown target {name!r}: use 'cpu', 'cuda', or a concrete target such as 'cuda-sm90' or "
                "'cpu-x86_64-v3'"
            )
        kind: Literal["cpu", "cuda"] = "cpu" if m.group(1) == "cpu" else "cuda"
        parts = tuple(m.group(2)[1:].split("-")) if m.group(2) else ()
        if kind == "cpu" and len(parts) == 2 and parts[0] == X86:
            isa = ALIASES.get(parts[1], parts[1])
            if _LEVEL_RE.match(isa) and isa not in LEVELS:
                raise Unprocessable(f"unknown x86-64 level {parts[1]!r} in target {name!r}: the levels are "
                                    f"{', '.join(LEVELS)} (aliases: {_alias_text()})")
            parts = (X86, isa)
        return cls(kind, parts)

    def __str__(self) -> str:
        return "-".join((self.kind, *self.parts))

    @property
    def concrete(self) -> bool:
        return bool(self.parts)

    @property
    def arch(self) -> str | None:
        """'sm90' for cuda-sm90; None for CPUs and for 'cuda'."""
        return self.parts[0] if self.kind == "cuda" and self.parts else None

    @property
    def isa(self) -> str | None:
        """'v3' for cpu-x86_64-v3, 'sve256' for cpu-aarch64-sve256; None for GPUs and for 'cpu'."""
        return self.parts[-1] if self.kind == "cpu" and len(self.parts) >= 2 else None

    @property
    def level(self) -> str | None:
        """The x86-64 psABI level ('v3') this target names, or None (GPUs, 'cpu', other machines)."""
        isa = self.isa
        return isa if self.kind == "cpu" and self.parts[0] == X86 and isa in LEVELS else None

    @property
    def pin(self) -> IsaPin | None:
        """What a compile for this target pins, or None when it names no x86-64 level."""
        level = self.level
        return PINS[level] if level else None

    def matches(self, concrete: Target | str) -> bool:
        """A request for 'cpu' or 'cuda' matches any target of that kind; a concrete request only itself."""
        other = concrete if isinstance(concrete, Target) else Target.parse(concrete)
        return other == self or (not self.concrete and other.kind == self.kind)

    def cannot_run_on(self, host: Target) -> str | None:
        """Why code built for this target cannot run on `host` (this machine's concrete target), or None if it
        can: another device kind, another GPU arch, another CPU machine, or an x86-64 level above the host's. A
        package of a lower level runs on a higher one (v3 on a v4 host)."""
        if host.kind != self.kind:
            return f"it was built for {self}; load it on a {'CUDA device' if self.kind == 'cuda' else 'CPU'}"
        if self.kind == "cuda":
            if self.arch and host.arch and self.arch != host.arch:
                return f"it was built for {self}; this GPU is {host}"
            return None
        if len(self.parts) >= 2 and len(host.parts) >= 2 and self.parts[:-1] != host.parts[:-1]:
            return f"it was built for {self}; this machine is {host}"
        want, have = self.isa, host.isa
        if want and have and want != have:
            if want not in LEVELS or have not in LEVELS or LEVELS.index(want) > LEVELS.index(have):
                return f"it was built for {self}; this machine's CPU is {host}"
        return None


def _alias_text() -> str:
    return ", ".join(f"{old} = {new}" for old, new in ALIASES.items())


# -- this machine ------------------------------------------------------------------------------------------------

def cpu_level(flags: Iterable[str]) -> str | None:
    """The highest psABI level whose flags (and every lower level's) are all in `flags` (/proc/cpuinfo's names);
    None when even the baseline's are missing."""
    have = set(flags)
    level = None
    for name in LEVELS:
        if not set(LEVEL_FLAGS[name]) <= have:
            break
        level = name
    return level


def cpuinfo_flags(text: str) -> set[str]:
    """The flags of the first processor in a /proc/cpuinfo text. Linux shows the flags every CPU of the machine
    shares, so the first says what all of them can do."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def detect_cpu_target(cpuinfo: str | None = None, machine: str | None = None) -> str:
    """This machine's concrete CPU target: 'cpu-x86_64-v4' on an AVX-512 host, 'cpu-x86_64-v3' on an AVX2 one.

    Torch-free (the SDK's "no target given" detection uses it): /proc/cpuinfo's flags under the psABI's rules. Not
    x86-64, or no /proc/cpuinfo: 'cpu-<machine>' (unpinned; compiler.device adds ATen's capability on workers).
    `cpuinfo` and `machine` are for tests."""
    arch = (machine or platform.machine()).lower()
    if arch in ("amd64", "x64"):
        arch = X86
    if arch != X86:
        return f"cpu-{arch or 'unknown'}"
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return f"cpu-{X86}-v1"  # no /proc (not Linux): every x86-64 runs the baseline
    return f"cpu-{X86}-{cpu_level(cpuinfo_flags(cpuinfo)) or 'v1'}"


def served_targets(host: str, asked: Iterable[str] = ()) -> list[str]:
    """The targets a worker on `host` serves, its own first: for an x86-64 level, every level at or below it
    (a v4 host builds and checks v4, v3, v2 and v1 packages); otherwise just `host`. `asked` (AOTC_WORKER_TARGETS)
    narrows that to the targets named, aliases allowed; one above the host is an error (ValueError)."""
    own = Target.parse(host)
    level = own.level
    every = [str(own)] if level is None else [f"cpu-{X86}-{v}" for v in reversed(LEVELS[: LEVELS.index(level) + 1])]
    names = [str(Target.parse(a)) for a in asked if a.strip()]
    if not names:
        return every
    above = [n for n in names if n not in every]
    if above:
        raise ValueError(f"AOTC_WORKER_TARGETS names {', '.join(above)}, which this machine ({host}) cannot serve: "
                         f"it serves {', '.join(every)}")
    return [t for t in every if t in names]


def worker_targets(worker: dict[str, Any]) -> list[str]:
    """The targets a worker's registry record says it serves (workers before levels served only `target`)."""
    targets = worker.get("targets")
    if isinstance(targets, list) and targets:
        return [str(t) for t in targets]
    return [str(worker["target"])]


def pick_worker(requested: Target, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live worker whose target and toolchain a request is keyed for, or None. The answer is the worker's
    record with `target` set to the concrete target the request gets, which may be one of the lower levels it
    serves rather than its own.

    A concrete request goes to the workers that serve it. For 'cpu' or 'cuda', the own target of the most live
    workers wins (ties: the name sorts first): a plain 'cpu' builds for the machines the farm has. Within the
    chosen target, the newest worker's toolchain wins, so a rolling upgrade moves new keys to the new toolchain.
    """
    if requested.concrete:
        live = [w for w in workers if str(requested) in worker_targets(w)]
        if not live:
            return None
        best = str(requested)
    else:
        live = [w for w in workers if requested.matches(w["target"])]
        if not live:
            return None
        counts: dict[str, int] = {}
        for w in live:
            counts[w["target"]] = counts.get(w["target"], 0) + 1
        best = sorted(counts, key=lambda t: (-counts[t], t))[0]
        live = [w for w in live if w["target"] == best]
    newest: dict[str, Any] = max(live, key=lambda w: float(w.get("started", 0)))
    return {**newest, "target": best}
