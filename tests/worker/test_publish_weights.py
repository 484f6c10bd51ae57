"""The worker's publish of a weights blob (worker/job.py `_weights_manifest`), without compiles: it signs what the
blob's header says, and refuses a package whose constants the check did not find bound to exactly that blob."""

from __future__ import annotations

import hashlib
from pathlib import Path

from compiler.errors import Failure
from compiler.weightsfile import write
from worker.job import _weights_manifest


def _blob(path: Path) -> Path:
    with open(path, "wb") as f:
        write(f, [("head.weight", "float32", (4, 16), b"\1" * 256), ("head.bias", "float32", (4,), b"\2" * 16)],
              {"aotc.strides": '{"head.weight": [1, 4]}'})
    return path


def test_a_blob_the_check_bound_is_signed_with_its_constants(tmp_path: Path) -> None:
    blob = _blob(tmp_path / "w.safetensors")
    check = {"weights": {"bound": "user_managed", "package_fqns": ["head.weight", "head.bias"]}}
    signed = _weights_manifest(blob, check)
    assert not isinstance(signed, Failure)
    assert signed["sha256"] == hashlib.sha256(blob.read_bytes()).hexdigest() and signed["size"] == blob.stat().st_size
    assert signed["constants"] == [{"fqn": "head.bias", "shape": [4], "dtype": "float32", "stride": [1]},
                                   {"fqn": "head.weight", "shape": [4, 16], "dtype": "float32", "stride": [1, 4]}]
    assert "package_fqns" not in check["weights"]  # compared, then kept out of the record


def test_publish_refuses_constants_that_do_not_match_the_blob(tmp_path: Path) -> None:
    blob = _blob(tmp_path / "w.safetensors")
    frozen = _weights_manifest(blob, {"weights": {"package_fqns": ["head.weight"]}})
    assert isinstance(frozen, Failure) and frozen.type == "BadOutput" and frozen.stage == "publish"
    assert "do not match its weights blob" in frozen.message and "['head.bias']" in frozen.message
    unbound = _weights_manifest(blob, {"passed": True})
    assert isinstance(unbound, Failure) and "did not bind" in unbound.message
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    bad = _weights_manifest(tmp_path / "bad.safetensors", {"weights": {"package_fqns": []}})
    assert isinstance(bad, Failure) and "not a well-formed safetensors file" in bad.message
