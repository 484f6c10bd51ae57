"""The registry through the `aotc` command line against a real service (uvicorn, the session's redis-server):
compile by name for several targets, `versions`, `tag`, `untag`, `delete-version`, and `pull` by reference when
nothing fits. No compile runs: fake workers (registry records) take the jobs, which stay queued. A real compile and
pull by name is tests/client/test_registry_e2e.py."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from client import cli
from modelzoo import MLP, export, seeded
from service.store import Store

RUN = uuid.uuid4().hex[:6]
T1, T2 = f"cpu-zcli{RUN}-one", f"cpu-zcli{RUN}-two"
runner = CliRunner()


@pytest.fixture(scope="module")
def fake_workers(store: Store) -> Iterator[None]:
    for t in (T1, T2):
        store.workers.heartbeat({"id": f"fake-{t}", "target": t, "toolchain": {"torch": "fake"},
                                 "device_name": "none", "started": time.time()}, ttl_s=3600)
    yield
    for t in (T1, T2):
        store.workers.remove(f"fake-{t}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(seeded(MLP, 4242, d_in=4, hidden=8, d_out=2), (torch.randn(3, 4),),
                  tmp_path_factory.mktemp("cli-registry") / "tiny.pt2")


def aotc(api_url: str, *args: str) -> tuple[int, str, str]:
    done = runner.invoke(cli.app, ["--url", api_url, *args])
    return done.exit_code, done.stdout, done.stderr


def test_compile_by_name_for_several_targets_then_tag_untag_and_list(api_url, fake_workers, model_path):
    name = f"tiny-{RUN}"
    code, out, err = aotc(api_url, "compile", str(model_path), "--shape", "x=3x4", "--target", T1, "--target", T2,
                          "--target", "cuda-sm80", "--name", name, "--tag", "prod", "--no-wait")
    assert code == 0, err
    assert f"recorded {name}@1 -> model" in err and "(tags: prod)" in err
    assert f"{T1}: queued job" in err and f"{T2}: queued job" in err
    assert "cuda-sm80: unserved: no live worker serves target 'cuda-sm80'" in err
    assert sorted(line.split()[0] for line in out.splitlines()) == [T1, T2]  # TARGET JOB per job

    code, out, err = aotc(api_url, "versions", name)
    assert code == 0, err
    header, row = out.splitlines()
    assert header.split() == ["VERSION", "MODEL", "CREATED", "TAGS", "ARTIFACTS"]
    assert row.startswith(f"{name}@1 ") and " latest,prod " in row
    assert f"{T1}: queued" in row and f"{T2}: queued" in row and "cuda-sm80: unserved" in row

    assert aotc(api_url, "tag", f"{name}:prod", "canary")[1].strip() == f"{name}:canary -> {name}@1 (new)"
    assert aotc(api_url, "untag", f"{name}:canary")[1].strip() == f"removed {name}:canary (was @1)"
    code, out, _ = aotc(api_url, "versions", name, "--history")
    assert [ln.split()[2:5] for ln in out.splitlines()[1:]] == [["canary", "1", "(removed)"], ["canary", "-", "1"],
                                                                 ["prod", "-", "1"]]
    code, out, _ = aotc(api_url, "names")
    assert any(ln.split() == [name, "1", "1", "prod=1"] for ln in out.splitlines())

    # Nothing is built yet: a pull by name says so, with what the compile request queued, and exits 1.
    code, _, err = aotc(api_url, "pull", f"{name}:prod", "--target", "cpu-x86_64-avx2")
    assert code == 1
    assert f"nothing of {name}:prod ({name}@1" in err and "it has no artifacts yet" in err
    assert f"not built yet: {T1}, {T2}" in err and "no worker served cuda-sm80 when it was compiled" in err

    code, out, _ = aotc(api_url, "delete-version", f"{name}@1")
    assert out.strip() == f"deleted {name}@1; tags removed: prod; versions here still holding its model: 0"
    assert aotc(api_url, "versions", name)[0] == 2  # the service's 404


def test_references_and_tags_are_checked_before_any_request(api_url, model_path):
    code, _, err = aotc(api_url, "pull", "Bert:prod")
    assert code == 2 and "cannot read the reference 'Bert:prod'" in err
    code, _, err = aotc(api_url, "compile", str(model_path), "--shape", "x=3x4", "--tag", "prod")
    assert code == 2 and "give --name too" in err
    code, _, err = aotc(api_url, "delete-version", "bert:prod")
    assert code == 2 and "write NAME@VERSION" in err
