"""Targets: what a request asks for ('cpu', 'cuda', 'cuda-sm90') and which concrete target serves it.

A concrete target names the device kind and what its generated code depends on: the CUDA arch for GPUs
(cuda-sm90), the machine and vector ISA for CPUs (cpu-x86_64-avx512). Each has its own queue stream.
"""

from __future__ import annotations

import re
from typing import Any

from compiler.errors import Unprocessable

_TARGET_RE = re.compile(r"^(cpu|cuda)(-[a-z0-9_]+(?:-[a-z0-9_]+)*)?$")


def validate(target: str) -> str:
    target = target.strip().lower()
    if not _TARGET_RE.match(target):
        raise Unprocessable(
            f"unknown target {target!r}: use 'cpu', 'cuda', or a concrete target such as 'cuda-sm90' or 'cpu-x86_64-avx512'"
        )
    return target


def matches(requested: str, concrete: str) -> bool:
    """'cpu' matches any cpu-* target; a concrete target matches only itself."""
    return concrete == requested or concrete.startswith(requested + "-") and requested in ("cpu", "cuda")


def pick_worker(requested: str, workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The live worker whose target and toolchain a request is keyed for, or None.

    Among several matching targets the one with the most live workers wins (ties: the name sorts first), and
    within it the newest worker's toolchain, so a rolling upgrade moves new keys to the new toolchain.
    """
    live = [w for w in workers if matches(requested, w["target"])]
    if not live:
        return None
    counts: dict[str, int] = {}
    for w in live:
        counts[w["target"]] = counts.get(w["target"], 0) + 1
    best = sorted(counts, key=lambda t: (-counts[t], t))[0]
    return max((w for w in live if w["target"] == best), key=lambda w: w.get("started", 0))
