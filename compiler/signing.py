"""Signed artifact manifests: a DSSE envelope around an in-toto Statement v1, signed with Ed25519. Torch-free: the
worker signs with it, the service lists keys with it, and the SDK verifies with it before it writes or loads a
package.

    envelope  = {"payloadType": "application/vnd.in-toto+json", "payload": b64(statement bytes),
                 "signatures": [{"keyid": kid, "sig": b64(ed25519(PAE(payloadType, statement bytes)))}]}
    PAE(t, b) = b"DSSEv1 " + len(t) + b" " + t + b" " + len(b) + b" " + b      (lengths in ASCII decimal)
    statement = {"_type": "https://in-toto.io/Statement/v1",
                 "subject": [{"name": artifact key, "digest": {"sha256": package sha256, "blake3": its BLAKE3}}],
                 "predicateType": "https://aotc.dev/artifact-manifest/v1",
                 "predicate": {artifact_key, package_sha256, package_size, model_sha256, factors, toolchain, target,
                               check, signed_at, worker}}
    kid       = sha256(raw 32-byte public key).hexdigest()[:16]

Base64 is the standard alphabet with padding. The signature covers the payload bytes exactly as sent; verifiers
never re-serialize the statement. This is the inner part of the OpenSSF model-signing format (a DSSE envelope
carrying an in-toto Statement) without its outer Sigstore bundle: aotc's keys are its workers' own, pinned by the
operator, with no certificate authority or transparency log to carry material for.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from compiler.canonical import canonical_json
from compiler.digests import Want
from compiler.errors import BadSignature

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://aotc.dev/artifact-manifest/v1"
COUNTERSIGN_TYPE = "https://aotc.dev/target-verification/v1"
ALGORITHM = "ed25519"
MAX_ENVELOPE_BYTES = 1 << 20  # a manifest is a few KB; anything near this is not one


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is actually signed."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any, what: str) -> bytes:
    """Strict standard base64 (padding required, no stray characters)."""
    if not isinstance(text, str):
        raise BadSignature("malformed", f"the manifest's {what} is not a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise BadSignature("malformed", f"the manifest's {what} is not valid base64") from None


# -- keys ------------------------------------------------------------------------------------------------------------


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey | bytes) -> str:
    """The key's id: the first 16 hex digits of the sha256 of its raw 32 bytes."""
    raw = key if isinstance(key, bytes) else raw_public(key)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_public_key(data: bytes | str, where: str = "the key") -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM (SubjectPublicKeyInfo) or the base64 of its raw 32 bytes."""
    blob = data.encode() if isinstance(data, str) else data
    if b"-----BEGIN" in blob:
        if b"PRIVATE KEY" in blob:
            raise ValueError(f"{where} is a private key: give the public key (`openssl pkey -pubout`)")
        try:
            key = serialization.load_pem_public_key(blob)
        except ValueError as e:
            raise ValueError(f"{where} is not a PEM public key: {e}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{where} is a {type(key).__name__}, not an Ed25519 public key")
        return key
    try:
        raw = base64.b64decode(blob.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is neither a PEM public key nor the base64 of a raw Ed25519 key") from None
    if len(raw) != 32:
        raise ValueError(f"{where} decodes to {len(raw)} bytes; a raw Ed25519 public key is 32")
    return Ed25519PublicKey.from_public_bytes(raw)


@dataclass(frozen=True)
class TrustedKey:
    """A public key a verifier accepts signatures from, unless it is revoked."""

    kid: str
    key: Ed25519PublicKey
    revoked_at: float | None = None

    @classmethod
    def of(cls, key: Ed25519PublicKey, revoked_at: float | None = None) -> TrustedKey:
        return cls(key_id(key), key, revoked_at)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TrustedKey:
        """From a record as GET /v1/signing-keys lists it; its kid must be its key's."""
        key = load_public_key(str(record.get("public_key", "")), f"signing key {record.get('kid')!r}")
        kid = key_id(key)
        if record.get("kid") != kid:
            raise ValueError(f"signing key {record.get('kid')!r} is listed under the wrong id: its key's id is {kid}")
        revoked = record.get("revoked_at")
        return cls(kid, key, float(revoked) if revoked is not None else None)


def key_record(key: Ed25519PublicKey, created: float | None = None) -> dict[str, Any]:
    """The public record of a key, as the worker publishes it and GET /v1/signing-keys lists it."""
    return {"kid": key_id(key), "algorithm": ALGORITHM, "public_key": b64(raw_public(key)),
            "created": created if created is not None else time.time(), "revoked_at": None}


