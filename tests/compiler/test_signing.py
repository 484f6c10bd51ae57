"""Signed manifests (compiler/signing.py) and the SDK's trusted keys (client/verify.py): the DSSE encoding, signing
and verifying, and each way a manifest is refused. tests/e2e/test_signed_artifacts.py does it with a real service."""

from __future__ import annotations

import base64
import hashlib
import json
import stat
import subprocess
import sys
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from client.verify import parse_trusted
from compiler.errors import BadSignature
from compiler.signing import (
    PAYLOAD_TYPE,
    Signer,
    TrustedKey,
    countersign_statement,
    key_id,
    key_record,
    load_public_key,
    pae,
    raw_public,
    statement,
    verify,
    verify_countersignature,
)
from procs import ROOT

KEY = "5f0c1d2e3a4b5c6d7e8f901a2b3c4d5e"
SHA = hashlib.sha256(b"package").hexdigest()


def _statement(**over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        artifact_key=KEY, package_sha256=SHA, package_size=7, model_sha256="ab" * 32,
        factors={"format": 1, "model": "ab" * 32, "target": "cpu-x86_64-avx2"}, toolchain={"torch": "2.13.0"},
        target="cpu-x86_64-avx2", check={"passed": True, "max_rel_err": 3e-8}, worker={"id": "w1", "host": "h"},
        signed_at=1_700_000_000.0)
    fields.update(over)
    return statement(**fields)


def _payload(envelope: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(base64.b64decode(envelope["payload"], validate=True)))


def _with_payload(envelope: dict[str, Any], st: dict[str, Any]) -> dict[str, Any]:
    """The same signatures over other bytes: what someone who can write Redis but holds no key can do."""
    return {**envelope, "payload": base64.b64encode(json.dumps(st).encode()).decode()}


def _refused(envelope: Any, trusted: Any) -> BadSignature:
    with pytest.raises(BadSignature) as got:
        verify(envelope, trusted)
    return got.value


def test_pae_is_dsse_v1_as_the_spec_writes_it():
    # The DSSE protocol's own example.
    assert pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    assert pae(PAYLOAD_TYPE, b"") == b"DSSEv1 28 application/vnd.in-toto+json 0 "


def test_a_signed_statement_verifies_and_the_envelope_is_plain_dsse():
    signer = Signer.generate()
    envelope = signer.sign(_statement())
    assert set(envelope) == {"payloadType", "payload", "signatures"}
    assert envelope["payloadType"] == "application/vnd.in-toto+json"
    [sig] = envelope["signatures"]
    assert sig["keyid"] == hashlib.sha256(raw_public(signer.public)).hexdigest()[:16] == signer.kid
    # Standard base64 with padding, and the signature is Ed25519 over PAE(payloadType, payload bytes): checked
    # here with cryptography directly, as the C++ example checks it with OpenSSL.
    body = base64.b64decode(envelope["payload"], validate=True)
    raw_sig = base64.b64decode(sig["sig"], validate=True)
    assert len(raw_sig) == 64
    signer.public.verify(raw_sig, b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(body), body))

    m = verify(envelope, [TrustedKey.of(signer.public)])
    assert m.kid == signer.kid and m.key == KEY and m.sha256 == SHA and m.size == 7
    st = m.statement
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == "https://aotc.dev/artifact-manifest/v1"
    assert st["subject"] == [{"name": KEY, "digest": {"sha256": SHA}}]
    assert st["predicate"]["signed_at"] == "2023-11-14T22:13:20Z"
    assert st["predicate"]["check"] == {"passed": True, "max_rel_err": 3e-8}
    m.expect(key=KEY, sha256=SHA, size=7)


def test_non_finite_check_values_stay_strict_json():
    envelope = Signer.generate().sign(_statement(check={"passed": True, "max_rel_err": float("nan"),
                                                        "worst": [float("inf")]}))
    body = base64.b64decode(envelope["payload"]).decode()
    assert "NaN" not in body and "Infinity" not in body
    assert _payload(envelope)["predicate"]["check"] == {"passed": True, "max_rel_err": "nan", "worst": ["inf"]}


