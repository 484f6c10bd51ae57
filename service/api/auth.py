"""Who is calling, and what they may do: API keys, scopes and namespaces, as FastAPI dependencies.

With AOTC_ADMIN_KEY set, every /v1 route needs `Authorization: Bearer <key>`: 401 without a known key, 403 for a
key whose scope is short of the route's. The scopes nest:

    pull      lookup, meta, report, source, manifest, download; read models and artifacts
    compile   upload, compile, and see and cancel jobs; plus pull
    admin     keys, namespaces and quotas, caches, workers, pins, signing keys; every namespace

A key of scope pull or compile sees only its namespace's models, jobs and artifacts: what belongs to another
namespace answers exactly as what does not exist (404). Admin keys see all.

Without AOTC_ADMIN_KEY the API runs open, for one person on one machine: every caller is an admin of namespace
`default`, and only clients on loopback get an answer (401 otherwise), whatever address the server binds.
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, cast

import redis.asyncio as aioredis
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials

from compiler.errors import Forbidden, Unauthorized
from service.api.security import bearer_scheme
from service.store import keys
from service.store.apikeys import DEFAULT_NAMESPACE, SCOPES, secret_hash

MEMO_ENTRIES = 50_000
LOOPBACK = ("127.", "::1", "localhost")


@dataclass(frozen=True)
class Principal:
    key_id: str
    scope: str
    namespace: str

    def allows(self, scope: str) -> bool:
        return SCOPES.index(self.scope) >= SCOPES.index(scope)

    @property
    def ns(self) -> str | None:
        """The namespace whose things this caller sees; None for an admin, who sees all."""
        return None if self.scope == "admin" else self.namespace

    def to_json(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "scope": self.scope, "namespace": self.namespace}


OPEN = Principal("open", "admin", DEFAULT_NAMESPACE)
BOOTSTRAP = Principal("bootstrap", "admin", DEFAULT_NAMESPACE)


class Keyring:
    """Checks keys against Redis, and remembers each answer for `ttl_s` (one API process).

    Also remembers which models a namespace holds: a model never leaves a namespace, so a positive answer stays
    true, and the deploy-time lookup path pays no extra round trip for it after the first."""

    def __init__(self, aredis: aioredis.Redis, admin_key: str | None, ttl_s: float, *,
                 insecure: bool = False) -> None:
        self.r = aredis
        self.open = admin_key is None
        self.insecure = insecure  # open to every client, not just loopback ones (aotc-server --insecure)
        self._admin = secret_hash(admin_key) if admin_key else ""
        self._ttl = ttl_s
        self._keys: dict[str, tuple[float, Principal | None]] = {}
        self._owned: set[tuple[str, str]] = set()

    async def principal(self, token: str) -> Principal | None:
        h = secret_hash(token)
        if self._admin and hmac.compare_digest(h, self._admin):
            return BOOTSTRAP
        now = time.monotonic()
        if (hit := self._keys.get(h)) is not None and hit[0] > now:
            return hit[1]
        found = None
        key_id = await self.r.get(keys.apikey(h))
        if key_id:
            raw = await self.r.hget(keys.APIKEYS, key_id)
            record = json.loads(raw) if raw else None
            if record and record.get("revoked") is None and hmac.compare_digest(record["sha256"], h):
                found = Principal(record["id"], record["scope"], record["namespace"])
        if len(self._keys) >= MEMO_ENTRIES:
            self._keys.clear()
        self._keys[h] = (now + self._ttl, found)
        return found

    async def holds_model(self, ns: str, model_id: str) -> bool:
        if (ns, model_id) in self._owned:
            return True
        if await self.r.zscore(keys.ns(ns, "models"), model_id) is None:
            return False
        if len(self._owned) >= MEMO_ENTRIES:
            self._owned.clear()
        self._owned.add((ns, model_id))
        return True


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    return not host or host.startswith(LOOPBACK)  # no peer address: a unix socket, local too


async def authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Principal:
    keyring: Keyring = request.app.state.keyring
    if keyring.open:
        if not (keyring.insecure or _loopback(request)):
            raise Unauthorized("this aotc server runs without API keys (AOTC_ADMIN_KEY is unset), so it answers "
                               "only on loopback; its operator must set AOTC_ADMIN_KEY to serve the network")
        return OPEN
    if credentials is None:
        raise Unauthorized("this aotc server needs an API key: send `Authorization: Bearer <key>` (the CLI and "
                           "the SDK read AOTC_API_KEY); an admin creates keys with `aotc keys create`")
    found = await keyring.principal(credentials.credentials)
    if found is None:
        raise Unauthorized("the API key is not one this server knows, or it was revoked")
    return found


def _scope(scope: str) -> Any:
    async def require(who: Annotated[Principal, Depends(authenticate)]) -> Principal:
        if not who.allows(scope):
            raise Forbidden(f"this request needs a key of scope {scope!r}; the key {who.key_id} has scope "
                            f"{who.scope!r}", needs=scope, scope=who.scope)
        return who

    require.__name__ = f"require_{scope}"
    return require


_REQUIRE = {scope: _scope(scope) for scope in SCOPES}  # one callable per scope: FastAPI runs it once a request
Caller = Annotated[Principal, Depends(authenticate)]
Pull = Annotated[Principal, Depends(_REQUIRE["pull"])]
Compile = Annotated[Principal, Depends(_REQUIRE["compile"])]
Admin = Annotated[Principal, Depends(_REQUIRE["admin"])]


def needs(scope: str) -> list[Any]:
    """A router's `dependencies=`: every route of it needs `scope`."""
    return [cast(Any, Depends(_REQUIRE[scope]))]
