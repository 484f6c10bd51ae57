"""Content digests of packages and weights blobs: sha256, and BLAKE3 where the `blake3` module is installed.
Torch-free: the worker signs both, the SDK verifies the fastest one it can compute.

Why two. sha256 names things (a weights blob's file and store key, the record's `sha256`, an HTTP ETag, the C++
client's check: examples/cpp/verify.cpp) and stays. But it is sequential and, even with the CPU's SHA extensions,
about 1.2-1.6 GB/s on one core of the 2-core box, where BLAKE3 runs at 5.2 GB/s on one core (9.3 GB/s on two):
so a verified pull spent most of its client CPU hashing (bench/README.md, "Verified pull by splice"). A manifest
signs both digests of each file (`subject.digest` and the weights' `blake3`), so a client that verifies either one
holds the file to the same signature; BLAKE3 is a cryptographic hash of 256 bits with 128-bit collision
resistance, as sha256. Manifests signed before this carry sha256 only, and are verified by it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

SHA256 = "sha256"
BLAKE3 = "blake3"
# The order of preference: the first one that a manifest signs and this process can compute is verified.
PREFERENCE = (BLAKE3, SHA256)
HEX_LENGTH = {SHA256: 64, BLAKE3: 64}
# AOTC_PULL_DIGEST=sha256 makes the SDK verify sha256 where a manifest signs both (a comparison in bench/, or a
# client that wants only the older hash); the default takes the fastest signed one.
ENV = "AOTC_PULL_DIGEST"

_blake3: Any
try:
    import blake3 as _blake3
except ImportError:  # a platform without its wheel: sha256 alone, as before
    _blake3 = None


def available() -> tuple[str, ...]:
    """The algorithms this process can compute, preferred first."""
    return PREFERENCE if _blake3 is not None else (SHA256,)


def new(algorithm: str, *, threads: bool = False) -> Any:
    """A fresh hasher (`update`, `hexdigest`). `threads`: BLAKE3 may hash one large update on every core (a file
    read whole); a pull's hashing thread keeps to one, beside the thread that receives."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == BLAKE3 and _blake3 is not None:
        return _blake3.blake3(max_threads=_blake3.blake3.AUTO if threads else 1)
    raise ValueError(f"no {algorithm} hasher here" + (" (the blake3 module is not installed)"
                                                       if algorithm == BLAKE3 else ""))


class Want(NamedTuple):
    """What a file must be: its `size`, and its digest by `algorithm` (`hexdigest`); `sha256` names it (a cache
    record, an ETag) whichever algorithm checks it."""

    sha256: str
    size: int
    algorithm: str
    hexdigest: str

    @classmethod
    def of(cls, digests: Mapping[str, Any], size: int) -> Want:
        """The signed `digests` ({algorithm: hex}, sha256 among them) of a file of `size` bytes, checked by the
        first of PREFERENCE that is signed (a well-formed hex string) and computable here, unless AOTC_PULL_DIGEST
        names one."""
        sha = str(digests[SHA256])
        forced = os.environ.get(ENV, "").strip().lower()
        order = (forced,) if forced in PREFERENCE else PREFERENCE
        for algorithm in order:
            value = digests.get(algorithm)
            if algorithm in available() and _hex(value, HEX_LENGTH[algorithm]):
                return cls(sha, size, algorithm, str(value))
        return cls(sha, size, SHA256, sha)

    def matches(self, hexdigest: str, size: int) -> bool:
        return (hexdigest, size) == (self.hexdigest, self.size)


def _hex(value: Any, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def file_digest(path: Path, algorithm: str) -> str:
    """The digest of the file at `path` (BLAKE3 on every core, through an mmap; sha256 through hashlib)."""
    if algorithm == BLAKE3 and os.path.getsize(path):
        h = new(BLAKE3, threads=True)
        h.update_mmap(str(path))
        return str(h.hexdigest())
    with open(path, "rb") as f:
        if algorithm == SHA256:
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = new(algorithm)
        return str(h.hexdigest())  # an empty file


def file_digests(path: Path) -> dict[str, str]:
    """Every digest this process can compute of the file at `path` (what a manifest signs), in one read of it: the
    blocks sha256 reads feed BLAKE3 too."""
    hashers = {a: new(a) for a in available()}
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            for h in hashers.values():
                h.update(block)
    return {a: str(h.hexdigest()) for a, h in hashers.items()}


def prefix(path: Path, n: int, algorithm: str) -> Any:
    """A hasher fed the first `n` bytes of `path`, to go on hashing what a resumed pull appends."""
    h = new(algorithm)
    with open(path, "rb") as f:
        while n > 0 and (piece := f.read(min(n, 1 << 20))):
            h.update(piece)
            n -= len(piece)
    return h
