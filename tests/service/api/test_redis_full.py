"""A Redis that is out of memory (maxmemory, policy noeviction): every route that needs a write answers a JSON 507
that says so, readiness says so, a compile request is not told that its workers are gone, and downloads go on. An
API refuses to start on a Redis that would evict keys by itself. A re-upload of a model whose bytes are missing
stores them again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from modelzoo import MLP, export, seeded
from procs import ROOT, Cluster, api
from service.store import Store
from service.store.embedded import EmbeddedRedis, free_port


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("full"))
    yield c
    c.close()


def _model(tmp: Path, seed: int) -> bytes:
    return export(seeded(MLP, seed, d_in=16), (torch.randn(2, 16),), tmp / f"mlp{seed}.pt2").read_bytes()


def test_a_full_redis_answers_507_and_says_why(cluster: Cluster, tmp_path: Path) -> None:
    url = cluster.url
    model = api.post(f"{url}/v1/models", content=_model(tmp_path, 1), timeout=60)
    assert model.status_code == 201, model.text
    key = os.urandom(16).hex()
    (tmp_path / "pkg").write_bytes(b"package bytes")
    factors = {"format": 1, "model": "a" * 64, "options": {}, "spec": [], "target": "cpu-x86_64-avx2",
               "toolchain": {"torch": "2.13.0"}}
    store = Store(cluster.redis.url)
    store.artifacts.put({"key": key, "factors": factors, "model_id": "a" * 64, "target": factors["target"],
                         "spec": [], "options": {}}, tmp_path / "pkg")
    second = _model(tmp_path, 2)

    r = cluster.store.r
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + 2 * 2**20)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                r.set(f"filler:{i}", b"x" * 100_000)
        # Full for good (noeviction never drops a key), not just at the edge where a small write still fits.
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - 2**20)

        up = api.post(f"{url}/v1/models", content=second, timeout=60)
        assert up.status_code == 507, up.text
        assert up.json()["error"]["code"] == "insufficient_storage" and "out of memory" in up.json()["error"]["message"]

        ready = api.get(f"{url}/readyz")
        assert ready.status_code == 507 and "out of memory" in ready.json()["error"]["message"]

        compile_ = api.post(f"{url}/v1/compilations", json={"model_id": model.json()["id"], "shapes": {"x": [2, 16]}})
        assert compile_.status_code == 507, compile_.text  # not "no live worker": Redis cannot hear them
        assert "heartbeats" in compile_.json()["error"]["message"]

        assert api.get(f"{url}/v1/models").status_code == 200  # reads go on
        pulled = api.get(f"{url}/v1/artifacts/{key}")
        assert pulled.status_code == 200 and pulled.content == b"package bytes"
        assert api.post(f"{url}/v1/artifacts/{key}/pin").status_code == 507
    finally:
        r.config_set("maxmemory", 0)
        for batch in range(0, 10_000, 1000):
            r.delete(*(f"filler:{i}" for i in range(batch, batch + 1000)))
    assert api.get(f"{url}/readyz").status_code == 200
    assert api.post(f"{url}/v1/models", content=second, timeout=60).status_code == 201
    store.close()


def test_a_model_whose_bytes_are_missing_is_stored_again(cluster: Cluster, tmp_path: Path) -> None:
    body = _model(tmp_path, 3)
    first = api.post(f"{cluster.url}/v1/models", content=body, timeout=60)
    assert first.status_code == 201
    store = Store(cluster.redis.url)  # the blob store the API announced
    model_id = first.json()["id"]
    assert store.blobs.exists("model", model_id)
    store.blobs.delete("model", model_id)
    again = api.post(f"{cluster.url}/v1/models", content=body, timeout=60)
    assert again.status_code == 201 and store.blobs.exists("model", model_id)
    assert store.blobs.manifest("model", model_id) == {"size": len(body), "sha256": model_id}
    assert api.post(f"{cluster.url}/v1/models", content=body, timeout=60).status_code == 200
    store.close()


@pytest.mark.parametrize("process", ["api", "worker"])
def test_a_redis_that_would_evict_is_refused_at_start(process: str, tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AOTC_REDIS_URL": server.url, "AOTC_DATA_DIR": str(tmp_path),
               "AOTC_DEVICE": "cpu", "AOTC_WORK_DIR": str(tmp_path / "work")}
        argv = ([sys.executable, "-m", "uvicorn", "service.api.app:create_app", "--factory", "--port",
                 str(free_port())] if process == "api" else [sys.executable, "-m", "worker"])
        t0 = time.monotonic()
        done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        out = done.stdout + done.stderr
        assert "maxmemory-policy is 'allkeys-lru'" in out and "noeviction" in out, out[-3000:]
        assert time.monotonic() - t0 < 120
