"""API keys and namespaces: who may call, and what a namespace may spend (admin only, but for `GET /v1/me`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from compiler.errors import NotFound
from compiler.options import JSON_INT
from service.api.auth import Admin, Caller
from service.api.deps import SettingsDep, StoreDep
from service.api.schemas import JSON_NUMBER, NAME_TEXT, V1_ERRORS, errors
from service.store.apikeys import DEFAULT_NAMESPACE, NAMESPACE

router = APIRouter(prefix="/v1", tags=["keys"], responses=V1_ERRORS)

Scope = Literal["pull", "compile", "admin"]
NS_PATTERN = f"^{NAMESPACE.pattern}$"
_NS = Field(pattern=NS_PATTERN, max_length=63, description="1-63 lowercase letters, digits, '-' or '_'.")


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scope: Scope
    namespace: Annotated[str, _NS] = DEFAULT_NAMESPACE
    name: str = Field(default="", max_length=200, pattern=NAME_TEXT, description="What the key is for (printable "
                      "text).")


class KeyRecord(BaseModel):
    id: str
    scope: Scope
    namespace: str
    name: str = ""
    created: float
    revoked: float | None = None


class KeyCreated(KeyRecord):
    key: str = Field(description="The key itself. Only this answer shows it: the service keeps its hash.")


class KeyList(BaseModel):
    keys: list[KeyRecord]


class Quota(BaseModel):
    max_jobs: int
    max_stored_gb: float


class QuotaRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The bounds go on the number, inside the Optional: on the union pydantic would publish them as "ge" and "gt",
    # which JSON Schema does not know.
    max_jobs: Annotated[int, Field(ge=1, le=1_000_000), JSON_INT] | None = None
    max_stored_gb: Annotated[float, Field(gt=0, le=1_000_000), JSON_NUMBER] | None = None


class Usage(BaseModel):
    namespace: str
    jobs: int = Field(description="Queued plus running.")
    stored_bytes: int = Field(description="The bytes of its models and of their stored artifacts.")
    models: int
    quota: Quota


class Me(BaseModel):
    key_id: str
    scope: Scope
    namespace: str
    usage: Usage


class NamespaceList(BaseModel):
    namespaces: list[Usage]


_KEY_ID = Path(pattern=r"^[0-9a-f]{12}$", description="The key's id (`aotc keys list`).")


@router.post("/keys", status_code=201, response_model=KeyCreated, responses=errors(400, 422))
def create_key(req: KeyRequest, store: StoreDep, _: Admin) -> dict[str, Any]:
    """A new API key of `scope` in `namespace`. The answer is the only place the key itself appears."""
    record, token = store.apikeys.create(req.scope, req.namespace, req.name)
    return {**record, "key": token}


@router.get("/keys", response_model=KeyList)
def list_keys(store: StoreDep, _: Admin) -> dict[str, Any]:
    """Every key, newest first, without secrets (revoked ones say when)."""
    return {"keys": store.apikeys.all()}


@router.delete("/keys/{key_id}", response_model=KeyRecord, responses=errors(404, 422))
def revoke_key(key_id: Annotated[str, _KEY_ID], store: StoreDep, _: Admin) -> dict[str, Any]:
    """Revoke a key: refused from now on (API processes that checked it drop it within AOTC_AUTH_CACHE_S)."""
    record = store.apikeys.revoke(key_id)
    if record is None:
        raise NotFound(f"no API key {key_id!r}")
    return record


@router.get("/me", response_model=Me)
def me(who: Caller, store: StoreDep, settings: SettingsDep) -> dict[str, Any]:
    """The calling key: its scope and namespace, and what the namespace holds against its quotas."""
    return {**who.to_json(), "usage": store.namespaces.usage(who.namespace, settings.default_quota())}


@router.get("/namespaces", response_model=NamespaceList)
def list_namespaces(store: StoreDep, settings: SettingsDep, _: Admin) -> dict[str, Any]:
    """Every namespace with its usage and quotas."""
    default = settings.default_quota()
    return {"namespaces": [store.namespaces.usage(ns, default) for ns in store.namespaces.names()]}


@router.put("/namespaces/{namespace}/quota", response_model=Usage, responses=errors(400, 422))
def set_quota(namespace: Annotated[str, Path(pattern=NS_PATTERN, max_length=63)], req: QuotaRequest,
              store: StoreDep, settings: SettingsDep, _: Admin) -> dict[str, Any]:
    """Set a namespace's quotas (what is left out keeps its value; unset ones follow AOTC_NS_MAX_*)."""
    store.namespaces.set_quota(namespace, max_jobs=req.max_jobs, max_stored_gb=req.max_stored_gb)
    return store.namespaces.usage(namespace, settings.default_quota())