def test_each_refusal_names_what_failed():
    signer, other = Signer.generate(), Signer.generate()
    trusted = {signer.kid: TrustedKey.of(signer.public)}
    good = signer.sign(_statement())

    for unsigned in (None, {}, {**good, "signatures": []}):
        assert _refused(unsigned, trusted).reason == "unsigned"
    assert _refused({**good, "payloadType": "application/json"}, trusted).reason == "malformed"
    assert _refused({**good, "payload": "not base64!"}, trusted).reason == "malformed"
    assert _refused([good], trusted).reason == "malformed"

    forged = other.sign(_statement())
    e = _refused(forged, trusted)
    assert (e.reason, e.kid) == ("unknown_key", other.kid) and f"unknown key {other.kid}" in e.message

    revoked = {signer.kid: TrustedKey(signer.kid, signer.public, revoked_at=1_700_000_000.0)}
    e = _refused(good, revoked)
    assert (e.reason, e.kid) == ("revoked_key", signer.kid)
    assert f"revoked key {signer.kid} (revoked at 2023-11-14T22:13:20Z)" in e.message

    edited = _payload(good)
    edited["predicate"]["check"]["passed"] = False
    e = _refused(_with_payload(good, edited), trusted)
    assert (e.reason, e.kid) == ("bad_signature", signer.kid) and "bad signature" in e.message
    swapped = _payload(good)
    swapped["subject"][0]["digest"]["sha256"] = "0" * 64
    assert _refused(_with_payload(good, swapped), trusted).reason == "bad_signature"
    # A keyid that names a trusted key does not make another key's signature pass.
    assert _refused({**forged, "signatures": [{**forged["signatures"][0], "keyid": signer.kid}]},
                    trusted).reason == "bad_signature"

    # Signed by a trusted key, but its subject and predicate disagree: refused all the same.
    e = _refused(signer.sign({**_statement(), "subject": [{"name": "0" * 32, "digest": {"sha256": SHA}}]}), trusted)
    assert e.reason == "mismatch"
    assert _refused(signer.sign({**_statement(), "predicateType": "https://example.com/x"}), trusted).reason == \
        "malformed"

    m = verify(good, trusted)
    for kw, what in (({"key": "1" * 32}, "signed for artifact"), ({"sha256": "1" * 64}, "package sha256"),
                     ({"size": 8}, "package size 8")):
        with pytest.raises(BadSignature, match=what) as got:
            m.expect(**kw)
        assert got.value.reason == "mismatch"


def test_rotation_any_trusted_signature_passes_and_a_keyid_is_only_a_hint():
    old, new = Signer.generate(), Signer.generate()
    st = _statement()
    by_old, by_new = old.sign(st), new.sign(st)
    both = [TrustedKey.of(old.public), TrustedKey.of(new.public)]
    assert verify(by_old, both).kid == old.kid and verify(by_new, both).kid == new.kid
    # Revoking the old key refuses what it signed and nothing else.
    rotated = [TrustedKey(old.kid, old.public, revoked_at=1.0), TrustedKey.of(new.public)]
    assert _refused(by_old, rotated).reason == "revoked_key"
    assert verify(by_new, rotated).kid == new.kid
    # Two signatures, one by a key nobody trusts: the trusted one carries it.
    twice = {**by_new, "signatures": [*Signer.generate().sign(st)["signatures"], *by_new["signatures"]]}
    assert verify(twice, rotated).kid == new.kid
    # DSSE does not sign keyid: without one, each trusted key is tried.
    assert verify({**by_new, "signatures": [{"sig": by_new["signatures"][0]["sig"]}]}, rotated).kid == new.kid


def test_public_keys_read_from_pem_or_raw_base64():
    signer = Signer.generate()
    pem = signer.public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    raw64 = base64.b64encode(raw_public(signer.public))
    assert key_id(load_public_key(pem)) == key_id(load_public_key(raw64)) == signer.kid
    private = signer.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())
    with pytest.raises(ValueError, match="is a private key"):
        load_public_key(private)
    with pytest.raises(ValueError, match="decodes to 31 bytes"):
        load_public_key(base64.b64encode(b"x" * 31))
    record = key_record(signer.public, created=5.0)
    assert record == {"kid": signer.kid, "algorithm": "ed25519", "public_key": raw64.decode(), "created": 5.0,
                      "revoked_at": None}
    assert TrustedKey.from_record(record).kid == signer.kid
    with pytest.raises(ValueError, match="wrong id"):
        TrustedKey.from_record({**record, "kid": "0" * 16})


