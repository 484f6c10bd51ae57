"""A CPU package keeps to the x86-64 level it is named for, whatever the host that built it: the session's worker
serves every level at or below its host's, and a request for v3 (by its old name, cpu-x86_64-avx2) is compiled by
it with -march=x86-64-v3 and AVX2 kernels. The test reads the pulled package itself, with its own rules (not
compiler.isa's): the vector ISA it records, every g++ line it records, and, with objdump, its code."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import zipfile

import pytest
import torch

from modelzoo import MLP, export, seeded
from procs import api

pytestmark = [pytest.mark.slow, pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 levels only")]

LEVEL_ORDER = {f"cpu-x86_64-{v}": n for n, v in enumerate(("v1", "v2", "v3", "v4"))}
# Registers only AVX-512 has: zmm, the mask registers, and xmm/ymm 16-31 (EVEX-encoded AVX-512VL).
AVX512_REGISTERS = re.compile(r"%zmm\d+|%k[0-7]\b|%[xy]mm(?:1[6-9]|2\d|3[01])\b")
COMPILE_LINE = re.compile(r"^// (g\+\+ .*)$", re.M)
PRODUCER = re.compile(rb"GNU C\+\+\d* [\d.]+ ([^\x00]+)")


def host_level() -> str:
    """This host's level by the psABI's flags, read here rather than by compiler.targets."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((ln.split(":", 1)[1] for ln in f if ln.startswith("flags")), "").split())
    levels = {"v2": {"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"},
              "v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
              "v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}
    level = "v1"
    for name, needs in levels.items():
        if not needs <= flags:
            break
        level = name
    return f"cpu-x86_64-{level}"


@pytest.fixture(scope="module")
def v3_artifact(api_url, worker, tmp_path_factory):
    from client import Client

    host = host_level()
    if LEVEL_ORDER.get(host, -1) < LEVEL_ORDER["cpu-x86_64-v3"]:
        pytest.skip(f"this host is {host}: it cannot build or check a v3 package")
    tmp = tmp_path_factory.mktemp("isa")
    model = seeded(MLP, 31)
    path = export(model, (torch.randn(4, 32),), tmp / "mlp.pt2")
    with Client(api_url, cache_dir=tmp / "cache", timeout=120) as c:
        art = c.compile(path, {"x": [4, 32]}, target="cpu-x86_64-avx2")  # the old label: read as v3
        return model, art, c.pull(art, tmp / "mlp-v3.pt2")


def test_workers_list_every_level_they_serve(api_url, worker):
    host = host_level()
    record = next(w for w in api.get(f"{api_url}/v1/workers").json()["workers"] if w["id"] == worker["id"])
    assert record["target"] == host
    assert record["targets"] == sorted((t for t in LEVEL_ORDER if LEVEL_ORDER[t] <= LEVEL_ORDER[host]),
                                           key=LEVEL_ORDER.__getitem__, reverse=True)
    ready = api.get(f"{api_url}/readyz").json()
    assert set(record["targets"]) <= set(ready["targets"])


def test_a_v3_package_records_avx2_and_v3_flags_only(v3_artifact):
    _, art, package = v3_artifact
    assert art.meta["target"] == "cpu-x86_64-v3"
    assert art.meta["factors"]["isa"] == {"level": "v3", "march": "x86-64-v3", "vec_isa": "avx2", "revision": 1}
    lines: list[list[str]] = []
    with zipfile.ZipFile(package) as zf:
        names = zf.namelist()
        isas = {json.loads(zf.read(n))["AOTI_CPU_ISA"] for n in names if n.endswith("_metadata.json")}
        for n in names:
            if n.endswith(".cpp"):
                lines += [m.split() for m in COMPILE_LINE.findall(zf.read(n).decode())]
            elif n.endswith(".so"):
                lines += [m.decode().split() for m in PRODUCER.findall(zf.read(n))]
    assert isas == {"AVX2"}
    # torch 2.13 records them (the .cpp's `// Compile cmd` and -g1's DWARF producer); where a torch records none,
    # the code itself is the evidence (the objdump test below).
    assert lines or shutil.which("objdump"), "the package records none of its g++ lines, and there is no objdump"
    for flags in lines:
        marches = {f for f in flags if f.startswith("-march=")}
        assert marches == {"-march=x86-64-v3"}, flags
        assert not [f for f in flags if f.startswith(("-mavx512", "-mamx", "-mavx10"))], flags


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils)")
def test_a_v3_package_holds_no_avx512_code(v3_artifact, tmp_path):
    _, _, package = v3_artifact
    with zipfile.ZipFile(package) as zf:
        sos = [n for n in zf.namelist() if n.endswith(".so")]
        assert sos
        zf.extractall(tmp_path, sos)
    for so in sos:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(tmp_path / so)], capture_output=True,
                              text=True, check=True).stdout
        assert "vfmadd" in text or "%ymm" in text  # it is AVX2 code: the scan reads real instructions
        hits = [ln for ln in text.splitlines() if "\t" in ln and AVX512_REGISTERS.search(ln.split("\t", 1)[1])]
        assert hits == [], hits[:5]


def test_a_v3_package_is_found_by_its_level_and_runs_here(v3_artifact, client):
    model, art, _ = v3_artifact
    report = client.report(art.key)
    assert report["stages"]["package"]["isa"]["level"] == "v3"
    assert report["stages"]["package"]["isa"]["metadata"] == ["AVX2", "AVX2"]
    for name in ("cpu-x86_64-v3", "cpu-x86_64-avx2"):
        found = client.lookup(art.meta["model_id"], {"x": [4, 32]}, target=name)
        assert found is not None and found.key == art.key
    fn = client.load(art)  # a v3 package on this host (v3 or above): checked on the worker, and here
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-5)
