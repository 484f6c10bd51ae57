"""Artifacts: published compile results. A record (JSON) per cache key, its package, stage report and sources.

Publishing writes the blobs and the report first and the record last, so a reader never sees a record without
its bytes, and it is idempotent: a job delivered twice finds its own result.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys
from service.store.blobs import Blobs


class Artifacts:
    def __init__(self, r: redis.Redis, blobs: Blobs) -> None:
        self.r = r
        self.blobs = blobs

    def put(self, record: dict[str, Any], package: Path | None, *, report: dict[str, Any] | None = None,
            sources: Path | None = None) -> dict[str, Any]:
        """Publish an artifact: blobs first, record last, so a reader never sees a record without its bytes.

        `report` (the stage report) and `sources` (a zip of the graphs and generated code) are stored before the
        record too. `package=None` publishes a report-only record (mode=training): "package" is false and there
        are no bytes to pull. Idempotent: a job that ran twice finds its own result and stores nothing again.
        """
        key = record["key"]
        existing = self.get(key)
        if existing:
            return existing
        if report is not None:
            self.r.set(keys.report(key), canonical_json(report))
        if sources is not None:
            with open(sources, "rb") as f:
                self.blobs.put("sources", key, f)
        if package is None:
            record = {**record, "package": False, "size": 0, "sha256": None, "created": time.time()}
        else:
            with open(package, "rb") as f:
                manifest = self.blobs.put("artifact", key, f)
            record = {**record, "package": True, "size": manifest["size"], "sha256": manifest["sha256"],
                      "created": time.time()}
        pipe = self.r.pipeline()
        pipe.set(keys.artifact(key), canonical_json(record), nx=True)
        pipe.zadd(keys.ARTIFACTS_INDEX, {key: record["created"]})
        pipe.sadd(keys.artifacts_by_model(record["factors"]["model"]), key)
        pipe.execute()
        return self.get(key) or record

    def get(self, key: str) -> dict[str, Any] | None:
        raw = self.r.get(keys.artifact(key))
        return json.loads(raw) if raw else None

    def report(self, key: str) -> dict[str, Any] | None:
        """The artifact's stage report (compiler.report schema)."""
        raw = self.r.get(keys.report(key))
        return json.loads(raw) if raw else None

    def for_model(self, model_id: str) -> list[dict[str, Any]]:
        """Every artifact built from one model (deploy-time lookup)."""
        ks = sorted(cast(set[str], self.r.smembers(keys.artifacts_by_model(model_id))))
        if not ks:
            return []
        return [json.loads(v) for v in self.r.mget([keys.artifact(k) for k in ks]) if v]

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest artifacts first."""
        ks = cast(list[str], self.r.zrevrange(keys.ARTIFACTS_INDEX, 0, limit - 1))
        return [a for a in (self.get(k) for k in ks) if a]
