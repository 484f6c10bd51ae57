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
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from compiler.options import BOUNDS_REVISION, FORCED_INDUCTOR_CONFIGS, WEIGHTS_REVISION, weights_layout

# bump when what a key covers changes (2: options gained precision, freezing, inductor, prims_view; 3: bounds;
# 4: weights)
KEY_FORMAT = 4
FIRST_BOUNDED_FORMAT = 3


def bounds_factor() -> dict[str, Any]:
    """The bounds every compile applies, as they enter the key."""
    return {"inductor": dict(FORCED_INDUCTOR_CONFIGS), "revision": BOUNDS_REVISION}


def factors(
    model_id: str, spec: list[dict[str, Any]], target: str, toolchain: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    return {
        "format": KEY_FORMAT,
        "model": model_id,
        "spec": spec,
        "target": target,
        "toolchain": toolchain,
        "options": options,
        "bounds": bounds_factor(),
        "weights": {"layout": weights_layout(options), "revision": WEIGHTS_REVISION},
    }


def bounded(f: dict[str, Any]) -> bool:
    """Whether the artifact these factors describe was built with today's bounds (forced index asserts and the
    rewrites), so it may be served to a caller who did not name its key."""
    fmt = f.get("format")
    return isinstance(fmt, int) and fmt >= FIRST_BOUNDED_FORMAT and f.get("bounds") == bounds_factor()


def canonical_json(value: Any) -> str:
    """The one JSON spelling aotc hashes and stores: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def cache_key(f: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(f).encode()).hexdigest()[:32]
