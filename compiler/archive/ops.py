"""The node targets an uploaded program may call: a list of real operators, read without torch.

torch's deserializer resolves a node's target by a chain of getattr calls under `torch`, `_operator` or `math`,
so anything reachable that way would otherwise be accepted as "an operator". ops.txt (next to this module) lists
what a real exported program calls: every ATen and prims overload, the higher-order operators export emits,
and the Python callables of symbolic arithmetic. tests/compiler/archive/make_ops.py generates it from torch,
as a union over the torch versions the service runs.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

OPS_TXT = Path(__file__).with_name("ops.txt")


@lru_cache(maxsize=1)
def known_targets() -> frozenset[str]:
    return frozenset(line for line in OPS_TXT.read_text().splitlines() if line and not line.startswith("#"))


def is_operator_target(target: str) -> bool:
    return target in known_targets()
