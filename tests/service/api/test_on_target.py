"""Lookup and the pick prefer packages that ran on their target (compiler/ontarget.py): one built elsewhere and not
yet countersigned is served only when asked (allow_unverified), after any that ran there, and the answers say why.
Records only: nothing here compiles."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from compiler import cachekey
from procs import api
from service.store import Store

V3, V4 = "cpu-x86_64-v3", "cpu-x86_64-v4"


def _model(store: Store) -> str:
    model_id = uuid.uuid4().hex * 2
    store.models.put({"id": model_id, "name": "ontarget", "size": 1, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": [8, 4]}]})
    return model_id


def _publish(store: Store, tmp_path, model_id: str, target: str, mark: dict[str, Any] | None,
             options: dict[str, Any] | None = None) -> str:
    spec = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    factors = cachekey.factors(model_id, spec, target, {"torch": "2.13.0"}, options or {})
    key = cachekey.cache_key(factors)
    package = tmp_path / f"{key}.pt2"
    package.write_bytes(b"package " + key.encode())
    record = {"key": key, "factors": factors, "model_id": model_id, "target": target, "spec": spec,
              "options": options or {}}
    if mark is not None:
        record["on_target"] = mark
    store.artifacts.put(record, package)
    return key


def _lookup(url: str, model_id: str, target: str, **params: str) -> httpx.Response:
    return api.get(f"{url}/v1/artifacts/lookup", params={"model_id": model_id, "target": target,
                                                         "shape": "x=8x4", **params})


UNVERIFIED = {"state": "unverified", "built_on": V4}


def test_lookup_serves_an_unverified_build_only_when_asked_and_says_why(api_url, store, tmp_path):
    model_id = _model(store)
    blind = _publish(store, tmp_path, model_id, V3, UNVERIFIED)
    refused = _lookup(api_url, model_id, V3)
    assert refused.status_code == 404
    message = refused.json()["error"]["message"]
    assert blind[:12] in message and "built, not run on target" in message and V4 in message, message
    asked = _lookup(api_url, model_id, V3, allow_unverified="true")
    assert asked.status_code == 200 and asked.json()["key"] == blind
    assert asked.json()["on_target"] == UNVERIFIED
    # Once countersigned (the record rewritten), it is served unasked: the remembered 404 is not.
    store.artifacts.set_on_target(blind, {**UNVERIFIED, "state": "verified", "by": "00" * 8, "checked_on": V3})
    assert _lookup(api_url, model_id, V3).json()["key"] == blind


def test_a_build_that_ran_on_its_target_wins_even_when_unverified_ones_are_allowed(api_url, store, tmp_path):
    model_id = _model(store)
    native = _publish(store, tmp_path, model_id, V3, None)
    _publish(store, tmp_path, model_id, V3, UNVERIFIED, {"mode": "max-autotune"})  # newer: would rank first
    assert _lookup(api_url, model_id, V3, allow_unverified="true").json()["key"] == native


def test_a_build_whose_check_failed_on_target_is_never_served(api_url, store, tmp_path):
    model_id = _model(store)
    _publish(store, tmp_path, model_id, V3, {**UNVERIFIED, "state": "failed", "why": "disagrees with eager"})
    assert _lookup(api_url, model_id, V3, allow_unverified="true").status_code == 404


def test_the_pick_rejects_an_unverified_build_with_the_reason_and_takes_it_when_asked(api_url, store, tmp_path):
    name = f"ontarget-{uuid.uuid4().hex[:6]}"
    model_id = _model(store)
    blind = _publish(store, tmp_path, model_id, V3, UNVERIFIED)
    api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_id, "tags": ["prod"]})
    pick = f"{api_url}/v1/refs/{name}:prod/pick"
    refused = api.get(pick, params={"host": V3, "shape": "x=8x4"})
    assert refused.status_code == 404, refused.text
    why = refused.json()["error"]["candidates"][0]["why"]
    assert any("built, not run on target" in w and "allow_unverified" in w for w in why), why
    taken = api.get(pick, params={"host": V3, "shape": "x=8x4", "allow_unverified": "true"}).json()
    assert taken["key"] == blind and "taken as asked (allow_unverified)" in taken["reason"], taken
    # A native v2 build fits a v3 host too: it ran on its target, so it wins over the exact but unverified v3.
    v2 = _publish(store, tmp_path, model_id, "cpu-x86_64-v2", None)
    preferred = api.get(pick, params={"host": V3, "shape": "x=8x4", "allow_unverified": "true"}).json()
    assert preferred["key"] == v2, preferred
    lost = {r["key"]: r["why"] for r in preferred["rejected"]}[blind]
    assert "builds that ran on their target fit" in lost[0], lost


def test_the_console_artifact_page_says_whether_it_ran_on_target(api_url, store, tmp_path):
    import re

    from procs import ADMIN_KEY

    model_id = _model(store)
    blind = _publish(store, tmp_path, model_id, V3, UNVERIFIED)
    c = httpx.Client(base_url=api_url, timeout=10)
    token = re.search(r'name="csrf" value="([^"]+)"', c.get("/ui/login").text)
    assert token
    c.post("/ui/login", data={"key": ADMIN_KEY, "csrf": token.group(1), "next": "/ui/models"},
           headers={"Origin": api_url})
    page = c.get(f"/ui/artifacts/{blind}").text
    assert "<b>built, not run on target</b>: built and checked on <span class=\"mono\">cpu-x86_64-v4</span>" in page
    store.artifacts.set_on_target(blind, {**UNVERIFIED, "state": "verified", "by": "ab" * 8, "checked_on": V3})
    page = c.get(f"/ui/artifacts/{blind}").text
    assert f"countersigned by key <span class=\"mono\">{'ab' * 8}</span>" in page
