"""The C++ example (examples/cpp) for the tests that run it: built once per torch version (kept across runs), and the
files it verifies a pulled package against."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import torch

from procs import ROOT, api

CXX = os.environ.get("CXX", "g++")
EXAMPLE = ROOT / "examples" / "cpp"
# One build per torch version, kept across runs: the first takes 30-45 s on 2 cores (a make job per core: two of its
# four files include torch's headers), later ones are make's no-op.
BUILD = ROOT / ".aotc" / "cpp-build" / f"torch-{torch.__version__}"


def build_aotc_run() -> Path:
    BUILD.mkdir(parents=True, exist_ok=True)
    with open(BUILD / ".lock", "w") as lock:  # two sessions building one directory would clobber each other
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = subprocess.run(["make", "-C", str(EXAMPLE), f"-j{os.cpu_count() or 1}", f"BUILD={BUILD}",
                               f"PYTHON={sys.executable}", f"CXX={CXX}"], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return BUILD / "aotc_run"


def save_verification(api_url: str, key: str, tmp: Path) -> tuple[Path, Path, Path, str]:
    """The artifact's manifest and the service's signing keys as served, and the signer's public key pinned (its raw
    32 bytes in base64): (manifest, signing keys, trusted key, kid)."""
    r = api.get(f"{api_url}/v1/artifacts/{key}/manifest")
    assert r.status_code == 200, r.text
    (tmp / "manifest.json").write_bytes(r.content)
    kid = r.json()["signatures"][0]["keyid"]
    keys = api.get(f"{api_url}/v1/signing-keys")
    assert keys.status_code == 200, keys.text
    (tmp / "signing-keys.json").write_bytes(keys.content)
    (record,) = [k for k in keys.json()["keys"] if k["kid"] == kid]
    (tmp / "worker.b64").write_text(record["public_key"] + "\n")
    return tmp / "manifest.json", tmp / "signing-keys.json", tmp / "worker.b64", kid
