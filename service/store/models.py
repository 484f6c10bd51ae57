"""Model records: what an upload is (its inputs, size, name); its bytes are the blob `model:{id}`."""

from __future__ import annotations

import json
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys


class Models:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def put(self, record: dict[str, Any]) -> None:
        """Store a model's record; put its blob first, so a model is visible only once its bytes are stored."""
        self.r.set(keys.model(record["id"]), canonical_json(record))
        self.r.zadd(keys.MODELS_INDEX, {record["id"]: record["created"]})

    def get(self, model_id: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.model(model_id))
        return json.loads(raw) if raw else None

    def find(self, prefix: str, limit: int = 2) -> list[str]:
        """Model ids starting with `prefix` (at most `limit`), so people can use the short ids the CLI prints."""
        if len(prefix) == 64:
            return [prefix] if self.r.exists(keys.model(prefix)) else []
        found: list[str] = []
        for member, _ in self.r.zscan_iter(keys.MODELS_INDEX, match=f"{prefix}*"):
            found.append(member)
            if len(found) >= limit:
                break
        return found

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest uploads first."""
        ids = cast(list[str], self.r.zrevrange(keys.MODELS_INDEX, 0, limit - 1))
        return [m for m in (self.get(i) for i in ids) if m]
