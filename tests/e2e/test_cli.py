"""The README's path through the CLI: `aotc compile` (key on stdout's last line), `aotc pull` (path on stdout's last
line), then torch runs it; `aotc models` and `aotc lookup` find it again."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import ROOT, api

pytestmark = pytest.mark.slow


def aotc(api_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "client.cli", "--url", api_url, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_compile_pull_and_run_through_the_cli(api_url, worker, tmp_path):
    model = seeded(MLP, 31, d_in=24)
    path = export(model, (torch.randn(6, 24),), tmp_path / "mlp.pt2")

    done = aotc(api_url, "compile", str(path), "--shape", "x=6x24", "--target", "cpu", "--freezing",
                "--inductor", "epilogue_fusion=false")
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip().splitlines()[-1]
    meta = api.get(f"{api_url}/v1/artifacts/{key}/meta").json()
    assert meta["factors"]["options"]["freezing"] is True  # the flags reached the cache key
    assert meta["factors"]["options"]["inductor"]["epilogue_fusion"] is False
    assert f"artifact {key}:" in done.stderr and "succeeded" in done.stderr
    # Off a terminal, progress is one plain line per change, and ends on the succeeded one.
    progress = [ln for ln in done.stderr.splitlines() if re.match(r"\[ *[0-9.]+s\] job \w{8} \[[#-]{20}\] ", ln)]
    assert progress[0].endswith("queued: queued")
    assert progress[-1].endswith("[####################] succeeded: succeeded")
    model_id = re.search(r"as model (\w{12}) ", done.stderr)[1]  # type: ignore[index]

    again = aotc(api_url, "compile", str(path), "--shape", "x=6x24", "--target", "cpu", "--freezing",
                 "--inductor", "epilogue_fusion=false")
    assert again.stdout.strip().splitlines()[-1] == key and "cache hit" in again.stderr

    out = tmp_path / "mlp-aoti.pt2"
    pulled = aotc(api_url, "pull", key, "-o", str(out))
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().splitlines()[-1] == str(out)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == meta["sha256"]
    listed = aotc(api_url, "models")
    assert any(ln.split()[0] == model_id and ln.endswith("x:float32[6x24]") for ln in listed.stdout.splitlines())
    found = aotc(api_url, "lookup", model_id, "--shape", "x=6x24", "--target", "cpu")
    assert found.returncode == 0 and found.stdout.strip() == key, found.stderr
    compiled = torch._inductor.aoti_load_package(str(out))
    x = torch.randn(6, 24)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_cli_reports_a_refused_option_and_exits_2(api_url, tmp_path):
    path = export(seeded(MLP, 32, d_in=24), (torch.randn(6, 24),), tmp_path / "mlp.pt2")
    bad = aotc(api_url, "compile", str(path), "--shape", "x=6x24", "--inductor", "trace.enabled=true")
    assert bad.returncode == 2
    assert "the service refused" in bad.stderr and "trace.enabled" in bad.stderr
