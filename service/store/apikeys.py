"""API keys: who may call the API, with which scope, in which namespace.

A key is `aotc_<id>_<secret>`: the id names it in listings and revocations, the secret is 32 random bytes. Redis
keeps the sha256 of the whole key, never the key: whoever reads Redis (or a backup of it) cannot call the API.
A plain sha256 is enough, since the secret is random rather than chosen by a person: nothing is gained by
guessing through a slow hash.

    apikeys           hash  id -> record (JSON): id, scope, namespace, name, created, revoked, sha256
    apikey:{sha256}   str   the id of the live key with that hash; deleted when the key is revoked
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from typing import Any, cast

import redis

from compiler.cachekey import canonical_json
from service.store import keys

SCOPES = ("pull", "compile", "admin")  # each allows what the ones before it allow
NAMESPACE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
DEFAULT_NAMESPACE = "default"
_TOKEN = re.compile(r"aotc_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")


def secret_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def key_id_of(token: str) -> str | None:
    """The id a well-formed key carries, else None (a bootstrap admin key is any string)."""
    m = _TOKEN.fullmatch(token)
    return m.group(1) if m else None


def check_namespace(namespace: str) -> str:
    if not NAMESPACE.fullmatch(namespace):
        raise ValueError(f"namespace {namespace[:80]!r} is not 1-63 lowercase letters, digits, '-' or '_' "
                         "starting with a letter or digit")
    return namespace


def public(record: dict[str, Any]) -> dict[str, Any]:
    """A key's record without its hash: what listings show."""
    return {k: v for k, v in record.items() if k != "sha256"}


class ApiKeys:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def create(self, scope: str, namespace: str, name: str = "") -> tuple[dict[str, Any], str]:
        """A new key: (its public record, the key itself, which only this answer ever shows)."""
        if scope not in SCOPES:
            raise ValueError(f"scope {scope!r} is not one of {', '.join(SCOPES)}")
        check_namespace(namespace)
        key_id = secrets.token_hex(6)
        token = f"aotc_{key_id}_{secrets.token_urlsafe(32)}"
        digest, created = secret_hash(token), time.time()
        record: dict[str, Any] = {"id": key_id, "scope": scope, "namespace": namespace, "name": name,
                                  "created": created, "revoked": None, "sha256": digest}
        pipe = self.r.pipeline()
        pipe.hset(keys.APIKEYS, key_id, canonical_json(record))
        pipe.set(keys.apikey(digest), key_id)
        pipe.zadd(keys.NAMESPACES, {namespace: created}, nx=True)
        pipe.execute()
        return public(record), token

    def get(self, key_id: str) -> dict[str, Any] | None:
        raw = self.r.hget(keys.APIKEYS, key_id)
        return json.loads(raw) if raw else None

    def all(self) -> list[dict[str, Any]]:
        """Every key, newest first, without hashes."""
        raw = cast(dict[str, str], self.r.hgetall(keys.APIKEYS))
        return sorted((public(json.loads(v)) for v in raw.values()), key=lambda k: -k["created"])

    def revoke(self, key_id: str) -> dict[str, Any] | None:
        """Revoke a key (at once for new connections; API processes that hold it in memory drop it within
        AOTC_AUTH_CACHE_S). Returns its record, or None for an unknown id. Revoking twice is harmless."""
        record = self.get(key_id)
        if record is None:
            return None
        if record["revoked"] is None:
            record["revoked"] = time.time()
            pipe = self.r.pipeline()
            pipe.hset(keys.APIKEYS, key_id, canonical_json(record))
            pipe.delete(keys.apikey(record["sha256"]))
            pipe.execute()
        return public(record)
