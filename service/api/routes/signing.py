"""The public keys artifact manifests are signed with (compiler/signing.py): list them, revoke one.

A client that does not pin keys (AOTC_TRUSTED_KEYS) trusts what this lists. Whoever controls the service or its
Redis controls this list too, which is why pinning is the secure choice; revoking here still works for pinned
clients, which honour the revocations listed.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from compiler.errors import NotFound
from service.api.auth import Admin, needs
from service.api.deps import StoreDep
from service.api.schemas import V1_ERRORS, SigningKey, SigningKeyList, errors

router = APIRouter(prefix="/v1/signing-keys", tags=["signing"], responses=V1_ERRORS, dependencies=needs("pull"))

KID = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="The key's id: 16 hex digits.")]


@router.get("", response_model=SigningKeyList)
def list_signing_keys(store: StoreDep) -> dict[str, Any]:
    """Every public key workers have signed artifact manifests with, active and revoked, oldest first."""
    return {"keys": store.signing.all()}


@router.delete("/{kid}", response_model=SigningKey, responses=errors(404, 422, why={404: "No such signing key"}))
def revoke_signing_key(kid: KID, store: StoreDep, _: Admin) -> dict[str, Any]:
    """Revoke a signing key: clients refuse every artifact it signed from now on (recompile them under an active
    key), and a worker holding it refuses to sign. Revoking twice keeps the first time."""
    record = store.signing.revoke(kid)
    if record is None:
        raise NotFound(f"no signing key {kid}; GET /v1/signing-keys lists them")
    return record
