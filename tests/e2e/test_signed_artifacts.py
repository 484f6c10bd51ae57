"""Signed artifacts with real parts: a worker signs what it publishes, the SDK and the CLI verify before they write or
load anything, and refuse what was tampered with in Redis (the package's bytes, the manifest, a manifest re-signed by
another key). Then rotation: a second key, the first revoked.

One service of its own (a Cluster), with the redis blob store so that the package's bytes are in Redis too, and two
compiles in all: one artifact per signing key."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization

from client import Client
from client.sdk import Artifact
from compiler.digests import file_digest
from compiler.errors import BadSignature
from compiler.signing import Signer, TrustedKey, raw_public, verify
from modelzoo import MLP, seeded
from procs import ROOT, Cluster, api, stop
from service.store import keys

pytestmark = pytest.mark.slow


@dataclass
class Signed:
    cluster: Cluster
    art: Artifact
    model: torch.nn.Module
    key_path: Path  # the key the first worker made for itself
    worker: subprocess.Popen[bytes]


def _client(svc: Signed, tmp: Path, **kw: Any) -> Client:
    return Client(svc.cluster.url, cache_dir=tmp / "cache", timeout=120, **kw)


def _compile(c: Client, seed: int) -> tuple[Artifact, torch.nn.Module]:
    model = seeded(MLP, seed, d_in=16, hidden=32, d_out=4)
    art = c.compile(model, (torch.randn(4, 16),), target="cpu", timeout=600)
    assert isinstance(art, Artifact)
    return art, model


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Signed]:
    base = tmp_path_factory.mktemp("signing")
    cluster = Cluster(base, env={"AOTC_BLOB_STORE": "redis"})
    try:
        worker, _ = cluster.start_worker()  # no AOTC_SIGNING_KEY_FILE: it makes its own key in the data dir
        with Client(cluster.url, cache_dir=base / "compile-cache", timeout=120) as c:
            art, model = _compile(c, 71)
        yield Signed(cluster, art, model, base / "signing" / "worker-ed25519.pem", worker)
    finally:
        cluster.close()


def _record(svc: Signed, key: str) -> dict[str, Any]:
    raw = svc.cluster.store.r.get(keys.artifact(key))
    assert raw
    return dict(json.loads(raw))


def _set_record(svc: Signed, record: dict[str, Any]) -> None:
    svc.cluster.store.r.set(keys.artifact(record["key"]), json.dumps(record, sort_keys=True, separators=(",", ":")))


def _refused(c: Client, key: str, dest: Path, reason: str) -> BadSignature:
    with pytest.raises(BadSignature) as got:
        c.pull(key, dest)
    assert got.value.reason == reason, got.value.message
    _nothing_written(c, dest)
    return got.value


def _nothing_written(c: Client, dest: Path) -> None:
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    held = c.cache_dir / "artifacts"
    assert not held.exists() or not list(held.iterdir()), list(held.iterdir())


def aotc(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.cli", "--url", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def _pin(key_path: Path) -> str:
    """AOTC_TRUSTED_KEYS's KID=BASE64 entry for the key in a private key file."""
    s = Signer.from_file(key_path)
    return f"{s.kid}={base64.b64encode(raw_public(s.public)).decode()}"


def test_the_worker_signs_what_it_publishes_and_the_sdk_verifies_it(signed: Signed, tmp_path: Path) -> None:
    key = signed.art.key
    # The key the worker made: private, in a private dir, and listed (public half only) by the service.
    assert stat.S_IMODE(signed.key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(signed.key_path.parent.stat().st_mode) == 0o700
    kid = Signer.from_file(signed.key_path).kid
    listed = api.get(f"{signed.cluster.url}/v1/signing-keys").json()["keys"]
    assert [(k["kid"], k["algorithm"], k["revoked_at"]) for k in listed] == [(kid, "ed25519", None)]

    envelope = api.get(f"{signed.cluster.url}/v1/artifacts/{key}/manifest").json()
    assert envelope == _record(signed, key)["manifest"]
    m = verify(envelope, [TrustedKey.from_record(listed[0])])
    meta = signed.art.meta
    assert m.kid == kid and m.key == key
    pred = m.predicate
    assert (pred["package_sha256"], pred["package_size"]) == (meta["sha256"], meta["size"])
    assert pred["model_sha256"] == meta["factors"]["model"] == meta["model_id"]
    assert pred["factors"] == meta["factors"] and pred["target"] == meta["target"]
    assert pred["toolchain"] == meta["factors"]["toolchain"]
    assert pred["check"]["passed"] is True and pred["worker"]["id"] == meta["worker"]["id"]

    with _client(signed, tmp_path) as c:
        path = c.pull(key, tmp_path / "out.pt2")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]
        # Both digests signed; the SDK verifies BLAKE3, the faster (compiler/digests.py).
        assert m.statement["subject"][0]["digest"] == {"sha256": meta["sha256"],
                                                       "blake3": file_digest(path, "blake3")}
        assert m.want.algorithm == "blake3"
        fn = c.load(key)  # from the cache, verified again
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), signed.model(x), rtol=1e-4, atol=1e-5)

    unknown = api.get(f"{signed.cluster.url}/v1/artifacts/{'0' * 32}/manifest")
    assert unknown.status_code == 404


