"""GET /v1/artifacts/lookup's plain route (service/api/lookup.py FastLookup) answers as the FastAPI route does.

The fast route takes a request only when every parameter is within the route's grammar and the key may pull;
everything else is handed to the FastAPI route. So each answer here is asked for twice, over HTTP against the
session's server: once as the fast route takes it, and once with `graphs` spelt `False`/`True` (a spelling only the
FastAPI route reads, same meaning), and the two must match byte for byte.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest

from procs import api, new_key, publish
from service.api.lookup import _query
from service.store import Store

TARGET = "cpu-x86_64-test"
STATIC = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
DYNAMIC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}]


def _publish(store: Store, tmp: Path, model_id: str, spec: list, mode: str) -> str:
    return publish(store, tmp, model_id, spec, TARGET, torch="test", options={"mode": mode},
                   worker={"device_name": "Test CPU"}, check={"passed": True, "compiled_ms": 1.0})


def _key(url: str, scope: str, ns: str) -> httpx.Client:
    key = new_key(url, scope, ns, "fast lookup")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10)


@pytest.fixture(scope="module")
def seeded(api_url: str, store: Store, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("fast-lookup")
    model_id = uuid.uuid4().hex * 2
    store.models.put({"id": model_id, "name": "fast", "size": 1, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": [{"symbol": "s0", "min": 1, "max": 64},
                                                                             4]}]})
    ns = f"fast-{uuid.uuid4().hex[:6]}"
    store.namespaces.add_model(ns, model_id, "fast")
    keys = {"static": _publish(store, tmp, model_id, STATIC, "default"),
            "dynamic": _publish(store, tmp, model_id, DYNAMIC, "max-autotune")}
    return {"model_id": model_id, "keys": keys, "admin": httpx.Client(base_url=api_url, headers=api.headers),
            "pull": _key(api_url, "pull", ns), "other": _key(api_url, "pull", f"other-{ns}")}


def _both(client: httpx.Client, graphs: bool, **params: str) -> tuple[httpx.Response, httpx.Response]:
    fast = client.get("/v1/artifacts/lookup", params={**params, "graphs": "true" if graphs else "false"})
    route = client.get("/v1/artifacts/lookup", params={**params, "graphs": "True" if graphs else "False"})
    return fast, route


def test_the_fast_route_answers_every_lookup_as_the_fastapi_route(seeded: dict) -> None:
    model_id, keys = seeded["model_id"], seeded["keys"]
    base = {"model_id": model_id, "target": "cpu"}
    cases = [
        ("admin", base | {"shape": "x=8x4"}, 200, keys["static"]),  # static ranks first
        ("pull", base | {"shape": "x=8x4"}, 200, keys["static"]),
        ("pull", base | {"shape": "x=3x4"}, 200, keys["dynamic"]),  # only the dynamic one covers 3
        ("pull", base | {"shape": "x=8x4", "mode": "max-autotune"}, 200, keys["dynamic"]),
        ("pull", {**base, "model_id": model_id[:12], "shape": "x=8x4"}, 200, keys["static"]),  # a short id
        ("pull", base | {"shape": "x=40x4"}, 404, None),  # in the program's range, but no artifact covers it
        ("pull", base | {"shape": "x=8x4", "target": "cuda"}, 404, None),
        ("pull", base | {"shape": "x=8x4", "mode": "training"}, 404, None),
        ("pull", base | {"shape": "x=100x4"}, 422, None),  # outside the program's range
        ("other", base | {"shape": "x=8x4"}, 404, None),  # another namespace's model: as if it did not exist
        ("other", {**base, "model_id": model_id[:12], "shape": "x=8x4"}, 404, None),
        ("pull", {**base, "model_id": "0" * 64, "shape": "x=8x4"}, 404, None),
    ]
    for who, params, status, key in cases:
        for graphs in (False, True):
            fast, route = _both(seeded[who], graphs, **params)
            assert (fast.status_code, fast.content) == (route.status_code, route.content), (who, params)
            assert fast.headers["content-type"] == route.headers["content-type"] == "application/json"
            assert fast.status_code == status, (who, params, fast.text)
            if key is not None:
                assert fast.json()["key"] == key, (who, params)


def test_requests_the_fast_route_declines_get_the_routes_answers(seeded: dict, api_url: str) -> None:
    model_id = seeded["model_id"]
    pull = seeded["pull"]
    lookup = f"/v1/artifacts/lookup?model_id={model_id}&target=cpu&shape=x=8x4"
    assert pull.get(lookup).status_code == 200
    for query, status, names in [
        # a trailing newline: outside the pattern; an id that names nothing answers 404 (service/api/errors.py)
        (f"model_id={model_id}%0A&shape=x=8x4", 404, "a model id is 64 hex digits"),
        (f"model_id={model_id}&shape=x=8y4", 422, "shape"),
        (f"model_id={model_id}&shape=x=8x4&target=gpu", 422, "target"),
        (f"model_id={model_id}&shape=x=8x4&mode=fast", 422, "mode"),
        (f"model_id={model_id}&shape=x=8x4&graphs=maybe", 422, "graphs"),
        ("shape=x=8x4", 422, "model_id"),
    ]:
        r = pull.get(f"/v1/artifacts/lookup?{query}")
        assert r.status_code == status and names in r.text, (query, r.status_code, r.text)
    assert httpx.get(f"{api_url}{lookup}").status_code == 401  # no key
    r = httpx.get(f"{api_url}{lookup}", headers={"Authorization": "Bearer aotc_nope_nope"})
    assert r.status_code == 401 and "not one this server knows" in r.text
    assert pull.head(lookup).status_code == 405  # the route is GET only (MethodGate: app.py)


def test_a_revoked_key_stops_looking_up_within_auth_cache_s(seeded: dict, api_url: str) -> None:
    r = api.post(f"{api_url}/v1/keys", json={"scope": "pull", "namespace": "revoked-lookup", "name": "revoke me"})
    record = r.json()
    http = httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {record['key']}"}, timeout=10)
    lookup = f"/v1/artifacts/lookup?model_id={'0' * 64}&target=cpu&shape=x=8x4"
    assert http.get(lookup).status_code == 404  # the key is good (the model is simply unknown)
    assert api.delete(f"{api_url}/v1/keys/{record['id']}").status_code == 200
    revoked = time.monotonic()
    while (status := http.get(lookup).status_code) != 401:
        assert status == 404
        assert time.monotonic() - revoked < 5.0 + 2.0, "the revoked key still looks up past AOTC_AUTH_CACHE_S"
        time.sleep(0.2)


def test_the_query_parser_takes_only_what_the_route_would_take_the_same_way() -> None:
    mid = "ab" * 32
    assert _query(f"model_id={mid}&shape=x=8x4".encode()) == (mid, "cpu", ["x=8x4"], None, False, False)
    assert _query(f"model_id={mid[:8]}&target=CUDA-sm90&shape=x=1..8x4&shape=y=scalar&mode=max-autotune&graphs=1"
                  f"&unknown=1".encode()) == (mid[:8], "CUDA-sm90", ["x=1..8x4", "y=scalar"], "max-autotune", True,
                                              False)
    # allow_unverified reaches the answer (the fast route once ignored it and served as if it were false)
    assert _query(f"model_id={mid}&shape=x=8x4&allow_unverified=true".encode())[-1] is True
    declined = [
        f"model_id={mid}&model_id={mid}",  # which of two the route takes is its business
        f"model_id={mid}&target=cpu&target=cuda",
        f"model_id={mid}%0A", f"model_id={mid.upper()}", f"model_id={mid[:7]}", f"model_id={mid}a",
        f"model_id={mid}&target=cpu%0A", f"model_id={mid}&target=cpu-{'a' * 64}",
        f"model_id={mid}&shape=x=8x4%0A", f"model_id={mid}&shape=x={'1' * 20}",
        f"model_id={mid}&shape=%C3%A9=8", f"model_id={mid}&shape=x=8x%D9%A3",  # non-ASCII letters and digits
        f"model_id={mid}&" + "&".join(["shape=x=1"] * 65),
        f"model_id={mid}&graphs=yes", f"model_id={mid}&graphs=True", f"model_id={mid}&mode=",
        f"model_id={mid}&allow_unverified=yes", f"model_id={mid}&allow_unverified=0&allow_unverified=1",
        "shape=x=8x4", "",
    ]
    for q in declined:
        assert _query(q.encode()) is None, q
