"""Targets: what a request asks for ('cpu', 'cuda', 'cuda-sm90') and which concrete target serves it.

A concrete target names the device kind and what its generated code depends on: the CUDA arch for GPUs
(cuda-sm90), the machine and vector ISA for CPUs (cpu-x86_64-avx512). Each has its own queue stream. This module
is the one parser of target names; the API, the worker and the client all use it. Torch-free: what this machine
is comes from compiler.device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from compiler.errors import Unprocessable

_TARGET_RE = re.compile(r"^(cpu|cuda)(-[a-z0-9_]+(?:-[a-z0-9_]+)*)?$")
# x86-64 vector ISAs in the order each includes the last: code built for one runs on any later one.
_X86_ISAS = ("default", "avx2", "avx512")


@dataclass(frozen=True)
class Target:
    """A parsed target: its kind ('cpu' or 'cuda') and the parts after it ('sm90'; 'x86_64', 'avx512')."""

    kind: Literal["cpu", "cuda"]
    parts: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Target:
        name = text.strip().lower()
        m = _TARGET_RE.match(name)
        if not m:
            raise Unprocessable(
                f"unknown target {name!r}: use 'cpu', 'cuda', or a concrete target such as 'cuda-sm90' or "
                "'cpu-x86_64-avx512'"
            )
        kind: Literal["cpu", "cuda"] = "cpu" if m.group(1) == "cpu" else "cuda"
        return cls(kind, tuple(m.group(2)[1:].split("-")) if m.group(2) else ())

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
        """'avx512' for cpu-x86_64-avx512; None for GPUs and for 'cpu'."""
        return self.parts[-1] if self.kind == "cpu" and len(self.parts) >= 2 else None

    def matches(self, concrete: Target | str) -> bool:
        """A request for 'cpu' or 'cuda' matches any target of that kind; a concrete request only itself."""
        other = concrete if isinstance(concrete, Target) else Target.parse(concrete)
        return other == self or (not self.concrete and other.kind == self.kind)

    def cannot_run_on(self, host: Target) -> str | None:
        """Why code built for this target cannot run on `host` (this machine's concrete target), or None if it
        can: another device kind, another GPU arch, another CPU machine, or a vector ISA the host lacks."""
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
            if want not in _X86_ISAS or have not in _X86_ISAS or _X86_ISAS.index(want) > _X86_ISAS.index(have):
                return f"it was built for {self}; this machine's CPU supports {have}"
        return None


def pick_worker(requested: Target, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live worker whose target and toolchain a request is keyed for, or None.

    Among several matching targets the one with the most live workers wins (ties: the name sorts first), and
    within it the newest worker's toolchain, so a rolling upgrade moves new keys to the new toolchain.
    """
    live = [w for w in workers if requested.matches(w["target"])]
    if not live:
        return None
    counts: dict[str, int] = {}
    for w in live:
        counts[w["target"]] = counts.get(w["target"], 0) + 1
    best = sorted(counts, key=lambda t: (-counts[t], t))[0]
    return max((w for w in live if w["target"] == best), key=lambda w: w.get("started", 0))