def test_a_load_by_key_asks_for_the_manifest_once_beside_the_record(signed: Signed, tmp_path: Path) -> None:
    """The round trips before a pull's first byte: the record, the manifest and the keys trusted now. A load by key
    asks for the last two on the verifier's threads while it waits for the record, and binds the weights blob by the
    manifest it verified for the package (it asked for it twice before, and for the keys twice)."""
    assert signed.art.meta.get("weights"), "a weightless artifact, whose blob the load binds"
    seen: list[tuple[str, str]] = []
    with _client(signed, tmp_path) as c:
        c.http.event_hooks["request"].append(
            lambda request: seen.append((request.url.path, threading.current_thread().name)))
        fn = c.load(signed.art.key)
        main = threading.current_thread().name
        asked = [path for path, _ in seen]
        key = signed.art.key
        assert asked.count(f"/v1/artifacts/{key}/meta") == 1
        assert asked.count(f"/v1/artifacts/{key}/manifest") == 1
        assert asked.count("/v1/signing-keys") == 1
        by = dict(seen)
        assert by[f"/v1/artifacts/{key}/meta"] == main
        assert by[f"/v1/artifacts/{key}/manifest"].startswith("aotc-verify")
        assert by["/v1/signing-keys"].startswith("aotc-verify")
        x = torch.randn(4, 16)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), signed.model(x), rtol=1e-4, atol=1e-5)
        # A pull by key asks for each once too, and a revocation still applies to the next one (the keys are asked
        # for per verification, never remembered).
        seen.clear()
        c.pull(key, tmp_path / "again.pt2")
        assert sorted(path for path, _ in seen) == sorted([f"/v1/artifacts/{key}/meta",
                                                          f"/v1/artifacts/{key}/manifest", "/v1/signing-keys"])


def test_an_unsigned_record_is_refused_with_a_clear_message(signed: Signed, tmp_path: Path) -> None:
    key = signed.art.key
    record = _record(signed, key)
    try:
        _set_record(signed, {k: v for k, v in record.items() if k != "manifest"})
        r = api.get(f"{signed.cluster.url}/v1/artifacts/{key}/manifest")
        assert r.status_code == 404
        assert r.json()["error"]["message"] == f"artifact {key} is unsigned: published before signing, recompile it"
        with _client(signed, tmp_path) as c:
            e = _refused(c, key, tmp_path / "out.pt2", "unsigned")
        assert "published before signing" in e.message
    finally:
        _set_record(signed, record)


def test_tampered_package_bytes_in_redis_are_refused_and_nothing_is_written(signed: Signed, tmp_path: Path) -> None:
    key, store = signed.art.key, signed.cluster.store
    record = _record(signed, key)
    blob = store.artifacts.blob_id(record)
    layout = store.r.hgetall(keys.blob("artifact", blob))
    chunk = keys.blob_chunk("artifact", blob, 0, str(layout.get("gen") or ""))
    original = store.raw.get(chunk)
    assert original and len(original) > 4096
    tampered = original[:4096] + bytes(b ^ 0xFF for b in original[4096:4160]) + original[4160:]
    try:
        store.raw.set(chunk, tampered)
        dest = tmp_path / "out.pt2"
        with _client(signed, tmp_path) as c:
            e = _refused(c, key, dest, "mismatch")
            subject = json.loads(base64.b64decode(record["manifest"]["payload"]))["subject"][0]
            signed_blake3 = subject["digest"]["blake3"]
            assert "arrived corrupt or tampered with: blake3" in e.message and signed_blake3 in e.message
            # Whoever swaps the bytes rewrites the record's sha256 too: refused before a byte is downloaded.
            _set_record(signed, {**record, "sha256": hashlib.sha256(tampered).hexdigest()})
            e = _refused(c, key, dest, "mismatch")
            assert "does not match the signed manifest" in e.message
            with pytest.raises(BadSignature):
                c.load(key)
            _nothing_written(c, dest)

        done = aotc(signed.cluster.url, "pull", key, "-o", str(dest), AOTC_CACHE_DIR=str(tmp_path / "cli-cache"))
        assert done.returncode == 3, done.stderr
        assert f"refused artifact {key}" in done.stderr and "signed manifest" in done.stderr
        assert not dest.exists() and not list((tmp_path / "cli-cache").rglob("*.pt2*"))
    finally:
        store.raw.set(chunk, original)
        _set_record(signed, record)
    with _client(signed, tmp_path / "after") as c:  # restored: verifies again
        assert c.pull(key).stat().st_size == record["size"]


