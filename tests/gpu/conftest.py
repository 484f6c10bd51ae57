"""The GPU suite: `pytest -m gpu` on a machine with CUDA. It runs the whole service there: the session Redis and
API from tests/conftest.py, plus one worker on cuda:0."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from modelzoo import InplaceReduce, export, seeded
from procs import start_worker, stop
from service.store import Store

LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def gpu_worker(service_env: dict[str, str], store: Store, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    import os

    extra = {"AOTC_DEVICE": "cuda:0"}
    # Some images crash inside AOTInductor's package loader unless the system libstdc++ is preloaded
    # (see docs/development.md, "On a GPU"). The check child must load packages, so give it the same preload.
    if os.environ.get("LD_PRELOAD"):
        extra["AOTC_CHILD_LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    log = tmp_path_factory.mktemp("logs") / "gpu-worker.log"
    proc = start_worker(service_env, log, **extra)
    deadline = time.monotonic() + 120
    while not (gpu := [w for w in store.workers.live() if w["target"].startswith("cuda-")]):
        assert time.monotonic() < deadline and proc.poll() is None, "the GPU worker did not register"
        time.sleep(0.2)
    yield {**gpu[0], "log": log}
    stop(proc)


@pytest.fixture
def gpu_compile(gpu_worker: dict, client):  # type: ignore[no-untyped-def]
    """client.compile on the GPU worker (`target`: its own unless given), bounded: a job that has not ended within
    `timeout` fails the test with the worker's last log lines. On 2026-11-29 a bucketed compile outlived a 200 s
    limit with nothing to say whether it hung or was slow."""

    def compile_(*args, timeout: float = 900, target: str | None = None, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return client.compile(*args, target=target or gpu_worker["target"], timeout=timeout, **kwargs)
        except TimeoutError as e:
            tail = "\n".join(gpu_worker["log"].read_text(errors="replace").splitlines()[-40:])
            pytest.fail(f"{e}; the GPU worker's log ends:\n{tail}")

    return compile_


@pytest.fixture
def inplace_bundle(gpu_compile, tmp_path):  # type: ignore[no-untyped-def]
    """The stage report's model (an in-place op, a reduction, a matmul) on cuda, and its bundle compiled by the GPU
    worker: dynamic batch 1..64 with a bucket at 32. (model, bundle); every test after the first is a cache hit."""
    model = seeded(InplaceReduce, 31).cuda()
    batch = torch.export.Dim("batch", min=1, max=256)
    path = export(model, (torch.randn(8, 16, device="cuda"),), tmp_path / "ir.pt2", dynamic_shapes={"x": {0: batch}})
    return model, gpu_compile(path, {"x": [{"min": 1, "max": 64}, 16]}, buckets=[{"x": [32, 16]}])