@dataclass(frozen=True)
class Signer:
    """A private key that signs manifests (only ever in the trusted worker process)."""

    key: Ed25519PrivateKey
    path: Path | None = None

    @property
    def public(self) -> Ed25519PublicKey:
        return self.key.public_key()

    @property
    def kid(self) -> str:
        return key_id(self.public)

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_file(cls, path: Path, *, create: bool = False) -> Signer:
        """The PEM (PKCS#8) Ed25519 private key at `path`. With `create`, a missing one is made first: the file
        mode 0600 in a dir of mode 0700, written so that no other process ever sees a partial or readable key."""
        if create and not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(path.parent, 0o700)
            pem = Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
            try:
                os.link(tmp, path)  # never replaces a key another worker made meanwhile
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path} is not an unencrypted PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
        return cls(key, path)

    def sign(self, statement: Mapping[str, Any]) -> dict[str, Any]:
        """The DSSE envelope of `statement`, signed by this key."""
        body = canonical_json(statement).encode()
        sig = self.key.sign(pae(PAYLOAD_TYPE, body))
        return {"payloadType": PAYLOAD_TYPE, "payload": b64(body), "signatures": [{"keyid": self.kid, "sig": b64(sig)}]}


# -- statements ------------------------------------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """JSON without NaN or Infinity (not JSON at all, and strict parsers refuse them): such floats as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def statement(*, artifact_key: str, package_sha256: str, package_size: int, model_sha256: str,
              factors: Mapping[str, Any], toolchain: Mapping[str, Any], target: str,
              check: Mapping[str, Any] | None, worker: Mapping[str, Any], signed_at: float | None = None,
              weights: Mapping[str, Any] | None = None, on_target: Mapping[str, Any] | None = None,
              package_blake3: str | None = None) -> dict[str, Any]:
    """The in-toto statement an artifact's manifest signs: its package by digest (sha256, and `package_blake3`
    where given: what a client verifies fastest, compiler/digests.py), and what it was built from.
    `weights` (a weightless package's: the weights blob's sha256, BLAKE3 and size, and each constant's fqn, shape,
    dtype and stride) is signed with it, so a client binds only the blob the package was checked with. `on_target`
    ({"run": false, "built_on": the builder's own target}) marks a package its builder did not run on its target:
    signed, so that no one who can write the record can drop the mark."""
    when = time.gmtime(signed_at if signed_at is not None else time.time())
    extra = {"weights": dict(weights)} if weights is not None else {}
    if on_target is not None:
        extra["on_target"] = dict(on_target)
    digest = {"sha256": package_sha256, **({"blake3": package_blake3} if package_blake3 is not None else {})}
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": artifact_key, "digest": digest}],
        "predicateType": PREDICATE_TYPE,
        "predicate": _finite({
            "artifact_key": artifact_key, "package_sha256": package_sha256, "package_size": package_size,
            "model_sha256": model_sha256, "factors": dict(factors), "toolchain": dict(toolchain), "target": target,
            "check": dict(check or {}), "signed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
            "worker": dict(worker), **extra,
        }),
    }


# An artifact key: 32 lowercase hex digits (compiler.cachekey). A manifest names one, and consumers make file names
# of it, so the worker signs nothing else and the client asks for nothing else.
ARTIFACT_KEY = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Manifest:
    """A statement whose signature verified, the key that signed it, and the sha256 of its signed payload (what a
    countersignature names)."""

    statement: dict[str, Any]
    kid: str
    payload_sha256: str = ""

    @property
    def predicate(self) -> dict[str, Any]:
        return dict(self.statement["predicate"])

    @property
    def key(self) -> str:
        return str(self.statement["subject"][0]["name"])

    @property
    def sha256(self) -> str:
        return str(self.statement["subject"][0]["digest"]["sha256"])

    @property
    def size(self) -> int:
        return int(self.statement["predicate"]["package_size"])

    @property
    def want(self) -> Want:
        """What the package's file must be: its size, and the signed digest this process verifies fastest."""
        return Want.of(self.statement["subject"][0]["digest"], self.size)

    @property
    def weights_want(self) -> Want | None:
        """The same for the weights blob a weightless package binds; None: self-contained."""
        w = self.weights
        return None if w is None else Want.of({k: w.get(k) for k in ("sha256", "blake3")}, int(w["size"]))

    @property
    def weights(self) -> dict[str, Any] | None:
        """The signed weights blob (sha256, size, constants) a weightless package binds; None: self-contained."""
        w = self.statement["predicate"].get("weights")
        return dict(w) if isinstance(w, Mapping) else None

    @property
    def target(self) -> str:
        return str(self.statement["predicate"].get("target") or "")

    @property
    def run_on_target(self) -> bool:
        """False where the builder signed that it did not run the package on its target (built for another
        architecture or level: `on_target` in the predicate); such a package needs a countersignature. Manifests from
        before the mark, and every native build, ran there."""
        mark = self.statement["predicate"].get("on_target")
        return not (isinstance(mark, Mapping) and mark.get("run") is False)

    def expect(self, *, key: str | None = None, sha256: str | None = None, size: int | None = None) -> None:
        """Raise BadSignature (`mismatch`) unless the manifest names this artifact key, package sha256 and size."""
        if key is not None and self.key != key:
            raise BadSignature("mismatch", f"the manifest is signed for artifact {self.key}, not {key}", kid=self.kid)
        if sha256 is not None and self.sha256 != sha256:
            raise BadSignature("mismatch", f"artifact {self.key}: package sha256 {sha256} does not match the signed "
                                           f"manifest's {self.sha256}", kid=self.kid)
        if size is not None and self.size != size:
            raise BadSignature("mismatch", f"artifact {self.key}: package size {size} does not match the signed "
                                           f"manifest's {self.size}", kid=self.kid)