def test_a_tampered_manifest_is_refused(signed: Signed, tmp_path: Path) -> None:
    key = signed.art.key
    record = _record(signed, key)
    envelope = record["manifest"]
    statement = json.loads(base64.b64decode(envelope["payload"]))

    def with_statement(st: dict[str, Any]) -> dict[str, Any]:
        return {**envelope, "payload": base64.b64encode(json.dumps(st).encode()).decode()}

    better = json.loads(json.dumps(statement))
    better["predicate"]["check"]["max_rel_err"] = 0.0  # a predicate edit
    other = json.loads(json.dumps(statement))
    other["subject"][0]["digest"]["sha256"] = other["predicate"]["package_sha256"] = "0" * 64  # a subject edit
    try:
        with _client(signed, tmp_path) as c:
            for edited in (better, other):
                _set_record(signed, {**record, "manifest": with_statement(edited)})
                e = _refused(c, key, tmp_path / "out.pt2", "bad_signature")
                assert "bad signature" in e.message
                with pytest.raises(BadSignature, match="bad signature"):
                    c.load(key)
                _nothing_written(c, tmp_path / "out.pt2")
        done = aotc(signed.cluster.url, "pull", key, "-o", str(tmp_path / "cli.pt2"),
                    AOTC_CACHE_DIR=str(tmp_path / "cli-cache"))
        assert done.returncode == 3 and "bad signature" in done.stderr, done.stderr
        assert not (tmp_path / "cli.pt2").exists()
    finally:
        _set_record(signed, record)


def test_a_record_that_lies_about_shapes_cannot_make_the_package_read_past_its_input(signed: Signed,
                                                                                     tmp_path: Path) -> None:
    """The record is the service's, and its `spec` is not signed. It once chose the inputs a package was given: a
    record saying batch 1 about a package built for batch 4 had a 1-row tensor read as 4 rows, the 3 past its end
    returned as outputs (AOTInductor checks no input shapes by default). Now the signed spec replaces the record's
    once the manifest verifies, and every call's inputs are checked against it before the package runs."""
    key = signed.art.key
    record = _record(signed, key)
    forged = json.loads(json.dumps(record))
    forged["spec"] = [{**inp, "shape": [1, *inp["shape"][1:]]} for inp in record["spec"]]
    forged["factors"]["spec"] = forged["spec"]  # the record's own copy of the factors is unsigned too
    _set_record(signed, forged)
    try:
        with _client(signed, tmp_path) as c:
            art = c.artifact(key)
            assert art.meta["spec"][0]["shape"][0] == 1  # what the service now says
            fn = c.load(art)
            assert art.meta["spec"] == record["spec"]  # what the worker signed
            assert art.meta["factors"] == record["factors"]
        x = torch.randn(4, 16)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), signed.model(x), rtol=1e-4, atol=1e-5)
            with pytest.raises(ValueError, match=r"dim 0 is 1; the package was built for 4"):
                fn(torch.randn(1, 16))
            with pytest.raises(ValueError, match=r"less storage"):
                fn(torch.randn(1, 16).expand(4, 16))  # the right shape over one row's storage
            with pytest.raises(ValueError, match=r"is float64; the package was built for float32"):
                fn(torch.randn(4, 16, dtype=torch.float64))
            with pytest.raises(ValueError, match=r"takes 1 input tensor"):
                fn(x, x)
    finally:
        _set_record(signed, record)


