"""Cache keys: one hash over every factor that changes the generated code.

A factor left out of the key is the classic bug (the wrong artifact loads and crashes), so the factors are
stored beside each artifact and anyone can see why two keys differ.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

KEY_FORMAT = 2  # bump when what a key covers changes (2: options gained precision, freezing, inductor, prims_view)


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
    }


def canonical_json(value: Any) -> str:
    """The one JSON spelling aotc hashes and stores: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def cache_key(f: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(f).encode()).hexdigest()[:32]