def verify(envelope: Any, trusted: Mapping[str, TrustedKey] | Iterable[TrustedKey]) -> Manifest:
    """The statement of `envelope` if a trusted key that is not revoked signed it; else BadSignature, whose
    `reason` says what failed: unsigned, malformed, unknown_key, revoked_key, bad_signature, mismatch."""
    body, kid = _open(envelope, trusted, "manifest")
    return Manifest(_statement(body, kid), kid, hashlib.sha256(body).hexdigest())


def _open(envelope: Any, trusted: Mapping[str, TrustedKey] | Iterable[TrustedKey], what: str) -> tuple[bytes, str]:
    """The signed payload of a DSSE envelope and the id of the trusted, unrevoked key that signed it; else
    BadSignature. `what` names the envelope in messages (a manifest, a countersignature)."""
    keys = dict(trusted) if isinstance(trusted, Mapping) else {k.kid: k for k in trusted}
    if envelope is None or envelope == {}:
        raise BadSignature("unsigned", f"the artifact has no signed {what}")
    if not isinstance(envelope, Mapping):
        raise BadSignature("malformed", f"the {what} is not a DSSE envelope (a JSON object)")
    if len(canonical_json(envelope)) > MAX_ENVELOPE_BYTES:
        raise BadSignature("malformed", f"the {what} is over {MAX_ENVELOPE_BYTES} bytes")
    if envelope.get("payloadType") != PAYLOAD_TYPE:
        raise BadSignature("malformed", f"the {what}'s payloadType is {envelope.get('payloadType')!r}, "
                                        f"not {PAYLOAD_TYPE!r}")
    body = unb64(envelope.get("payload"), "payload")
    sigs = envelope.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise BadSignature("unsigned", f"the {what} carries no signature")
    signed = pae(PAYLOAD_TYPE, body)
    problems: list[BadSignature] = []
    for sig in sigs:
        if not isinstance(sig, Mapping):
            raise BadSignature("malformed", f"a signature of the {what} is not a JSON object")
        kid, raw = sig.get("keyid"), unb64(sig.get("sig"), "signature")
        if kid and not (isinstance(kid, str) and kid in keys):
            problems.append(BadSignature("unknown_key", f"the {what} is signed by unknown key {kid}; trusted: "
                                                        f"{', '.join(sorted(keys)) or 'none'}", kid=str(kid)))
            continue
        # keyid is a hint that DSSE does not sign: without one, any trusted key may have signed.
        signer = next((k for k in ([keys[kid]] if kid else keys.values()) if _verifies(k, raw, signed)), None)
        if signer is None:
            which = f"key {kid}" if kid else "any trusted key"
            problems.append(BadSignature("bad_signature", f"bad signature: the {what} does not verify with {which}",
                                         kid=str(kid or "")))
        elif signer.revoked_at is not None:
            problems.append(BadSignature("revoked_key", f"the {what} is signed by revoked key {signer.kid} "
                                         f"(revoked at {_when(signer.revoked_at)})", kid=signer.kid))
        else:
            return body, signer.kid
    # The most telling problem: a revoked key, then a bad signature, then an unknown key.
    order = {"revoked_key": 0, "bad_signature": 1, "unknown_key": 2}
    raise min(problems, key=lambda p: order.get(p.reason, 3))


# -- countersignatures ----------------------------------------------------------------------------------------------
#
# A worker that serves a target natively checks a package its builder could not run there, and signs, with its own
# key, a second statement over the builder's signed payload (by sha256), the package and the target:
#
#     subject   = the artifact, as in the manifest
#     predicate = {artifact_key, package_sha256, manifest_sha256, target, checked_on, check: {passed, ...},
#                  verifier: {id, host, device_name}, signed_at}
#
# It names the manifest's payload, not only the package: a countersignature vouches for this build's statement (its
# weights, its factors), and cannot be moved to another manifest of the same bytes.


