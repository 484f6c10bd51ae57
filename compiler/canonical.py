"""The one JSON spelling aotc hashes, signs and stores: sorted keys, no spaces.

A module of its own so that what verifies a signature (`client.verify`, through `compiler.signing`) does not import
the compile options' pydantic models with `compiler.cachekey`: `from client.sdk import Client` took 296 ms with them
and 193 ms without on the 2-core box (bench/client_import.py), time inside every server's time to first inference."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    """The one JSON spelling aotc hashes and stores: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
