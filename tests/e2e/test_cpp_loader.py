"""The C++ loader example (examples/cpp), with real parts: a package compiled by a real worker and pulled with the SDK
is verified (the manifest's signature by the worker's key, the statement, the package's sha256 and size) and run by
the example, built against the torch wheel's libtorch; its outputs match Python's. Whatever fails verification is
refused before anything is loaded."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from client import Client
from compiler.signing import Signer, key_id
from compiler.weightsfile import sidecar
from cppbuild import CXX, build_aotc_run, save_verification
from modelzoo import MLP, seeded

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which(CXX) is None or shutil.which("make") is None,
                       reason=f"no C++ compiler ({CXX}) or make: the C++ example cannot be built"),
]


@pytest.fixture(scope="module")
def aotc_run() -> Path:
    return build_aotc_run()


@dataclass
class Pulled:
    key: str
    package: Path
    manifest: Path  # GET /v1/artifacts/{key}/manifest, as served
    signing_keys: Path  # GET /v1/signing-keys, as served
    trusted_key: Path  # the signing worker's public key, pinned: its raw 32 bytes in base64
    kid: str
    model: torch.nn.Module
    weights: Path | None = None  # a weightless package's weights blob (GET /v1/artifacts/{key}/weights)


@pytest.fixture(scope="module")
def pulled(api_url: str, dynamic_mlp: Any, tmp_path_factory: pytest.TempPathFactory) -> Pulled:
    """The session's dynamic-batch MLP (tests/e2e/conftest.py: compiled on the CPU for batches 1..64 by the session's
    worker), pulled, with its manifest and keys."""
    tmp = tmp_path_factory.mktemp("cpp")
    art = dynamic_mlp.art
    with Client(api_url, cache_dir=tmp / "cache", timeout=120) as c:
        package = c.pull(art, tmp / "mlp-cpu.pt2")
        weights = c.pull_weights(art, sidecar(package))
        assert weights is not None  # built weightless: the weights come as their own blob
    manifest, signing_keys, trusted_key, kid = save_verification(api_url, art.key, tmp)
    return Pulled(art.key, package, manifest, signing_keys, trusted_key, kid, dynamic_mlp.model, weights)


def run_cpp(exe: Path, p: Pulled, tmp: Path, x: torch.Tensor,
            **over: str | Path | None) -> subprocess.CompletedProcess[str]:
    """aotc_run on `x`, verifying against `p`'s files unless `over` replaces one (package=, manifest=, ...; None
    leaves the flag out)."""
    torch.save([x], tmp / "in.pt")
    flags = {"package": p.package, "artifact-key": p.key, "manifest": p.manifest, "trusted-key": p.trusted_key,
             "signing-keys": p.signing_keys, "inputs": tmp / "in.pt", "outputs": tmp / "out.pt",
             "weights": p.weights, **{k.replace("_", "-"): v for k, v in over.items()}}
    argv = [str(exe)] + [a for k, v in flags.items() if v is not None for a in (f"--{k}", str(v))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_cpp_example_verifies_loads_and_matches_python(aotc_run: Path, pulled: Pulled, client: Client,
                                                       tmp_path: Path) -> None:
    fn = client.load(pulled.key)  # Python's path: pull (verified), AOTInductor's loader in this process
    for b in (1, 5, 64):  # one artifact serves the dynamic range (1..64), in C++ as in Python
        x = torch.randn(b, 32)
        done = run_cpp(aotc_run, pulled, tmp_path, x)
        assert done.returncode == 0, done.stderr
        size = pulled.package.stat().st_size
        assert f"verified {pulled.key}: signed by key {pulled.kid}, {size} bytes" in done.stdout
        assert pulled.weights is not None and "verified weights: " in done.stdout and "bound " in done.stdout
        assert f"ran on Float[{b}, 32] -> Float[{b}, 8]" in done.stdout
        outs = torch.load(tmp_path / "out.pt", weights_only=True)
        assert isinstance(outs, tuple) and len(outs) == 1
        with torch.no_grad():
            torch.testing.assert_close(outs[0], fn(x))
            torch.testing.assert_close(outs[0], pulled.model(x), rtol=1e-4, atol=1e-5)


def _flip_a_byte(p: Pulled, tmp: Path) -> dict[str, Path]:
    data = bytearray(p.package.read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp / "tampered.pt2").write_bytes(bytes(data))
    return {"package": tmp / "tampered.pt2"}


def _truncate(p: Pulled, tmp: Path) -> dict[str, Path]:
    (tmp / "short.pt2").write_bytes(p.package.read_bytes()[:-1])
    return {"package": tmp / "short.pt2"}


def _resigned(p: Pulled, tmp: Path, *, claim_trusted_kid: bool) -> dict[str, Path]:
    """The served statement, unchanged, signed by a key nobody trusts (under its own id, or the trusted one's)."""
    import base64

    served = json.loads(p.manifest.read_bytes())
    other = Signer.generate()
    env = other.sign(json.loads(base64.b64decode(served["payload"])))
    assert env["signatures"][0]["keyid"] == key_id(other.public) != p.kid
    if claim_trusted_kid:
        env["signatures"][0]["keyid"] = p.kid
    (tmp / "other.json").write_text(json.dumps(env))
    return {"manifest": tmp / "other.json"}


def _revoked(p: Pulled, tmp: Path) -> dict[str, Path]:
    listed = json.loads(p.signing_keys.read_bytes())
    for k in listed["keys"]:
        if k["kid"] == p.kid:
            k["revoked_at"] = 1_800_000_000.0
    (tmp / "revoked.json").write_text(json.dumps(listed))
    return {"signing_keys": tmp / "revoked.json"}


def _not_run_on_target(p: Pulled, tmp: Path) -> dict[str, Path]:
    """The served statement, marked as a build its builder did not run on its target (compiler/ontarget.py), signed
    by a key the loader is told to trust: what the Python SDK refuses without a countersignature."""
    import base64

    from compiler.signing import b64, raw_public

    statement = json.loads(base64.b64decode(json.loads(p.manifest.read_bytes())["payload"]))
    statement["predicate"]["on_target"] = {"run": False, "built_on": "x86-64-v4"}
    other = Signer.generate()
    (tmp / "cross.json").write_text(json.dumps(other.sign(statement)))
    (tmp / "other.b64").write_text(b64(raw_public(other.public)))
    return {"manifest": tmp / "cross.json", "trusted_key": tmp / "other.b64", "signing_keys": None}


def _another_artifact(p: Pulled, tmp: Path) -> dict[str, str]:
    return {"artifact_key": "0" * 32}


def _tampered_weights(p: Pulled, tmp: Path) -> dict[str, Path]:
    assert p.weights is not None
    data = bytearray(p.weights.read_bytes())
    data[-1] ^= 0x01  # a weight's last byte: the header still parses, the digest does not match
    (tmp / "tampered.safetensors").write_bytes(bytes(data))
    return {"weights": tmp / "tampered.safetensors"}


REFUSALS: dict[str, tuple[Callable[[Pulled, Path], dict], str]] = {
    "tampered package": (_flip_a_byte, "has sha256 "),
    "truncated package": (_truncate, "bytes; the manifest says"),
    "signed by another key": (lambda p, t: _resigned(p, t, claim_trusted_kid=False), "unknown key: "),
    "another key under the trusted id": (lambda p, t: _resigned(p, t, claim_trusted_kid=True), "bad signature: "),
    "revoked key": (_revoked, "revoked key: "),
    "manifest of another artifact": (_another_artifact, "subject mismatch: "),
    "built, not run on its target": (_not_run_on_target, "unverified on target: "),
    "tampered weights": (_tampered_weights, "have sha256 "),
    "no weights for a weightless package": (lambda p, t: {"weights": None}, "binds its weights at load: pass"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_cpp_example_refuses_before_loading(aotc_run: Path, pulled: Pulled, tmp_path: Path, case: str) -> None:
    make, message = REFUSALS[case]
    done = run_cpp(aotc_run, pulled, tmp_path, torch.randn(2, 32), **make(pulled, tmp_path))
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "aotc_run: refused " in done.stderr and message in done.stderr, done.stderr
    assert "loaded with" not in done.stdout and not (tmp_path / "out.pt").exists()


def test_cpp_example_refuses_a_huge_manifest_without_spending_seconds_on_it(aotc_run: Path, pulled: Pulled,
                                                                             tmp_path: Path) -> None:
    """The manifest is parsed before its signature is checked, and the parser once compared each key with every
    key before it: a 975 kB object of distinct keys cost 9.4 s of CPU. Now an ordered set finds the duplicate."""
    distinct = [f'"k{i:07d}":0' for i in range(75_000)]  # 975 kB: under the 1 MiB cap
    (tmp_path / "huge.json").write_text("{" + ",".join(distinct) + ',"k0074999":1}')
    t0 = time.monotonic()
    done = run_cpp(aotc_run, pulled, tmp_path, torch.randn(2, 32), manifest=tmp_path / "huge.json")
    took = time.monotonic() - t0
    assert done.returncode == 3 and "duplicate key" in done.stderr and "k0074999" in done.stderr, done.stderr
    assert took < 4, f"{took:.1f} s"  # the process's start included; the old parser alone took 9.4 s (-O2)
    print(f"\naotc_run refused a {len(distinct)}-key manifest in {took:.2f} s")


def test_cpp_example_refuses_an_unverified_blob_whose_shape_overflows(aotc_run: Path, pulled: Pulled,
                                                                    tmp_path: Path) -> None:
    """With --insecure-skip-verify a weights blob's header is anyone's. A shape whose element count wraps around
    2^64 (2^32 x 2^32 = 0) once claimed exactly the zero bytes its offsets span, and a tensor of that shape over no
    memory went on to the package. Now the products are checked."""
    header = json.dumps({"fc1.weight": {"dtype": "F32", "shape": [1 << 32, 1 << 32], "data_offsets": [0, 0]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "w.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    torch.save([torch.randn(2, 32)], tmp_path / "in.pt")
    done = subprocess.run([str(aotc_run), "--package", str(pulled.package), "--insecure-skip-verify", "--inputs",
                           str(tmp_path / "in.pt"), "--outputs", str(tmp_path / "out.pt"), "--weights",
                           str(tmp_path / "w.safetensors")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "fc1.weight has a shape whose size overflows" in done.stderr, done.stderr
    assert not (tmp_path / "out.pt").exists()


def test_cpp_example_takes_a_build_not_run_on_its_target_only_when_told(aotc_run: Path, pulled: Pulled,
                                                                       tmp_path: Path) -> None:
    """Refused without the flag (the REFUSALS case above); with it, loaded and run, with a warning."""
    over = _not_run_on_target(pulled, tmp_path)
    torch.save([torch.randn(2, 32)], tmp_path / "in.pt")
    exe = [str(aotc_run), "--allow-unverified", "--package", str(pulled.package), "--artifact-key", pulled.key,
           "--manifest", str(over["manifest"]), "--trusted-key", str(over["trusted_key"]),
           "--inputs", str(tmp_path / "in.pt"), "--outputs", str(tmp_path / "out.pt"), "--weights", str(pulled.weights)]
    taken = subprocess.run(exe, capture_output=True, text=True, timeout=120)
    assert taken.returncode == 0, taken.stderr
    assert "WARNING: --allow-unverified" in taken.stderr and (tmp_path / "out.pt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cpp_example_says_why_it_cannot_run_on_cuda_here(aotc_run: Path, pulled: Pulled, tmp_path: Path) -> None:
    done = run_cpp(aotc_run, pulled, tmp_path, torch.randn(2, 32), device="cuda")
    assert done.returncode == 1
    assert "aotc_run: error: --device cuda: " in done.stderr
    assert "without CUDA" in done.stderr or "no CUDA device" in done.stderr, done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on the GPU machine)")
def test_cpp_example_runs_a_cuda_package_on_the_gpu(aotc_run: Path, tmp_path: Path) -> None:
    """A CUDA package, signed as a worker signs one, runs through the C++ loader on cuda:0 and gives Python's
    outputs. (No service: tests/gpu's worker fixture lives beside its own tests.)"""
    from compiler.compat.aoti import aoti_compile_and_package, aoti_load_package
    from compiler.signing import b64, key_record, raw_public, statement

    model = seeded(MLP, 17).cuda()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(4, 32, device="cuda"),), dynamic_shapes={"x": {0: batch}})
    package = Path(aoti_compile_and_package(ep, str(tmp_path / "mlp-cuda.pt2"), {}))
    signer, key = Signer.generate(), "c" * 32
    data = package.read_bytes()
    env = signer.sign(statement(artifact_key=key, package_sha256=hashlib.sha256(data).hexdigest(),
                                package_size=len(data), model_sha256="0" * 64, factors={}, toolchain={},
                                target="cuda", check=None, worker={}))
    (tmp_path / "manifest.json").write_text(json.dumps(env))
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [key_record(signer.public)]}))
    (tmp_path / "key.b64").write_text(b64(raw_public(signer.public)))
    p = Pulled(key, package, tmp_path / "manifest.json", tmp_path / "keys.json", tmp_path / "key.b64", signer.kid,
               model)

    x = torch.randn(7, 32)
    done = run_cpp(aotc_run, p, tmp_path, x, device="cuda")
    assert done.returncode == 0, done.stderr
    assert "(torch " in done.stdout and ", cuda:0) in " in done.stdout
    (out,) = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(out, aoti_load_package(str(package), "cuda:0")(x.cuda()).cpu())
        torch.testing.assert_close(out, model(x.cuda()).cpu(), rtol=1e-4, atol=1e-5)
    wrong = run_cpp(aotc_run, p, tmp_path, x, device="cpu")
    assert wrong.returncode == 1 and "the package is compiled for cuda; --device cpu cannot run it" in wrong.stderr
