"""Cache keys: one hash over every factor that changes the generated code.

A factor left out of the key is the classic bug (the wrong artifact loads and crashes), so the factors are
stored beside each artifact and anyone can see why two keys differ.

Format 3 added the `bounds` factor: what every compile does to bound its memory accesses, whatever the request
asked (Inductor's index asserts, forced on; compiler.bounds's rewrites of ops that skip bounds checks; the
error-code check on ATen fallbacks). Artifacts of formats 1 and 2 were built without any of it. A request never
computes their keys again, so it compiles anew, and `bounded` tells deploy-time lookup not to serve them; they stay
readable by their key, as published, with their factors saying what they are.

Format 4 added the `weights` factor: whether the package carries its weights or binds the model's weights blob at
load (compiler/weights.py), which changes the generated code. Artifacts of format 3 carry their weights; they stay
bounded, and lookup serves both kinds alike.

A CPU target that names an x86-64 level (cpu-x86_64-v3) adds the `isa` factor: the level, its `-march` and the
vector ISA the compile pins (compiler.targets.IsaPin), with the pin's revision. It came without a format of its own:
keys of GPU targets did not change, and no CPU key of before can be computed again, since those named ATen's capability
(cpu-x86_64-avx512), which a request now reads as its level. Those packages were built with -march=native, so
`pinned` tells deploy-time lookup not to serve them; their key still reaches them.
"""

from __future__ import annotations

import hashlib
from typing import Any

from compiler.canonical import canonical_json
from compiler.errors import AotcError
from compiler.options import (
    BOUNDS_REVISION,
    FORCED_INDUCTOR_CONFIGS,
    TRAINING_INDUCTOR_CONFIGS,
    WEIGHTS_REVISION,
    weights_layout,
)
from compiler.targets import IsaPin, Target

# bump when what a key covers changes (2: options gained precision, freezing, inductor, prims_view; 3: bounds;
# 4: weights)
KEY_FORMAT = 4
FIRST_BOUNDED_FORMAT = 3


def bounds_factor() -> dict[str, Any]:
    """The bounds every compile applies, as they enter the key."""
    return {"inductor": dict(FORCED_INDUCTOR_CONFIGS), "revision": BOUNDS_REVISION}


def _pin(target: str) -> IsaPin | None:
    """The pin of a target spelled as its level (cpu-x86_64-v3); None for anything else, an alias included: keys
    of the old labels stay what they were."""
    try:
        parsed = Target.parse(target)
    except AotcError:
        return None
    return parsed.pin if str(parsed) == target else None


def factors(
    model_id: str, spec: list[dict[str, Any]], target: str, toolchain: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    out = {
        "format": KEY_FORMAT,
        "model": model_id,
        "spec": spec,
        "target": target,
        "toolchain": toolchain,
        "options": options,
        "bounds": bounds_factor(),
        "weights": {"layout": weights_layout(options), "revision": WEIGHTS_REVISION},
    }
    if options.get("mode") == "training":  # how train steps are built (inference keys are unchanged)
        out["training"] = {"inductor": dict(TRAINING_INDUCTOR_CONFIGS)}
    pin = _pin(target)
    if pin is not None:
        out["isa"] = pin.factor()
    return out


def pinned(f: dict[str, Any]) -> bool:
    """Whether the artifact these factors describe keeps to the x86-64 level its target names, pinned as today's
    compiles pin it, so it may be served to a caller who did not name its key. True for targets that name no level
    (GPUs, other machines); False for the old labels' -march=native packages."""
    target = f.get("target")
    if not isinstance(target, str):
        return False
    try:
        wanted = Target.parse(target).pin
    except AotcError:
        return False
    return wanted is None or (str(Target.parse(target)) == target and f.get("isa") == wanted.factor())


def bounded(f: dict[str, Any]) -> bool:
    """Whether the artifact these factors describe was built with today's bounds (forced index asserts and the
    rewrites), so it may be served to a caller who did not name its key."""
    fmt = f.get("format")
    return isinstance(fmt, int) and fmt >= FIRST_BOUNDED_FORMAT and f.get("bounds") == bounds_factor()


def cache_key(f: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(f).encode()).hexdigest()[:32]
