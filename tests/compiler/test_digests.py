"""compiler/digests.py: which signed digest a client verifies, and that each way of hashing a file agrees with the
reference implementations (hashlib's sha256, blake3's one-shot hash)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import blake3
import pytest

from compiler import digests
from compiler.digests import Want

DATA = os.urandom(3 * (1 << 20) + 12345)  # more than one block of every loop, and not a multiple of any
SHA = hashlib.sha256(DATA).hexdigest()
B3 = blake3.blake3(DATA).hexdigest()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "f.bin"
    p.write_bytes(DATA)
    return p


def test_every_way_of_hashing_a_file_agrees_with_the_reference(path: Path, tmp_path: Path) -> None:
    assert digests.file_digests(path) == {"sha256": SHA, "blake3": B3}
    assert digests.file_digest(path, "sha256") == SHA
    assert digests.file_digest(path, "blake3") == B3  # every core, through an mmap
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert digests.file_digest(empty, "blake3") == blake3.blake3(b"").hexdigest()  # an mmap of nothing fails
    for algorithm in ("sha256", "blake3"):  # a resumed pull: a prefix, then the rest as it arrives
        h = digests.prefix(path, 1_000_001, algorithm)
        h.update(DATA[1_000_001:])
        assert h.hexdigest() == {"sha256": SHA, "blake3": B3}[algorithm]
        assert digests.new(algorithm, threads=True).hexdigest() == digests.new(algorithm).hexdigest()


def test_a_client_verifies_the_signed_blake3_else_sha256(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(digests.ENV, raising=False)
    assert Want.of({"sha256": SHA, "blake3": B3}, len(DATA)) == Want(SHA, len(DATA), "blake3", B3)
    # Signed before BLAKE3: sha256.
    assert Want.of({"sha256": SHA}, 5) == Want(SHA, 5, "sha256", SHA)
    # A BLAKE3 that is not one (not 64 lowercase hex digits; only a trusted signer could have signed it): sha256.
    for odd in (B3.upper(), B3[:-1], 7, None, ""):
        assert Want.of({"sha256": SHA, "blake3": odd}, 5).algorithm == "sha256"
    # Asked for: sha256 though BLAKE3 is signed; a value it does not know leaves the default.
    monkeypatch.setenv(digests.ENV, "sha256")
    assert Want.of({"sha256": SHA, "blake3": B3}, 5).algorithm == "sha256"
    monkeypatch.setenv(digests.ENV, "md5")
    assert Want.of({"sha256": SHA, "blake3": B3}, 5).algorithm == "blake3"


def test_without_the_blake3_module_sha256_is_verified(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """A platform without blake3's wheel: the SDK verifies sha256, and the worker signs sha256 alone."""
    monkeypatch.delenv(digests.ENV, raising=False)
    monkeypatch.setattr(digests, "_blake3", None)
    assert digests.available() == ("sha256",)
    assert Want.of({"sha256": SHA, "blake3": B3}, 5).algorithm == "sha256"
    assert digests.file_digests(path) == {"sha256": SHA}
    with pytest.raises(ValueError, match="blake3 module is not installed"):
        digests.new("blake3")


def test_want_matches_digest_and_size_together() -> None:
    want = Want(SHA, 10, "blake3", B3)
    assert want.matches(B3, 10)
    assert not want.matches(B3, 11) and not want.matches(SHA, 10)