def test_a_key_file_is_made_private_once_and_then_reused(tmp_path):
    path = tmp_path / "data" / "signing" / "worker-ed25519.pem"
    made = Signer.from_file(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert b"BEGIN PRIVATE KEY" in path.read_bytes()
    assert Signer.from_file(path, create=True).kid == Signer.from_file(path).kid == made.kid
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    other = tmp_path / "rsa.pem"
    other.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    with pytest.raises(ValueError, match="not an unencrypted PEM private key"):
        Signer.from_file(other)


def test_trusted_keys_from_files_and_kid_entries(tmp_path):
    a, b, c = Signer.generate(), Signer.generate(), Signer.generate()
    pem = tmp_path / "a.pub"
    pem.write_bytes(a.public.public_bytes(serialization.Encoding.PEM,
                                          serialization.PublicFormat.SubjectPublicKeyInfo))
    raw = tmp_path / "b.pub"
    raw.write_text(base64.b64encode(raw_public(b.public)).decode() + "\n")
    c64 = base64.b64encode(raw_public(c.public)).decode()
    pins = parse_trusted(f"{pem}, {raw},{c.kid}={c64}")
    assert set(pins) == {a.kid, b.kid, c.kid}
    assert set(parse_trusted([str(pem)])) == {a.kid}

    for bad, why in ((f"{a.kid}={c64}", f"that key's id is {c.kid}"), (str(tmp_path / "missing.pub"), "missing.pub"),
                     (" , ", "name no key")):
        with pytest.raises(BadSignature, match=why) as got:
            parse_trusted(bad)
        assert got.value.reason == "trusted_keys"


def test_a_raw_ed25519_key_from_elsewhere_verifies_too():
    """A key made outside aotc (e.g. by openssl) signs manifests a pinned client accepts."""
    key = Ed25519PrivateKey.generate()
    envelope = Signer(key).sign(_statement())
    assert verify(envelope, [TrustedKey.of(key.public_key())]).key == KEY


def test_the_signing_modules_import_no_torch():
    code = "import sys, compiler.signing, client.verify; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_serving_process_imports_no_compile_options():
    """What a server imports to pull and verify (client.sdk, compiler.signing) stays off the compile options' pydantic
    models (compiler.options, through compiler.cachekey): about 100 ms of its time to first inference on 2 cores.
    The canonical JSON that signatures cover lives in compiler.canonical for that."""
    code = ("import sys; from client.sdk import Client; import compiler.signing; "
            "print(sorted(m for m in ('compiler.options', 'compiler.cachekey', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[]", done.stdout


# -- countersignatures (compiler/ontarget.py) ----------------------------------------------------------------------


def _blind_manifest(builder: Signer) -> tuple[dict[str, Any], Any]:
    """A v3 manifest its v4 builder signed as not run on target, verified."""
    envelope = builder.sign(_statement(target="cpu-x86_64-v3", on_target={"run": False, "built_on": "cpu-x86_64-v4"}))
    return envelope, verify(envelope, [TrustedKey.of(builder.public)])


def test_a_manifest_signs_that_its_package_did_not_run_on_target():
    builder = Signer.generate()
    _, signed = _blind_manifest(builder)
    assert signed.run_on_target is False and signed.target == "cpu-x86_64-v3"
    assert signed.predicate["on_target"] == {"run": False, "built_on": "cpu-x86_64-v4"}
    plain = verify(builder.sign(_statement()), [TrustedKey.of(builder.public)])
    assert plain.run_on_target is True  # native builds, and every manifest from before the mark
    assert signed.payload_sha256 != plain.payload_sha256 and len(signed.payload_sha256) == 64


def test_a_countersignature_vouches_for_one_manifest_by_a_trusted_key():
    builder, checker = Signer.generate(), Signer.generate()
    _, signed = _blind_manifest(builder)
    trusted = [TrustedKey.of(builder.public), TrustedKey.of(checker.public)]
    cs = checker.sign(countersign_statement(manifest=signed, checked_on="cpu-x86_64-v3", check={"passed": True},
                                            verifier={"id": "w2"}))
    got = verify_countersignature(cs, trusted, signed)
    assert got.kid == checker.kid and got.predicate["manifest_sha256"] == signed.payload_sha256

    # Another manifest of the same package (e.g. with other weights or factors): this countersignature is not its.
    other_env = builder.sign(_statement(target="cpu-x86_64-v3", factors={"format": 2},
                                        on_target={"run": False, "built_on": "cpu-x86_64-v4"}))
    other = verify(other_env, trusted)
    with pytest.raises(BadSignature) as e:
        verify_countersignature(cs, trusted, other)
    assert e.value.reason == "mismatch" and "manifest_sha256" in e.value.message

    # A check that did not pass vouches for nothing; a key not trusted neither; a changed byte is a bad signature.
    failed = checker.sign(countersign_statement(manifest=signed, checked_on="cpu-x86_64-v3",
                                                check={"passed": False}, verifier={"id": "w2"}))
    assert _countersign_refused(failed, trusted, signed).reason == "mismatch"
    assert _countersign_refused(cs, [TrustedKey.of(builder.public)], signed).reason == "unknown_key"
    forged = _with_payload(cs, {**_payload(cs), "predicate": {**_payload(cs)["predicate"], "check": {"passed": True,
                                                                                                     "max": 0}}})
    assert _countersign_refused(forged, trusted, signed).reason == "bad_signature"
    revoked = [TrustedKey.of(builder.public), TrustedKey.of(checker.public, revoked_at=1.0)]
    assert _countersign_refused(cs, revoked, signed).reason == "revoked_key"
    # A builder's manifest is not a countersignature, even by a trusted key.
    assert _countersign_refused(builder.sign(_statement()), trusted, signed).reason == "malformed"


def _countersign_refused(envelope: Any, trusted: Any, manifest: Any) -> BadSignature:
    with pytest.raises(BadSignature) as got:
        verify_countersignature(envelope, trusted, manifest)
    return got.value
