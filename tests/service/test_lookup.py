"""Deploy-time lookup ranks among the artifacts that satisfy every filter, `mode` included."""

from __future__ import annotations

import time

import httpx

from service import cachekey


def _publish(store, tmp_path, model_id: str, spec: list, mode: str) -> str:
    options = {"mode": mode}
    factors = cachekey.factors(model_id, spec, "cpu-x86_64-test", {"torch": "test"}, options)
    key = cachekey.cache_key(factors)
    package = tmp_path / f"{key}.pt2"
    package.write_bytes(b"package bytes for " + key.encode())
    store.put_artifact({"key": key, "factors": factors, "model_id": model_id, "target": "cpu-x86_64-test",
                        "spec": spec, "options": options}, package)
    return key


def test_lookup_by_mode_finds_the_matching_artifact_behind_a_better_ranked_one(api_url, store, tmp_path):
    model_id = "ab" * 32
    store.put_model({"id": model_id, "name": "lookup", "size": 1, "created": time.time(),
                     "inputs": [{"name": "x", "dtype": "float32", "shape": [{"symbol": "s0", "min": 1, "max": 64}, 4]}]})
    static = _publish(store, tmp_path, model_id, [{"name": "x", "dtype": "float32", "shape": [8, 4]}], "default")
    dynamic = _publish(store, tmp_path, model_id,
                       [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}], "max-autotune")

    def lookup(**params: str) -> httpx.Response:
        return httpx.get(f"{api_url}/v1/artifacts/lookup",
                         params={"model_id": model_id, "target": "cpu", "shape": "x=8x4", **params})

    assert lookup().json()["key"] == static  # static ranks first without a mode
    assert lookup(mode="max-autotune").json()["key"] == dynamic
    assert lookup(mode="default").json()["key"] == static
    assert lookup(mode="max-autotune", shape="x=33x4").status_code == 404
