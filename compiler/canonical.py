"""The one JSON spelling aotc hashes, signs and stores: sorted keys, no spaces.

A module of its own so that what verifies a signature (`client.verify`, through `compiler.signing`) does not import
the compile options' pydantic models with `compiler.cachekey`: about 95 ms of a serving process's start on the
2-core box (`python -X importtime -c "import client"`), inside its time to first inference."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    """The one JSON spelling aotc hashes and stores: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
