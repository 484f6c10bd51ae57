"""What the SDK checks before it writes or loads a package: the artifact's signed manifest (compiler/signing.py).

A pull fetches the manifest (GET /v1/artifacts/{key}/manifest) and verifies, before a byte of the package is
written: the Ed25519 signature, by a trusted key that is not revoked; that the statement names this artifact key;
and that the service's record agrees with it on the package's sha256 and size. After the download the file must
have that sha256 and size, before it is renamed into place (client/sdk.py). Every refusal is a
compiler.errors.BadSignature whose message says what failed.

Which keys are trusted:

- pinned: `AOTC_TRUSTED_KEYS` (or `Client(trusted_keys=...)`): entries separated by commas, each either a path to a
  public key file (PEM, or the base64 of the raw 32-byte key) or `KID=BASE64` (the raw key in base64, its id
  checked). The secure choice: nothing the service says can add a key. The service's revocations still apply
  (a revocation can only refuse more);
- else the keys the service lists (GET /v1/signing-keys), revoked ones refused. That catches corrupt and swapped
  packages and manifests, but not a compromised service or Redis: whoever controls those can list a key of their
  own. Inference servers should pin.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx

from compiler.errors import BadSignature
from compiler.signing import Manifest, TrustedKey, key_id, load_public_key, verify

ENV = "AOTC_TRUSTED_KEYS"
TrustSpec = str | Sequence[str | Path]
_KID = frozenset("0123456789abcdef")


def parse_trusted(spec: TrustSpec) -> dict[str, TrustedKey]:
    """Pinned keys from AOTC_TRUSTED_KEYS's syntax (a string) or a list of its entries; BadSignature (reason
    `trusted_keys`) names an entry that cannot be read."""
    entries = [e.strip() for e in spec.split(",")] if isinstance(spec, str) else [str(e).strip() for e in spec]
    out: dict[str, TrustedKey] = {}
    for entry in filter(None, entries):
        kid, sep, value = entry.partition("=")
        try:
            if sep and len(kid) == 16 and set(kid) <= _KID:  # KID=BASE64 (a path would not look like this)
                key = load_public_key(value, f"{ENV} entry {kid}")
                if key_id(key) != kid:
                    raise ValueError(f"{ENV} entry {kid}: that key's id is {key_id(key)}")
            else:
                key = load_public_key(Path(entry).expanduser().read_bytes(), f"{ENV} entry {entry}")
        except (OSError, ValueError) as e:
            raise BadSignature("trusted_keys", f"cannot read the trusted keys: {e}") from None
        pinned = TrustedKey.of(key)
        out[pinned.kid] = pinned
    if not out:
        raise BadSignature("trusted_keys", f"the trusted keys ({ENV}) name no key")
    return out


class HasHttp(Protocol):
    http: httpx.Client


class Verifier:
    """Verifies artifacts for one Client (its `http`, whatever it is at the time). `pins`: AOTC_TRUSTED_KEYS's syntax,
    or None to trust the keys the service lists. `raise_for` turns an answer that is not a success into the SDK's
    ClientError."""

    def __init__(self, client: HasHttp, raise_for: Callable[[httpx.Response], None], pins: TrustSpec | None) -> None:
        self.client, self.raise_for, self.pins = client, raise_for, pins
        self._pinned: dict[str, TrustedKey] | None = None

    def trusted(self) -> dict[str, TrustedKey]:
        """The keys a manifest may be signed by now: the pins, else the service's; revocations applied."""
        if self.pins is not None:
            if self._pinned is None:
                self._pinned = parse_trusted(self.pins)
            try:
                listed = self.keys()
            except Exception:  # revocations are best effort with pins: a service that hides them gains nothing
                listed = []
            revoked = {str(r.get("kid")): _seconds(r["revoked_at"]) for r in listed
                       if isinstance(r, dict) and r.get("revoked_at") is not None}
            return {kid: TrustedKey(kid, k.key, revoked[kid]) if kid in revoked else k
                    for kid, k in self._pinned.items()}
        out: dict[str, TrustedKey] = {}
        for record in self.keys():
            try:
                k = TrustedKey.from_record(record)
            except (ValueError, TypeError):
                continue  # a record that does not hold the key its id names trusts nothing
            out[k.kid] = k
        return out

    def keys(self) -> list[dict[str, Any]]:
        """GET /v1/signing-keys: every signing key the service knows, active and revoked."""
        resp = self.client.http.get("/v1/signing-keys")
        self.raise_for(resp)
        return list(resp.json()["keys"])

    def revoke(self, kid: str) -> dict[str, Any]:
        """DELETE /v1/signing-keys/{kid} (admin): clients refuse what the key signed from now on."""
        resp = self.client.http.delete(f"/v1/signing-keys/{kid}")
        self.raise_for(resp)
        return dict(resp.json())

    def manifest(self, key: str, meta: dict[str, Any]) -> Manifest:
        """The verified manifest of artifact `key`, whose record (`meta`) must agree on the package's sha256 and
        size; BadSignature otherwise."""
        resp = self.client.http.get(f"/v1/artifacts/{key}/manifest")
        if resp.status_code == 404 and _error(resp).get("reason") == "unsigned":
            raise BadSignature("unsigned", str(_error(resp).get("message") or f"artifact {key} is unsigned"))
        self.raise_for(resp)
        try:
            envelope = resp.json()
        except ValueError:
            raise BadSignature("malformed", f"the service's manifest of artifact {key} is not JSON") from None
        signed = verify(envelope, self.trusted())
        signed.expect(key=key)
        signed.expect(sha256=str(meta.get("sha256")), size=int(meta.get("size") or 0))
        return signed


def check_file(signed: Manifest, path: Path) -> None:
    """BadSignature unless the file at `path` has the signed sha256 and size."""
    with open(path, "rb") as f:
        check_digest(signed, hashlib.file_digest(f, "sha256").hexdigest(), os.fstat(f.fileno()).st_size)


def check_digest(signed: Manifest, sha256: str, size: int) -> None:
    """BadSignature unless a download's sha256 and size are the signed ones."""
    if (sha256, size) != (signed.sha256, signed.size):
        raise BadSignature("mismatch", f"artifact {signed.key} arrived corrupt or tampered with: sha256 {sha256} "
                                       f"({size} bytes), but its signed manifest says {signed.sha256} "
                                       f"({signed.size} bytes)", kid=signed.kid)


def _error(resp: httpx.Response) -> dict[str, Any]:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return error if isinstance(error, dict) else {}


def _seconds(t: Any) -> float:
    """A revocation time; one that cannot be read still revokes (as of now)."""
    try:
        return float(t)
    except (TypeError, ValueError):
        return time.time()
