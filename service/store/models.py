"""Model records: what an upload is (its inputs, size, name); its bytes are the blob `model:{id}`.

Two indexes: `models:index` orders ids by upload time (`recent`), and `models:ids` holds every id at score 0, so a
short id (the 12 digits the CLI prints) resolves with one lex range, ZRANGEBYLEX `[prefix` `[prefix\\xff`, in
O(log n) whatever the number of models, instead of a scan of the whole index.
"""

from __future__ import annotations

import json
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys

ID_LEN = 64  # a sha256 in hex


def lex_range(prefix: str) -> tuple[bytes, bytes]:
    """ZRANGEBYLEX bounds of the ids that start with `prefix` (ids are hex, so every one sorts below \\xff)."""
    start = b"[" + prefix.encode()
    return start, start + b"\xff"


class Models:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def put(self, record: dict[str, Any]) -> None:
        """Store a model's record; put its blob first, so a model is visible only once its bytes are stored."""
        pipe = self.r.pipeline()  # MULTI: the record and both indexes at once
        pipe.set(keys.model(record["id"]), canonical_json(record))
        pipe.zadd(keys.MODELS_INDEX, {record["id"]: record["created"]})
        pipe.zadd(keys.MODEL_IDS, {record["id"]: 0})
        pipe.execute()

    def get(self, model_id: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.model(model_id))
        return json.loads(raw) if raw else None

    def find(self, prefix: str, limit: int = 2) -> list[str]:
        """Model ids starting with `prefix` (at most `limit`), so people can use the short ids the CLI prints."""
        if len(prefix) == ID_LEN:
            return [prefix] if self.r.exists(keys.model(prefix)) else []
        start, stop = lex_range(prefix)
        return cast(list[str], self.r.zrangebylex(keys.MODEL_IDS, start, stop, start=0, num=limit))

    def backfill_ids(self, batch: int = 1000) -> int:
        """Index the ids of models stored before `models:ids` existed; returns how many were added. Cheap when
        there is nothing to do (two ZCARDs), idempotent, and safe beside other API processes doing the same."""
        if self.r.zcard(keys.MODEL_IDS) >= self.r.zcard(keys.MODELS_INDEX):
            return 0
        added = 0
        ids: list[str] = []
        for member, _ in self.r.zscan_iter(keys.MODELS_INDEX, count=batch):
            ids.append(member)
            if len(ids) >= batch:
                added += cast(int, self.r.zadd(keys.MODEL_IDS, dict.fromkeys(ids, 0)))
                ids = []
        if ids:
            added += cast(int, self.r.zadd(keys.MODEL_IDS, dict.fromkeys(ids, 0)))
        return added

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest uploads first."""
        ids = cast(list[str], self.r.zrevrange(keys.MODELS_INDEX, 0, limit - 1))
        return [m for m in (self.get(i) for i in ids) if m]