def countersign_statement(*, manifest: Manifest, checked_on: str, check: Mapping[str, Any],
                          verifier: Mapping[str, Any], signed_at: float | None = None) -> dict[str, Any]:
    """The statement a verifying worker signs for `manifest` (verified) after its check passed on `checked_on`."""
    when = time.gmtime(signed_at if signed_at is not None else time.time())
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest.key, "digest": {"sha256": manifest.sha256}}],
        "predicateType": COUNTERSIGN_TYPE,
        "predicate": _finite({
            "artifact_key": manifest.key, "package_sha256": manifest.sha256,
            "manifest_sha256": manifest.payload_sha256, "target": manifest.target, "checked_on": checked_on,
            "check": dict(check), "verifier": dict(verifier),
            "signed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
        }),
    }


@dataclass(frozen=True)
class Countersignature:
    """A countersignature whose signature verified and that vouches for one manifest, and the key that signed it."""

    statement: dict[str, Any]
    kid: str

    @property
    def predicate(self) -> dict[str, Any]:
        return dict(self.statement["predicate"])


def verify_countersignature(envelope: Any, trusted: Mapping[str, TrustedKey] | Iterable[TrustedKey],
                            manifest: Manifest) -> Countersignature:
    """The countersignature in `envelope` if a trusted, unrevoked key signed it and it vouches that `manifest`'s
    package passed its check on the manifest's own target; else BadSignature (the reasons of `verify`)."""
    body, kid = _open(envelope, trusted, "countersignature")
    try:
        st = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadSignature("malformed", "the countersigned payload is not JSON", kid=kid) from None
    pred = st.get("predicate") if isinstance(st, dict) else None
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE or st.get("predicateType") != COUNTERSIGN_TYPE \
            or not isinstance(pred, dict):
        raise BadSignature("malformed", f"the countersigned payload is not an in-toto statement of type "
                                        f"{COUNTERSIGN_TYPE}", kid=kid)
    expected = {"artifact_key": manifest.key, "package_sha256": manifest.sha256,
                "manifest_sha256": manifest.payload_sha256, "target": manifest.target}
    wrong = [f"{k} {str(pred.get(k))[:80]!r} (expected {v!r})" for k, v in expected.items() if pred.get(k) != v]
    if st.get("subject") != [{"name": manifest.key, "digest": {"sha256": manifest.sha256}}]:
        wrong.append("its subject")
    if wrong:
        raise BadSignature("mismatch", f"the countersignature by {kid} is for another build: {'; '.join(wrong)}",
                           kid=kid)
    check = pred.get("check")
    if not isinstance(check, dict) or check.get("passed") is not True:
        raise BadSignature("mismatch", f"the countersignature by {kid} does not say the check passed on "
                                       f"{manifest.target}", kid=kid)
    return Countersignature(st, kid)


def _verifies(key: TrustedKey, sig: bytes, signed: bytes) -> bool:
    try:
        key.key.verify(sig, signed)
    except InvalidSignature:
        return False
    return True


def _statement(body: bytes, kid: str) -> dict[str, Any]:
    """The signed payload as an aotc statement, its subject agreeing with its predicate."""
    try:
        st = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadSignature("malformed", "the signed payload is not JSON", kid=kid) from None
    if not isinstance(st, dict) or st.get("_type") != STATEMENT_TYPE or st.get("predicateType") != PREDICATE_TYPE:
        raise BadSignature("malformed", f"the signed payload is not an in-toto statement of type {PREDICATE_TYPE}",
                           kid=kid)
    subject, pred = st.get("subject"), st.get("predicate")
    if (not isinstance(subject, list) or len(subject) != 1 or not isinstance(subject[0], dict)
            or not isinstance(subject[0].get("name"), str) or not isinstance(subject[0].get("digest"), dict)
            or not isinstance(subject[0]["digest"].get("sha256"), str) or not isinstance(pred, dict)):
        raise BadSignature("malformed", "the signed statement does not name one artifact by its sha256", kid=kid)
    name, sha = subject[0]["name"], subject[0]["digest"]["sha256"]
    size = pred.get("package_size")
    if pred.get("artifact_key") != name or pred.get("package_sha256") != sha or not isinstance(size, int) \
            or isinstance(size, bool) or size < 0:
        raise BadSignature("mismatch", "the signed statement's subject and predicate disagree on the artifact",
                           kid=kid)
    return st


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
