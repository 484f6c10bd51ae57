"""The public keys workers sign artifact manifests with (compiler/signing.py), one record per key id.

A worker publishes its key at start; a key already known keeps its record, so a restarted worker never revives a
revoked key. Revoking stamps `revoked_at` and keeps the record: clients refuse what the key signed, and
GET /v1/signing-keys still says when it went. Only public keys are stored here: whoever can write Redis can add
a key of their own, so an inference server that must not trust Redis pins its keys (AOTC_TRUSTED_KEYS).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys


class SigningKeys:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def publish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Add a key's public record (compiler.signing.key_record) unless its kid is known; returns the stored one
        (an earlier record, possibly revoked, wins)."""
        self.r.hsetnx(keys.SIGNING_KEYS, record["kid"], canonical_json(record))
        return self.get(record["kid"]) or record

    def get(self, kid: str) -> dict[str, Any] | None:
        raw = cast(str | None, self.r.hget(keys.SIGNING_KEYS, kid))
        return json.loads(raw) if raw else None

    def all(self) -> list[dict[str, Any]]:
        """Every key, active and revoked, oldest first."""
        records = [json.loads(v) for v in cast(dict[str, str], self.r.hgetall(keys.SIGNING_KEYS)).values()]
        return sorted(records, key=lambda k: (float(k.get("created") or 0), str(k.get("kid"))))

    def revoke(self, kid: str, when: float | None = None) -> dict[str, Any] | None:
        """Mark a key revoked (keeping the first revocation's time); None when no key has this id."""
        with self.r.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(keys.SIGNING_KEYS)
                    raw = cast(str | None, pipe.hget(keys.SIGNING_KEYS, kid))
                    if not raw:
                        pipe.unwatch()
                        return None
                    record = json.loads(raw)
                    if record.get("revoked_at") is not None:
                        pipe.unwatch()
                        return dict(record)
                    record["revoked_at"] = when if when is not None else time.time()
                    pipe.multi()
                    pipe.hset(keys.SIGNING_KEYS, kid, canonical_json(record))
                    pipe.execute()
                    return dict(record)
                except redis.WatchError:
                    continue
