"""What the SDK checks before it writes or loads a package: the artifact's signed manifest (compiler/signing.py).

A pull fetches the manifest (GET /v1/artifacts/{key}/manifest) and verifies, before a byte of the package is
written: the Ed25519 signature, by a trusted key that is not revoked; that the statement names this artifact key;
and that the service's record agrees with it on the package's sha256 and size. After the download the file must
have that size and the signed digest (BLAKE3 where the manifest signs one and the `blake3` module is installed,
else sha256: compiler/digests.py), before it is renamed into place (client/sdk.py). Every refusal is a
compiler.errors.BadSignature whose message says what failed.

Which keys are trusted:

- pinned: `AOTC_TRUSTED_KEYS` (or `Client(trusted_keys=...)`): entries separated by commas, each either a path to a
  public key file (PEM, or the base64 of the raw 32-byte key) or `KID=BASE64` (the raw key in base64, its id
  checked). The secure choice: nothing the service says can add a key. The service's revocations still apply
  (a revocation can only refuse more);
- else the keys the service lists (GET /v1/signing-keys), revoked ones refused. That catches corrupt and swapped
  packages and manifests, but not a compromised service or Redis: whoever controls those can list a key of their
  own. Inference servers should pin.

A package its builder did not run on its target (its signed manifest says `on_target: {"run": false}`:
compiler/ontarget.py) is refused unless a countersignature in its record, by a trusted key that is not revoked,
vouches that this manifest's package passed its check on that target; or unless the caller asked for it
(`Client(allow_unverified=True)`, `aotc pull --allow-unverified`). A countersignature that a trusted key's
signature does not verify, or that names another build, is refused always: it was tampered with. One by a key
the client does not trust (or a revoked one) vouches for nothing, as if it were absent.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from compiler.digests import Want, file_digest
from compiler.errors import AotcError, BadSignature
from compiler.shapes import covers, format_shape, parse_shape
from compiler.signing import (
    ARTIFACT_KEY,
    Countersignature,
    Manifest,
    TrustedKey,
    key_id,
    load_public_key,
    verify,
    verify_countersignature,
)
from compiler.targets import Target

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


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # the process that made it, and the pool
_POOL_LOCK = threading.Lock()


def pool() -> ThreadPoolExecutor:
    """The threads that ask the service for what a verification needs at once (an httpx.Client may be shared between
    threads). Nothing run on it waits for another of its tasks, so a busy pool only queues. A process forked after
    the pool was made (a server's preloaded workers) gets a pool of its own: the parent's threads are not in it, and
    work handed to their pool would never run."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=4, thread_name_prefix="aotc-verify"))
        return _POOL[1]


@dataclass(frozen=True)
class Fetched:
    """The service's answer for an artifact's manifest, and the keys trusted now being asked for beside it
    (`Verifier.fetch`): what `Verifier.manifest` checks."""

    key: str
    response: httpx.Response
    trusted: Future[dict[str, TrustedKey]]


class Verifier:
    """Verifies artifacts for one Client (its `http`, whatever it is at the time). `pins`: AOTC_TRUSTED_KEYS's syntax,
    or None to trust the keys the service lists. `raise_for` turns an answer that is not a success into the SDK's
    ClientError."""

    def __init__(self, client: HasHttp, raise_for: Callable[[httpx.Response], None], pins: TrustSpec | None,
                 allow_unverified: bool = False) -> None:
        self.client, self.raise_for, self.pins = client, raise_for, pins
        self.allow_unverified = allow_unverified
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

    def fetch(self, key: str) -> Fetched:
        """Ask for artifact `key`'s manifest and, at once on another connection, for the keys trusted now: two round
        trips to the service that a pull made one after the other. A key that is not one (32 lowercase hex digits)
        is refused before it names a URL: a signed manifest names exactly the key it was asked for, so a worker
        made to sign `../../x` would otherwise have pulls write outside the cache."""
        if not isinstance(key, str) or not ARTIFACT_KEY.fullmatch(key):
            raise BadSignature("malformed", f"{str(key)[:80]!r} is not an artifact key (32 lowercase hex digits)")
        trusted = pool().submit(self.trusted)
        return Fetched(key, self.client.http.get(f"/v1/artifacts/{key}/manifest"), trusted)

    def manifest(self, key: str, meta: dict[str, Any], asked: Asked | None = None,
                 fetched: Fetched | None = None) -> Manifest:
        """The verified manifest of artifact `key`, whose record (`meta`) must agree on the package's sha256 and
        size; BadSignature otherwise. Once it verifies, the record's fields that decide how the package is run are
        replaced by the signed ones (`adopt`). `fetched`: what `fetch(key)` answered (asked for beside the record),
        else it is asked for here."""
        if fetched is None:
            fetched = self.fetch(key)
        elif fetched.key != key:
            raise ValueError(f"the manifest fetched is artifact {fetched.key}'s, not {key}'s")
        resp = fetched.response
        if resp.status_code == 404 and _error(resp).get("reason") == "unsigned":
            raise BadSignature("unsigned", str(_error(resp).get("message") or f"artifact {key} is unsigned"))
        self.raise_for(resp)
        try:
            envelope = resp.json()
        except ValueError:
            raise BadSignature("malformed", f"the service's manifest of artifact {key} is not JSON") from None
        trusted = fetched.trusted.result()
        signed = verify(envelope, trusted)
        signed.expect(key=key)
        signed.expect(sha256=str(meta.get("sha256")), size=int(meta.get("size") or 0))
        self.on_target(signed, meta, trusted)
        adopt(signed, meta)
        if asked is not None:
            asked.expect(signed)
        return signed

    def on_target(self, signed: Manifest, meta: dict[str, Any],
                  trusted: dict[str, TrustedKey]) -> Countersignature | None:
        """The countersignature that vouches for a package its builder did not run on its target (None for one
        that ran there, or one taken unverified as asked); BadSignature (`unverified_on_target`) when none does, or
        the countersignature's own reason when one was tampered with."""
        if signed.run_on_target:
            return None
        envelopes = meta.get("countersignatures") or []
        untrusted: list[str] = []
        for envelope in envelopes if isinstance(envelopes, list) else [envelopes]:
            try:
                return verify_countersignature(envelope, trusted, signed)
            except BadSignature as e:
                if e.reason not in ("unknown_key", "revoked_key"):
                    raise
                untrusted.append(e.message)
        if self.allow_unverified:
            return None
        built_on = (signed.predicate.get("on_target") or {}).get("built_on")
        raise BadSignature("unverified_on_target", f"artifact {signed.key} was built for {signed.target} on "
                           f"{built_on} and not run on {signed.target}, and no trusted key countersigned a check "
                           f"there{' (' + '; '.join(untrusted)[:400] + ')' if untrusted else ''}: wait for a worker "
                           "that serves it to check it, or take it unverified (allow_unverified=True, "
                           "--allow-unverified)", kid=signed.kid)


@dataclass(frozen=True)
class Asked:
    """What a caller asked the service for when it answered with an artifact (a lookup, or a reference resolved for
    a load): the model, the target, the shapes (name -> a shape string, '4x32' or '1..8x3') and whether a train
    step. The service's answer is not signed; the manifest is, and `expect` holds it to the question, so that a
    hostile service cannot answer with another validly signed artifact (another model's, another target's, one
    built for other shapes, a train step for an inference load). None of a field: not asked, not compared."""

    model_id: str | None = None
    target: str | None = None  # a lookup's: the signed target must match it (compiler.targets.Target.matches)
    host: str | None = None  # a pick's: the signed target must run on this host (a lower x86-64 level does)
    shapes: Mapping[str, str] = field(default_factory=dict)
    training: bool | None = None
    how: str = "the lookup"  # what asked, for messages: "the lookup", "the reference 'bert:prod'"

    def expect(self, signed: Manifest) -> None:
        """BadSignature (`mismatch`) unless the signed factors answer this question."""
        factors = signed.predicate.get("factors")
        f: dict[str, Any] = factors if isinstance(factors, dict) else {}

        def refuse(what: str) -> BadSignature:
            return BadSignature("mismatch", f"artifact {signed.key} does not answer what {self.how} asked: {what}; "
                                            "the service answered with another artifact than the one asked for",
                                kid=signed.kid)

        if self.model_id is not None and f.get("model") != self.model_id:
            raise refuse(f"it is signed as built from model {str(f.get('model'))[:12]}, not {self.model_id[:12]}")
        if self.target is not None:
            try:
                fits = Target.parse(self.target).matches(str(signed.target))
            except AotcError:
                fits = False
            if not fits:
                raise refuse(f"it is signed for target {signed.target}, not {self.target}")
        if self.host is not None:
            try:
                why = Target.parse(str(signed.target)).cannot_run_on(Target.parse(self.host))
            except AotcError as e:
                why = str(e)
            if why:
                raise refuse(f"it is signed for target {signed.target}, which cannot run on {self.host} ({why})")
        mode = (f.get("options") or {}).get("mode") if isinstance(f.get("options"), dict) else None
        if self.training is not None and (mode == "training") != self.training:
            raise refuse(f"it is signed as {'a train step' if mode == 'training' else 'an inference package'}, "
                         f"not {'a train step' if self.training else 'an inference package'}")
        if self.shapes:
            spec = f.get("spec")
            held = {str(i.get("name")): i.get("shape") for i in spec if isinstance(i, dict)} \
                if isinstance(spec, list) else {}
            for name, text in self.shapes.items():
                if not _covers(held.get(name), parse_shape(text)):
                    shape = held.get(name)
                    raise refuse(f"input {name!r} is signed as "
                                 f"{format_shape(shape) if isinstance(shape, list) else 'absent'}, which does not "
                                 f"take {text}")


def _covers(have: Any, want: list[Any]) -> bool:
    """Whether a signed input shape takes `want` (compiler.shapes.covers, for one input)."""
    try:
        return isinstance(have, list) and covers([{"shape": have}], [want])
    except (KeyError, TypeError):
        return False


def adopt(signed: Manifest, meta: dict[str, Any]) -> None:
    """Put the signed facts in place of the service record's in `meta`, which is the service's and may have been
    rewritten in its store: the inputs and shapes the package takes (`spec`, what picks a bucket for a call and
    guards a CUDA graph's replay), the compile factors (the ISA pin the target check reads), the target and the
    worker that built it. A record that lied about its spec once sent a batch of 1 to a package built for 4, which
    read three rows past the caller's tensor and returned them (AOTInductor checks no input shapes by default)."""
    p = signed.predicate
    factors = p.get("factors")
    if isinstance(factors, dict):
        meta["factors"] = dict(factors)
        if isinstance(factors.get("spec"), list):
            meta["spec"] = factors["spec"]
    if signed.target:
        meta["target"] = signed.target
    if isinstance(p.get("worker"), dict):
        held = meta.get("worker")
        meta["worker"] = {**(held if isinstance(held, dict) else {}), **p["worker"]}


def check_file(signed: Manifest, path: Path, want: Want | None = None) -> None:
    """BadSignature unless the file at `path` has the signed digest and size (`want`: signed.want)."""
    want = want or signed.want
    check_digest(signed, file_digest(path, want.algorithm), path.stat().st_size, want)


def check_digest(signed: Manifest, hexdigest: str, size: int, want: Want | None = None) -> None:
    """BadSignature unless a download's digest (by `want.algorithm`: the signed one verified fastest here, BLAKE3
    or sha256; compiler/digests.py) and size are the signed ones."""
    want = want or signed.want
    if not want.matches(hexdigest, size):
        raise BadSignature("mismatch", f"artifact {signed.key} arrived corrupt or tampered with: {want.algorithm} "
                                       f"{hexdigest} ({size} bytes), but its signed manifest says {want.hexdigest} "
                                       f"({want.size} bytes)", kid=signed.kid)


def check_here(package: Path, model: Path, signed: Manifest, device: str) -> dict[str, Any]:
    """`aotc pull --verify`: the artifact check (compiler/check.py: the package against the exported program run
    eagerly, at every point of its spec) on this machine, for a package its builder did not run on this target.
    `model` must be the program it was built from (its sha256 is the signed model_sha256). Imports torch.

    It records nothing on the service: a pull key must not be able to vouch for a package to every other client,
    and a client's own check is only as good as the client. A fleet that wants a check on target shared runs a
    worker that serves the target natively; its countersignature is what other clients believe."""
    with open(model, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    built_from = str(signed.predicate.get("model_sha256"))
    if sha256 != built_from:
        raise BadSignature("mismatch", f"{model} (sha256 {sha256[:16]}...) is not the program artifact {signed.key} "
                                       f"was built from (its manifest signs {built_from[:16]}...)", kid=signed.kid)
    from compiler.check import check_artifact  # torch: only here

    factors = signed.predicate.get("factors") or {}
    options = factors.get("options") or {}
    # The adversarial inputs are the builder's part (the bounds are in the code whatever the host); what differs on
    # this target is whether the code it runs computes what eager does.
    return check_artifact(str(model), str(package), factors["spec"], device,
                          precision=str(options.get("precision", "keep")),
                          allow_nonfinite=bool(options.get("allow_nonfinite", False)), graphs=False, adversarial=False)


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
