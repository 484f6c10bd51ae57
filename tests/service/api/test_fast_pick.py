"""GET /v1/refs/{ref}/pick's plain route (service/api/routes/names.py FastPick) answers as the FastAPI route does.

As for the lookup (test_fast_lookup.py): the plain route takes a request only when the reference and every parameter
are within the route's grammar and the key may pull, and hands everything else to the FastAPI route. Each answer is
asked for twice over HTTP against the session's server: once as the plain route takes it, and once with `training`
spelt `False`/`True` (a spelling only the FastAPI route reads, same meaning); the two must match byte for byte.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from procs import api, new_key, publish
from service.api.routes.names import _pick_query
from service.store import Store

INPUTS = [{"name": "x", "dtype": "float32", "shape": [{"symbol": "s0", "min": 1, "max": 64}, 4]}]


def _publish(store: Store, tmp: Path, model_id: str, target: str, shape: list[Any], torch: str = "2.13.0") -> str:
    return publish(store, tmp, model_id, [{"name": "x", "dtype": "float32", "shape": shape}], target, torch=torch)


def _key(url: str, scope: str, ns: str) -> httpx.Client:
    key = new_key(url, scope, ns, "fast pick")
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10)


@pytest.fixture(scope="module")
def seeded(api_url: str, store: Store, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fast-pick")
    ns, name = f"pick-{uuid.uuid4().hex[:6]}", f"fleet-{uuid.uuid4().hex[:6]}"
    models = []
    for _ in range(2):
        model_id = uuid.uuid4().hex * 2
        store.models.put({"id": model_id, "name": "fast", "size": 1, "created": time.time(), "inputs": INPUTS})
        store.namespaces.add_model(ns, model_id, name)
        models.append(model_id)
    keys = {"v4": _publish(store, tmp, models[0], "cpu-x86_64-v4", [8, 4]),
            "v3": _publish(store, tmp, models[0], "cpu-x86_64-v3", [8, 4]),
            "old": _publish(store, tmp, models[0], "cpu-x86_64-v2", [8, 4], torch="2.11.0"),
            "dynamic": _publish(store, tmp, models[0], "cpu-x86_64-v3", [{"min": 1, "max": 32}, 4]),
            "canary": _publish(store, tmp, models[1], "cpu-x86_64-v2", [8, 4])}
    store.names.add_version(ns, name, models[0], "test", tags=["prod"])
    store.names.add_version(ns, name, models[1], "test", tags=["canary"])
    return {"name": name, "keys": keys, "admin": httpx.Client(base_url=api_url, headers=api.headers),
            "pull": _key(api_url, "pull", ns), "other": _key(api_url, "pull", f"other-{ns}")}


def _both(client: httpx.Client, ref: str, training: bool, **params: str) -> tuple[httpx.Response, httpx.Response]:
    fast_params = {**params, "training": "true" if training else "false"}
    route_params = {**params, "training": "True" if training else "False"}
    # The first is the plain route's to answer, the second the FastAPI route's: the parser says so.
    path = f"/v1/refs/{ref}/pick"
    assert _pick_query(path, str(httpx.QueryParams(fast_params)).encode()) is not None, (ref, fast_params)
    assert _pick_query(path, str(httpx.QueryParams(route_params)).encode()) is None, (ref, route_params)
    return client.get(path, params=fast_params), client.get(path, params=route_params)


def test_the_plain_route_answers_every_pick_as_the_fastapi_route(seeded: dict) -> None:
    name, keys = seeded["name"], seeded["keys"]
    v4 = {"host": "cpu-x86_64-v4"}
    cases = [
        ("pull", f"{name}:prod", v4 | {"shape": "x=8x4", "torch": "2.13.0"}, 200, keys["v4"]),
        ("pull", f"{name}:prod", {"host": "cpu-x86_64-v3", "shape": "x=8x4"}, 200, keys["v3"]),
        ("pull", f"{name}:prod", {"host": "cpu-x86_64-v3", "shape": "x=3x4"}, 200, keys["dynamic"]),
        ("pull", f"{name}:canary", v4, 200, keys["canary"]),  # a compatible level, with the reason
        ("pull", f"{name}@1", v4 | {"shape": "x=8x4"}, 200, keys["v4"]),
        ("pull", name, v4, 200, keys["canary"]),  # NAME is NAME:latest, the newest version
        ("pull", f"{name}:prod", v4 | {"allow_unverified": "true"}, 200, keys["v4"]),
        ("pull", f"{name}:prod", {"host": "cpu-x86_64-v2", "torch": "2.13.0"}, 404, None),  # each loser and why
        ("pull", f"{name}:prod", {"host": "cuda-sm90"}, 404, None),
        ("pull", f"{name}:nope", v4, 404, None),
        ("pull", f"{name}@9", v4, 404, None),
        ("pull", f"{name}:prod", v4 | {"shape": "x=100x4"}, 422, None),  # outside the program's range
        ("pull", f"{name}:prod", v4 | {"shape": "y=8x4"}, 422, None),  # no such input
        ("other", f"{name}:prod", v4, 404, None),  # another namespace's name: as if it did not exist
        ("admin", f"{name}:prod", v4, 404, None),  # an admin resolves in its own namespace
    ]
    for who, ref, params, status, key in cases:
        for training in (False, True):
            fast, route = _both(seeded[who], ref, training, **params)
            assert (fast.status_code, fast.content) == (route.status_code, route.content), (who, ref, params)
            assert fast.headers["content-type"] == route.headers["content-type"] == "application/json"
            if training:  # no train step is stored: nothing fits
                assert fast.status_code in (404, 422), (who, ref, params, fast.text)
                continue
            assert fast.status_code == status, (who, ref, params, fast.text)
            if key is not None:
                assert fast.json()["key"] == key, (who, ref, params)


def test_picks_the_plain_route_declines_get_the_routes_answers(seeded: dict, api_url: str) -> None:
    name, pull = seeded["name"], seeded["pull"]
    pick = f"/v1/refs/{name}:prod/pick?host=cpu-x86_64-v4&shape=x=8x4"
    assert pull.get(pick).status_code == 200
    for path, status, names in [
        (f"/v1/refs/{name}:prod/pick?host=cpu", 422, "not a host's target"),
        (f"/v1/refs/{name}:prod/pick?host=cpu-x86_64-v4&torch=2.13%20", 422, "torch"),
        (f"/v1/refs/{name}:prod/pick?host=cpu-x86_64-v4&shape=x=8y4", 422, "shape"),
        (f"/v1/refs/{name}:prod/pick?host=cpu-x86_64-v4&training=maybe", 422, "training"),
        (f"/v1/refs/{name.upper()}:prod/pick?host=cpu-x86_64-v4", 422, "ref"),
        (f"/v1/refs/{name}:prod/pick", 422, "host"),
    ]:
        r = pull.get(path)
        assert r.status_code == status and names in r.text, (path, r.status_code, r.text)
    assert httpx.get(f"{api_url}{pick}").status_code == 401  # no key
    r = httpx.get(f"{api_url}{pick}", headers={"Authorization": "Bearer aotc_nope_nope"})
    assert r.status_code == 401 and "not one this server knows" in r.text
    assert pull.head(pick).status_code == 405  # the route is GET only (MethodGate: app.py)


def test_the_pick_parser_takes_only_what_the_route_would_take_the_same_way() -> None:
    path = "/v1/refs/bert-base:prod/pick"
    assert _pick_query(path, b"host=cpu-x86_64-v4") == ("bert-base:prod", "cpu-x86_64-v4", [], None, False, False)
    assert _pick_query("/v1/refs/bert@3/pick", b"host=CUDA-sm90&shape=x=1..8x4&shape=y=scalar&torch=2.11.0%2Bcu128"
                       b"&allow_unverified=1&training=true&unknown=1") == (
        "bert@3", "CUDA-sm90", ["x=1..8x4", "y=scalar"], "2.11.0+cu128", True, True)
    declined = [
        (path, b"host=cpu"), (path, b"host=cuda"), (path, b""), (path, b"host=cpu-x86_64-v4%0A"),
        (path, b"host=cpu-x86_64-v4&host=cpu-x86_64-v3"),  # which of two the route takes is its business
        (path, b"host=cpu-" + b"a" * 64), (path, b"host=cpu-x86_64-v4&torch=" + b"1" * 65),
        (path, b"host=cpu-x86_64-v4&torch=2.13%2F0"), (path, b"host=cpu-x86_64-v4&torch="),
        (path, b"host=cpu-x86_64-v4&shape=x=8x4%0A"), (path, b"host=cpu-x86_64-v4&shape=%C3%A9=8"),
        (path, b"host=cpu-x86_64-v4&" + b"&".join([b"shape=x=1"] * 65)),
        (path, b"host=cpu-x86_64-v4&training=yes"), (path, b"host=cpu-x86_64-v4&training=True"),
        (path, b"host=cpu-x86_64-v4&allow_unverified=0&allow_unverified=1"),
        ("/v1/refs/Bert/pick", b"host=cpu-x86_64-v4"), ("/v1/refs/bert:/pick", b"host=cpu-x86_64-v4"),
        ("/v1/refs/bert@0/pick", b"host=cpu-x86_64-v4"), ("/v1/refs/b\u00e9rt/pick", b"host=cpu-x86_64-v4"),
        ("/v1/refs/" + "a" * 65 + "/pick", b"host=cpu-x86_64-v4"),
    ]
    for p, q in declined:
        assert _pick_query(p, q) is None, (p, q)