def test_a_lookup_or_a_pick_answered_with_another_artifact_is_refused(signed: Signed, tmp_path: Path) -> None:
    """The service's answer to a lookup or a pick is not signed. A hostile one (here: its Redis rewritten) answered
    another model's lookup with this validly signed artifact, and a lookup for shapes it was not built for with a
    record that claimed a range; the client pulled and ran it. Now the manifest is held to the question (the model,
    the target, the shapes, inference; client/verify.py `Asked`) before a byte is written."""
    r = signed.cluster.store.r
    key = signed.art.key
    record = _record(signed, key)
    x = torch.randn(4, 16)
    with _client(signed, tmp_path) as c:
        # 1. Another model's lookup, and a pick of a version of it, answered with this artifact.
        other = c.upload(seeded(MLP, 72, d_in=16, hidden=32, d_out=4), (x,), name="other")["id"]
        assert other != record["model_id"]
        r.sadd(keys.artifacts_by_model(other), key)
        try:
            art = c.lookup(other, {"x": x}, "cpu")
            assert art is not None and art.key == key  # the service answered with it
            with pytest.raises(BadSignature) as got:
                c.pull(art, tmp_path / "out.pt2")
            assert got.value.reason == "mismatch"
            assert f"signed as built from model {record['model_id'][:12]}, not {other[:12]}" in got.value.message
            _nothing_written(c, tmp_path / "out.pt2")
            c.add_version("other", other)
            with pytest.raises(BadSignature, match=r"does not answer what the reference 'other@1' asked"):
                c.load("other@1", shapes={"x": x})
            _nothing_written(c, tmp_path / "out.pt2")
        finally:
            r.srem(keys.artifacts_by_model(other), key)
        # 2. Its own model's lookup for a batch it was not built for, answered by records (the model's and the
        # artifact's) that claim a range.
        forged = json.loads(json.dumps(record))
        forged["spec"] = [{**inp, "shape": [{"min": 1, "max": 8}, *inp["shape"][1:]]} for inp in record["spec"]]
        forged["factors"]["spec"] = forged["spec"]
        model_raw = r.get(keys.model(record["model_id"]))
        assert model_raw
        model = json.loads(model_raw)
        model["inputs"] = [{**inp, "shape": [{"min": 1, "max": 8}, *inp["shape"][1:]]} for inp in model["inputs"]]
        r.set(keys.model(record["model_id"]), json.dumps(model))
        _set_record(signed, forged)
        try:
            art = c.lookup(record["model_id"], {"x": torch.randn(2, 16)}, "cpu")
            assert art is not None and art.key == key
            with pytest.raises(BadSignature, match=r"input 'x' is signed as 4x16, which does not take 2x16"):
                c.load(art)
            _nothing_written(c, tmp_path / "out.pt2")
        finally:
            _set_record(signed, record)
            r.set(keys.model(record["model_id"]), model_raw)
        # The honest answer to the same question still loads and runs.
        art = c.lookup(record["model_id"], {"x": x}, "cpu")
        assert art is not None and art.key == key
        fn = c.load(art)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), signed.model(x), rtol=1e-4, atol=1e-5)


def test_a_key_that_is_not_a_key_is_refused_before_it_names_a_url_or_a_file(signed: Signed, tmp_path: Path) -> None:
    """A signed manifest names exactly the key it was asked for, and the pull makes the cache's file names from it.
    A worker made to sign a job whose key (in Redis) was `../../x` would have had pulls write outside the cache;
    the worker refuses to sign one (worker/job.py `_sign`), and the client refuses to ask for one."""
    with _client(signed, tmp_path) as c:
        for bad in ("../../escaped/evil", "/tmp/abs", signed.art.key + "\n", signed.art.key.upper(), ""):
            with pytest.raises(BadSignature) as got:
                c.verifier.manifest(bad, dict(signed.art.meta))
            assert got.value.reason == "malformed" and "is not an artifact key" in got.value.message
    assert not (tmp_path / "escaped").exists()


