"""The deploy-time read paths (lookup, meta, model get): short ids through the lex index, async reads, and the
in-process memo, which must never serve what Redis no longer holds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from compiler import cachekey, speed
from procs import api, start_api, stop
from service.store import keys

X_DYNAMIC = [{"symbol": "s0", "min": 1, "max": 64}, 4]


def _model(store, model_id: str) -> None:
    store.models.put({"id": model_id, "name": "hot", "size": 1, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": X_DYNAMIC}]})


def _publish(store, tmp_path: Path, model_id: str, dims: list, mode: str = "default") -> str:
    spec = [{"name": "x", "dtype": "float32", "shape": dims}]
    options = {"mode": mode}
    factors = cachekey.factors(model_id, spec, "cpu-x86_64-test", {"torch": "test"}, options)
    key = cachekey.cache_key(factors)
    package = tmp_path / f"{key}.pt2"
    package.write_bytes(b"package bytes for " + key.encode())
    store.artifacts.put({"key": key, "factors": factors, "model_id": model_id, "target": "cpu-x86_64-test",
                         "spec": spec, "options": options, "worker": {"device_name": "Test CPU"}}, package)
    return key


def _lookup(url: str, model_id: str, shape: str = "x=8x4") -> httpx.Response:
    return api.get(f"{url}/v1/artifacts/lookup", params={"model_id": model_id, "target": "cpu", "shape": shape})


def test_short_ids_resolve_through_the_index(api_url, store):
    a, b = "0123456789" + "a" * 54, "0123456789" + "b" * 54  # share their first 10 digits
    _model(store, a)
    _model(store, b)
    assert store.models.find(a[:12]) == [a]
    assert sorted(store.models.find(a[:10])) == [a, b]
    assert api.get(f"{api_url}/v1/models/{a[:12]}").json()["id"] == a
    assert api.get(f"{api_url}/v1/models/{b}").json()["id"] == b
    ambiguous = api.get(f"{api_url}/v1/models/{a[:10]}")
    assert ambiguous.status_code == 422 and "ambiguous" in ambiguous.json()["error"]["message"]
    assert _lookup(api_url, a[:10]).status_code == 422
    assert api.get(f"{api_url}/v1/models/{'c' * 12}").status_code == 404
    assert api.get(f"{api_url}/v1/models/not-hex-at-all").status_code == 404
    assert api.get(f"{api_url}/v1/models/0123456").status_code == 404  # under 8 digits: not a prefix


def test_meta_and_lookup_answer_the_stored_record(api_url, store, tmp_path):
    model_id = "1f" * 32
    _model(store, model_id)
    key = _publish(store, tmp_path, model_id, [8, 4])
    # The stored record, and what the check says of its speed (compiler/speed.py), computed as it is served.
    record = store.artifacts.get(key)
    record = {**record, "speed": speed.verdict(record.get("check"), record["spec"])}
    for _ in range(3):  # the first answer is rendered, the next ones come from memory: all the same
        meta = api.get(f"{api_url}/v1/artifacts/{key}/meta")
        assert meta.status_code == 200 and meta.headers["content-type"] == "application/json"
        assert meta.json() == record
        found = _lookup(api_url, model_id[:12])
        assert found.status_code == 200 and found.json() == record
    assert _lookup(api_url, model_id, "x=9x4").status_code == 404  # nothing covers it
    assert _lookup(api_url, model_id, "x=9x5").status_code == 422  # the program does not allow it
    assert api.get(f"{api_url}/v1/artifacts/{'0' * 32}/meta").status_code == 404


def test_a_deleted_artifact_is_never_served_from_memory(api_url, store, tmp_path, service_env):
    """Eviction deletes artifact records; here a record is deleted behind the APIs' backs (plain DEL, nothing
    else told). Two API processes, each with its answers in memory, must both stop serving it at once."""
    other_url, other = start_api(service_env, tmp_path / "api-2.log")
    try:
        model_id = "2e" * 32
        _model(store, model_id)
        dynamic = _publish(store, tmp_path, model_id, [{"min": 1, "max": 32}, 4])
        static = _publish(store, tmp_path, model_id, [8, 4])
        for url in (api_url, other_url):
            for _ in range(3):
                assert _lookup(url, model_id).json()["key"] == static
                assert api.get(f"{url}/v1/artifacts/{static}/meta").status_code == 200

        store.r.delete(keys.artifact(static))
        for url in (api_url, other_url):
            assert api.get(f"{url}/v1/artifacts/{static}/meta").status_code == 404
            assert _lookup(url, model_id).json()["key"] == dynamic  # the next best, ranked afresh

        store.r.delete(keys.artifact(dynamic))
        for url in (api_url, other_url):
            assert _lookup(url, model_id).status_code == 404

        again = _publish(store, tmp_path, model_id, [8, 4], mode="max-autotune")  # a publish shows at once
        for url in (api_url, other_url):
            assert _lookup(url, model_id[:16]).json()["key"] == again
    finally:
        stop(other)


def test_a_rewritten_artifact_record_is_served_as_it_is_now(api_url, store, tmp_path):
    model_id = "3d" * 32
    _model(store, model_id)
    key = _publish(store, tmp_path, model_id, [8, 4])
    assert api.get(f"{api_url}/v1/artifacts/{key}/meta").json().get("note") is None
    record = store.artifacts.get(key)
    store.r.set(keys.artifact(key), json.dumps({**record, "note": "rewritten"}))
    assert api.get(f"{api_url}/v1/artifacts/{key}/meta").json()["note"] == "rewritten"
    assert _lookup(api_url, model_id).json()["note"] == "rewritten"


def test_models_stored_before_the_index_get_short_ids_at_start(store, service_env, tmp_path):
    """A record written the old way (no `models:ids` entry) resolves by short id once an API has started."""
    legacy = "4c" * 32
    store.r.set(keys.model(legacy), json.dumps({"id": legacy, "name": "old", "size": 1, "created": 1.0, "inputs": []}))
    store.r.zadd(keys.MODELS_INDEX, {legacy: 1.0})
    assert store.models.find(legacy[:12]) == []
    url, proc = start_api(service_env, tmp_path / "api-backfill.log")
    try:
        assert store.models.find(legacy[:12]) == [legacy]
        assert api.get(f"{url}/v1/models/{legacy[:12]}").json()["name"] == "old"
    finally:
        stop(proc)


@pytest.mark.parametrize("n", [3000])
def test_short_id_lookups_do_not_scan(store, n):
    """With thousands of models a short id resolves with one lex range: a handful of Redis calls, not a scan."""
    pipe = store.r.pipeline(transaction=False)
    for i in range(n):
        model_id = f"{i:08x}" + "5" * 56
        pipe.set(keys.model(model_id), "{}")
        pipe.zadd(keys.MODELS_INDEX, {model_id: float(i)})
        pipe.zadd(keys.MODEL_IDS, {model_id: 0})
    pipe.execute()
    before = int(store.r.info("commandstats").get("cmdstat_zrangebylex", {}).get("calls", 0))
    scans = int(store.r.info("commandstats").get("cmdstat_zscan", {}).get("calls", 0))
    assert store.models.find(f"{n - 1:08x}5555") == [f"{n - 1:08x}" + "5" * 56]
    stats = store.r.info("commandstats")
    assert int(stats["cmdstat_zrangebylex"]["calls"]) == before + 1
    assert int(stats.get("cmdstat_zscan", {}).get("calls", 0)) == scans
