"""A fleet's path by name, end to end: `aotc compile --name --tag` with the session's real worker compiling one
tiny model, `aotc pull NAME:TAG` picking the artifact for this machine (its target detected), and
`Client.load("NAME:TAG")` running it against eager PyTorch."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import torch

from client import Client
from modelzoo import MLP, export, seeded
from procs import ROOT, api

pytestmark = pytest.mark.slow


def test_compile_by_name_then_pull_and_load_by_tag_on_this_machine(api_url, worker, tmp_path, caplog):
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    model = seeded(MLP, 5150, d_in=8, hidden=16, d_out=4)
    path = export(model, (torch.randn(4, 8),), tmp_path / "mlp.pt2")

    def aotc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "client.cli", "--url", api_url, *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)

    done = aotc("compile", str(path), "--shape", "x=4x8", "--target", "cpu", "--name", name, "--tag", "prod")
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip().splitlines()[-1]
    assert f"recorded {name}@1" in done.stderr

    pulled = aotc("pull", f"{name}:prod", "--shape", "x=4x8", "--device", "cpu", "-o", str(tmp_path / "p.pt2"))
    assert pulled.returncode == 0, pulled.stderr
    host = worker["target"]  # the worker runs on this machine: its target is the one detected here
    assert f"for {host}: {key} ({host}, exact): built for this host's target {host}" in pulled.stderr
    assert pulled.stdout.strip().splitlines()[-1] == str(tmp_path / "p.pt2")

    listed = aotc("versions", name)
    assert f"{host}: built {key[:8]}" in listed.stdout, listed.stdout

    with caplog.at_level("INFO", logger="aotc.client"), Client(api_url, cache_dir=tmp_path / "cache") as c:
        fn = c.load(f"{name}:prod", shapes={"x": [4, 8]}, device="cpu")
    assert any(f"picked {key}" in r.getMessage() for r in caplog.records)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)
    assert api.get(f"{api_url}/v1/refs/{name}:prod").json()["model_id"] == api.get(
        f"{api_url}/v1/artifacts/{key}/meta").json()["model_id"]