def test_a_manifest_resigned_by_another_key_is_refused_even_if_its_key_is_listed(signed: Signed,
                                                                                  tmp_path: Path) -> None:
    key, store = signed.art.key, signed.cluster.store
    record = _record(signed, key)
    statement = json.loads(base64.b64decode(record["manifest"]["payload"]))
    statement["predicate"]["check"]["passed"] = True
    attacker = Signer.generate()
    forged = attacker.sign(statement)
    pinned = _pin(signed.key_path)
    try:
        _set_record(signed, {**record, "manifest": forged})
        with _client(signed, tmp_path) as c:
            e = _refused(c, key, tmp_path / "out.pt2", "unknown_key")
            assert f"unknown key {attacker.kid}" in e.message
            with pytest.raises(BadSignature, match="unknown key"):
                c.load(key)
        # Whoever can write Redis can list their key too: then only a client that pins its keys still refuses.
        store.r.hset(keys.SIGNING_KEYS, attacker.kid, json.dumps({
            "kid": attacker.kid, "algorithm": "ed25519", "created": 1.0, "revoked_at": None,
            "public_key": base64.b64encode(raw_public(attacker.public)).decode()}))
        with _client(signed, tmp_path, trusted_keys=pinned) as c:
            assert _refused(c, key, tmp_path / "out.pt2", "unknown_key").kid == attacker.kid
        done = aotc(signed.cluster.url, "pull", key, "-o", str(tmp_path / "cli.pt2"),
                    AOTC_CACHE_DIR=str(tmp_path / "cli-cache"), AOTC_TRUSTED_KEYS=pinned)
        assert done.returncode == 3 and f"unknown key {attacker.kid}" in done.stderr, done.stderr
        assert not (tmp_path / "cli.pt2").exists()
        pem = tmp_path / "worker.pub"  # a pin by file works the same, and passes the real manifest
        pem.write_bytes(Signer.from_file(signed.key_path).public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        _set_record(signed, record)
        with _client(signed, tmp_path / "pinned", trusted_keys=str(pem)) as c:
            assert c.pull(key).stat().st_size == record["size"]
    finally:
        store.r.hdel(keys.SIGNING_KEYS, attacker.kid)
        _set_record(signed, record)


def test_rotation_a_new_key_signs_and_revoking_the_old_one_refuses_what_it_signed(signed: Signed,
                                                                                  tmp_path: Path) -> None:
    cluster, old_key = signed.cluster, signed.art.key
    old = Signer.from_file(signed.key_path)
    new_path = cluster.base / "keys" / "worker-2.pem"  # under the data dir, hidden from compile children
    new = Signer.from_file(new_path, create=True)
    stop(signed.worker)
    _, worker_id = cluster.start_worker(AOTC_SIGNING_KEY_FILE=str(new_path))
    with _client(signed, tmp_path / "compile") as c:
        art, model = _compile(c, 72)
    assert art.meta["worker"]["id"] == worker_id
    assert "manifest" not in art.meta  # meta and lookups leave it out: GET ./manifest serves it
    assert _record(signed, art.key)["manifest"]["signatures"][0]["keyid"] == new.kid

    with _client(signed, tmp_path / "both") as c:  # two active keys: each artifact verifies under its own
        assert {k["kid"]: k["revoked_at"] for k in c.verifier.keys()} == {old.kid: None, new.kid: None}
        assert c.pull(old_key).exists() and c.pull(art.key).exists()

    listing = aotc(cluster.url, "signing-keys")
    assert listing.returncode == 0 and old.kid in listing.stdout and new.kid in listing.stdout, listing.stderr
    revoked = aotc(cluster.url, "signing-keys", "--revoke", old.kid)
    assert revoked.returncode == 0 and revoked.stdout.strip() == f"revoked signing key {old.kid}", revoked.stderr
    rows = {ln.split()[0]: ln.split() for ln in aotc(cluster.url, "signing-keys").stdout.splitlines()[1:]}
    assert rows[new.kid][4] == "-" and rows[old.kid][4] != "-"  # KID ALGORITHM CREATED(2) REVOKED...
    assert api.delete(f"{cluster.url}/v1/signing-keys/{'0' * 16}").status_code == 404
    assert api.delete(f"{cluster.url}/v1/signing-keys/not-a-kid").status_code in (404, 422)

    pins = f"{_pin(signed.key_path)},{_pin(new_path)}"
    for trusted in (None, pins):  # the service's keys, and pins (the service's revocations still apply)
        with _client(signed, tmp_path / f"after-{trusted is None}", trusted_keys=trusted) as c:
            e = _refused(c, old_key, tmp_path / "old.pt2", "revoked_key")
            assert f"revoked key {old.kid}" in e.message
            fn = c.load(art.key)
        x = torch.randn(4, 16)
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)

    # A worker restarted with the revoked key refuses to start rather than sign what every client refuses.
    env = {k: v for k, v in cluster.worker_env.items() if k != "AOTC_SIGNING_KEY_FILE"}
    done = subprocess.run([sys.executable, "-m", "worker"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and f"signing key {old.kid}" in done.stderr and "was revoked" in done.stderr


