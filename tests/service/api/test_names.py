"""The registry over HTTP: names, versions and tags in a namespace, a compile request for several targets, and
picking a version's artifact for a host. Real parts: the session's redis-server and uvicorn; no compile runs.

Fake workers (registry records, as test_tenancy.py makes them) let the API accept jobs for made-up targets, which
stay queued; the artifacts the pick tests choose between are published through the Store as a worker would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from procs import api, new_key, publish
from service.store import Store

RUN = uuid.uuid4().hex[:6]
# Made-up targets that sort after every real one, so that a request for 'cpu' elsewhere never lands on them.
T1, T2 = f"cpu-zreg{RUN}-one", f"cpu-zreg{RUN}-two"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key(url: str, scope: str, ns: str) -> str:
    return new_key(url, scope, ns, f"names {scope}")


def _model(store: Store, *namespaces: str) -> str:
    """A model record (no bytes: nothing here compiles it), held by `namespaces`."""
    model_id = uuid.uuid4().hex * 2
    dims = [{"symbol": "s0", "min": 1, "max": 64}, 4]
    store.models.put({"id": model_id, "name": "names", "size": 1, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": dims}]})
    for ns in namespaces:
        store.namespaces.add_model(ns, model_id, "names")
    return model_id


@pytest.fixture(scope="module")
def fake_workers(store: Store) -> Iterator[list[str]]:
    for t in (T1, T2):
        store.workers.heartbeat({"id": f"fake-{t}", "target": t, "toolchain": {"torch": "fake"},
                                 "device_name": "none", "started": time.time()}, ttl_s=3600)
    yield [T1, T2]
    for t in (T1, T2):
        store.workers.remove(f"fake-{t}")


def _compile(url: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/compilations", json={"shapes": {"x": [8, 4]}, **body},
                      headers=headers or api.headers, timeout=30)


def test_compile_by_name_records_versions_moves_tags_and_latest_follows(api_url, store, fake_workers):
    name = f"bert-{RUN}"
    first, second = _model(store), _model(store)
    r = _compile(api_url, model_id=first, target=T1, name=name, tags=["prod", "canary"])
    assert r.status_code == 202, r.text
    v1 = r.json()["version"]
    assert (v1["ref"], v1["model_id"], sorted(v1["tags"])) == (f"{name}@1", first, ["canary", "prod"])
    assert v1["builds"] == [{"target": T1, "key": r.json()["key"], "job": r.json()["job"]["id"], "status": "queued"}]

    r = _compile(api_url, model_id=second, target=T1, name=name, tags=["prod"])
    assert r.json()["version"]["version"] == 2
    assert api.get(f"{api_url}/v1/refs/{name}:prod").json()["model_id"] == second
    assert api.get(f"{api_url}/v1/refs/{name}:canary").json()["version"] == 1
    latest = api.get(f"{api_url}/v1/refs/{name}").json()  # a bare name is its latest
    assert (latest["version"], latest["tags"]) == (2, ["latest", "prod"])
    assert api.get(f"{api_url}/v1/refs/{name}@1").json()["tags"] == ["canary"]
    assert api.get(f"{api_url}/v1/refs/{name}@1").json()["model_id"] == first

    moved = api.put(f"{api_url}/v1/names/{name}/tags/prod", json={"version": 1})
    assert moved.status_code == 200, moved.text
    assert (moved.json()["version"], moved.json()["previous"]) == (1, 2)
    assert api.get(f"{api_url}/v1/refs/{name}:prod").json()["version"] == 1

    listing = api.get(f"{api_url}/v1/names/{name}").json()["versions"]
    assert [(v["version"], sorted(v["tags"])) for v in listing] == [(2, ["latest"]), (1, ["canary", "prod"])]
    # Per target: the job its compile request queued, with the job's state.
    assert listing[1]["artifacts"] == [{"target": T1, "status": "queued", "key": v1["builds"][0]["key"],
                                        "job": v1["builds"][0]["job"]}]

    history = api.get(f"{api_url}/v1/names/{name}/history").json()["moves"]
    assert [(m["tag"], m.get("from"), m.get("to")) for m in history] == [
        ("prod", 2, 1), ("prod", 1, 2), ("canary", None, 1), ("prod", None, 1)]
    assert all(m["by"] == "bootstrap" and abs(m["at"] - time.time()) < 60 for m in history)

    assert api.delete(f"{api_url}/v1/names/{name}/tags/canary").json()["previous"] == 1
    assert api.get(f"{api_url}/v1/refs/{name}:canary").status_code == 404
    gone = api.delete(f"{api_url}/v1/names/{name}/versions/1").json()
    assert gone == {"ref": f"{name}@1", "tags_removed": ["prod"], "model_still_held_by": 0}
    assert api.get(f"{api_url}/v1/refs/{name}:prod").status_code == 404
    assert api.get(f"{api_url}/v1/refs/{name}").json()["version"] == 2
    assert api.get(f"{api_url}/v1/names/{name}/history").json()["moves"][0] == {
        **api.get(f"{api_url}/v1/names/{name}/history").json()["moves"][0], "tag": "prod", "from": 1}


def test_concurrent_tag_moves_are_atomic_and_each_is_recorded(api_url, store):
    name = f"race-{RUN}"
    model_id = _model(store)
    for _ in range(8):
        assert api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_id}).status_code == 201

    def move(v: int) -> int:
        r = httpx.put(f"{api_url}/v1/names/{name}/tags/prod", json={"version": v}, headers=api.headers, timeout=30)
        assert r.status_code == 200, r.text
        return int(r.json()["previous"] or 0)

    with ThreadPoolExecutor(8) as pool:
        previous = list(pool.map(move, range(1, 9)))
    moves = list(reversed(api.get(f"{api_url}/v1/names/{name}/history").json()["moves"]))
    assert len(moves) == 8
    # Each move saw the one before it: the history is one chain from no tag to where the tag is now.
    assert moves[0].get("from") is None
    assert all(b["from"] == a["to"] for a, b in zip(moves, moves[1:], strict=False))
    assert sorted(p for p in previous if p) == sorted(m["to"] for m in moves[:-1])
    assert api.get(f"{api_url}/v1/refs/{name}:prod").json()["version"] == moves[-1]["to"]


@pytest.mark.parametrize(("where", "bad", "why"), [
    ("name", "Bert", "is not allowed"), ("name", "../x", "is not allowed"), ("name", "a b", "is not allowed"),
    ("name", "bert\u202e", "is not allowed"), ("name", "b" * 65, "AOTC_MAX_REGISTRY_NAME_CHARS"),
    ("tag", "latest", "always names the newest"), ("tag", "-x", "is not allowed"),
    ("tag", "t" * 65, "AOTC_MAX_REGISTRY_NAME_CHARS"),
    # a final newline once passed (the grammar's `$` under re.match): a name no route could read, tag or delete
    ("name", "evil\n", "is not allowed"), ("tag", "prod\n", "is not allowed"),
])
def test_names_and_tags_are_checked_before_anything_is_queued(api_url, store, fake_workers, where, bad, why):
    model_id = _model(store)
    body = {"name": bad} if where == "name" else {"name": f"ok-{RUN}", "tags": [bad]}
    jobs_before = store.r.zcard("aotc:jobs:index")
    r = _compile(api_url, model_id=model_id, target=T1, **body)
    assert r.status_code == (409 if bad == "latest" else 422), r.text
    assert why in r.json()["error"]["message"]
    assert store.r.zcard("aotc:jobs:index") == jobs_before  # nothing queued
    if where == "name":
        path = api.get(f"{api_url}/v1/names/{bad.replace('/', '%2F').replace(chr(10), '%0A')}")
        assert path.status_code in (404, 422)  # no route for a slash; a bad name otherwise
        if "\n" not in bad:  # httpx sends no raw newline
            assert api.get(f"{api_url}/v1/names/{bad}").status_code != 200


def test_limits_are_settings_named_in_the_error(api_url, store):
    name = f"full-{RUN}"
    model_id = _model(store)
    for _ in range(3):
        api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_id})
    from service.store.names import Limits

    with pytest.raises(Exception) as refused:
        store.names.add_version("default", name, model_id, "test", limits=Limits(max_versions=3))
    assert "AOTC_MAX_VERSIONS_PER_NAME" in str(refused.value)
    with pytest.raises(Exception) as refused:
        store.names.add_version("default", name, model_id, "test", tags=["a", "b"], limits=Limits(max_tags=1))
    assert "AOTC_MAX_TAGS_PER_NAME" in str(refused.value)
    assert len(api.get(f"{api_url}/v1/names/{name}").json()["versions"]) == 3  # a refusal changed nothing


def test_a_namespace_holds_at_most_its_limit_of_versions_over_all_its_names(api_url, store):
    """The limits were per name (1,000 versions on each of 10,000 names): about 10 GB of Redis one namespace could
    hold. AOTC_MAX_REGISTRY_VERSIONS counts every name's versions; a count missing (a namespace from before it) is
    made from what the namespace holds."""
    from service.store import keys
    from service.store.names import Limits

    ns, model_id = f"vcap{RUN}", _model(store)
    limits = Limits(max_ns_versions=4)
    for name in ("a", "b", "c"):
        store.names.add_version(ns, f"{name}-{RUN}", model_id, "test", limits=limits)
    store.names.add_version(ns, f"a-{RUN}", model_id, "test", limits=limits)
    with pytest.raises(Exception) as refused:
        store.names.add_version(ns, f"d-{RUN}", model_id, "test", limits=limits)
    assert "versions in namespace" in str(refused.value) and "AOTC_MAX_REGISTRY_VERSIONS" in str(refused.value)
    assert store.names.delete_version(ns, f"b-{RUN}", 1, "test") == []
    store.names.add_version(ns, f"d-{RUN}", model_id, "test", limits=limits)  # room again
    assert int(store.r.get(keys.ns(ns, "reg-versions"))) == 4
    store.r.delete(keys.ns(ns, "reg-versions"))  # as a namespace from before the count
    with pytest.raises(Exception, match="AOTC_MAX_REGISTRY_VERSIONS"):
        store.names.add_version(ns, f"e-{RUN}", model_id, "test", limits=limits)
    assert int(store.r.get(keys.ns(ns, "reg-versions"))) == 4


def test_a_namespace_tag_history_is_bounded_and_deleted_names_are_forgotten(store):
    """Tag history was capped per name only (1,000 moves on each of 10,000 names: about 0.9 GB of Redis), and a
    name whose last version was deleted left its history and version counter behind for good, so making and
    deleting names grew Redis without end. AOTC_MAX_TAG_HISTORY bounds the moves kept over the namespace (the
    oldest gone names forgotten first, then the moved name keeps its newest 10); AOTC_MAX_GONE_NAMES bounds the
    gone names remembered."""
    from service.store import keys
    from service.store.names import Limits

    ns, model_id = f"hcap{RUN}", _model(store)
    limits = Limits(max_ns_history=30, max_gone=2)
    r, count = store.r, keys.ns(ns, "reg-history")

    def kept() -> int:  # every history list the namespace still has, live names or gone
        return sum(int(r.llen(k)) for k in r.scan_iter(keys.ns(ns, "reg:*:history")))

    def churn(name: str, moves: int) -> None:
        store.names.add_version(ns, name, model_id, "test", tags=["prod"], limits=limits)
        store.names.add_version(ns, name, model_id, "test", limits=limits)
        for i in range(moves):
            store.names.move_tag(ns, name, "prod", 1 + (i + 1) % 2, "test", limits=limits)

    a, b = f"a-{RUN}", f"b-{RUN}"
    churn(a, 20)  # 21 moves: under the budget, all kept
    assert len(store.names.history(ns, a, 1000)) == 21 and int(r.get(count)) == kept() == 21
    churn(b, 20)  # past 30: the name being moved keeps its newest 10, the other name is left alone
    hist_b = store.names.history(ns, b, 1000)
    assert len(hist_b) == 10 and hist_b[0]["to"] == 1  # the newest kept: the 20th move, to version 1
    assert len(store.names.history(ns, a, 1000)) == 21 and int(r.get(count)) == kept() == 31

    # a's versions deleted: a is gone (the deletion's tag removal, recorded past the budget, left it its newest 10),
    # its history and version counter kept ...
    store.names.delete_version(ns, a, 1, "test", limits=limits)
    store.names.delete_version(ns, a, 2, "test", limits=limits)
    assert r.zscore(keys.ns(ns, "reg-gone"), a) is not None and r.exists(keys.reg(ns, a, "seq"))
    assert len(store.names.history(ns, a, 1000)) == 10 and int(r.get(count)) == kept() == 20
    # ... until moves past the budget forget the oldest gone name first, before any live name's moves.
    for i in range(11):
        store.names.move_tag(ns, b, "prod", 2 - i % 2, "test", limits=limits)
    assert not r.exists(keys.reg(ns, a, "history")) and not r.exists(keys.reg(ns, a, "seq"))
    assert len(store.names.history(ns, b, 1000)) == 21 and int(r.get(count)) == kept() == 21
    assert store.names.add_version(ns, a, model_id, "test", limits=limits).version == 1  # made again: from 1
    assert r.zscore(keys.ns(ns, "reg-gone"), a) is None

    # Made and deleted, over and over: only the newest AOTC_MAX_GONE_NAMES gone names keep anything.
    gone = [f"g{i}-{RUN}" for i in range(4)]
    for name in gone:
        store.names.add_version(ns, name, model_id, "test", limits=limits)
        store.names.delete_version(ns, name, 1, "test", limits=limits)
    assert r.zrange(keys.ns(ns, "reg-gone"), 0, -1) == gone[2:]
    assert [bool(r.exists(keys.reg(ns, name, "seq"))) for name in gone] == [False, False, True, True]

    # A namespace from before the count gets it made from what it holds.
    r.delete(count)
    store.names.move_tag(ns, b, "prod", 1, "test", limits=limits)
    assert int(r.get(count)) == kept()


def test_a_name_resolves_only_in_its_namespace_and_a_pull_key_only_reads(api_url, store):
    a, b = f"rega{RUN}", f"regb{RUN}"
    compile_a, pull_a, compile_b = _key(api_url, "compile", a), _key(api_url, "pull", a), _key(api_url, "compile", b)
    name = "shared-name"
    model_a, model_b = _model(store, a), _model(store, b)
    r = httpx.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_a, "tags": ["prod"]},
                   headers=_bearer(compile_a))
    assert r.status_code == 201, r.text
    assert r.json()["by"] != "bootstrap"  # the key that made it
    # B cannot point a version at A's model, and sees nothing of A's name.
    assert httpx.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_a},
                      headers=_bearer(compile_b)).status_code == 404
    assert httpx.get(f"{api_url}/v1/refs/{name}:prod", headers=_bearer(compile_b)).status_code == 404
    assert httpx.get(f"{api_url}/v1/names/{name}", headers=_bearer(compile_b)).status_code == 404
    # B's own name of the same spelling is its own.
    assert httpx.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_b, "tags": ["prod"]},
                      headers=_bearer(compile_b)).json()["version"] == 1
    assert httpx.get(f"{api_url}/v1/refs/{name}:prod", headers=_bearer(compile_b)).json()["model_id"] == model_b
    # A pull key resolves A's tag, and can change nothing.
    assert httpx.get(f"{api_url}/v1/refs/{name}:prod", headers=_bearer(pull_a)).json()["model_id"] == model_a
    assert httpx.put(f"{api_url}/v1/names/{name}/tags/prod", json={"version": 1},
                     headers=_bearer(pull_a)).status_code == 403
    assert httpx.delete(f"{api_url}/v1/names/{name}/versions/1", headers=_bearer(pull_a)).status_code == 403
    assert [n["name"] for n in httpx.get(f"{api_url}/v1/names", headers=_bearer(pull_a)).json()["names"]] == [name]


def test_one_request_for_several_targets_reports_each(api_url, store, fake_workers):
    model_id = _model(store)
    r = _compile(api_url, model_id=model_id, targets=[T1, T2, "cuda-sm80"], buckets=[{"x": [2, 4]}])
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["status"] == "partial" and "key" not in body
    one, two, gpu = body["targets"]
    assert (one["target"], one["status"], one["job"]["target"]) == (T1, "queued", T1)
    assert (two["target"], two["status"], two["job"]["target"]) == (T2, "queued", T2)
    assert [b["job"]["target"] for b in one["buckets"] + two["buckets"]] == [T1, T2]  # buckets multiply
    assert len({one["key"], two["key"], one["buckets"][0]["key"], two["buckets"][0]["key"]}) == 4
    assert gpu["status"] == "unserved" and gpu["error"]["code"] == "unavailable"
    assert "only a worker on an sm80 GPU can build it" in gpu["error"]["message"] and T1 in gpu["error"]["live_targets"]

    again = _compile(api_url, model_id=model_id, targets=[T1, T2])
    assert again.status_code == 202 and again.json()["status"] == "queued"
    assert [t["status"] for t in again.json()["targets"]] == ["joined", "joined"]

    assert _compile(api_url, model_id=model_id, targets=["cuda-sm80", "cuda-sm70"]).status_code == 503
    both = _compile(api_url, model_id=model_id, target=T1, targets=[T2])
    assert both.status_code == 422 and "not both" in both.json()["error"]["message"]
    single = _compile(api_url, model_id=model_id, target=T1)  # the one-target request, unchanged
    assert single.status_code == 202 and single.json()["status"] == "joined" and "targets" not in single.json()


def test_all_expands_to_every_served_target_within_the_limit(fake_workers):
    from compiler.errors import Unprocessable
    from compiler.targets import Target
    from service.api.routes.compilations import _targets

    live = [{"target": T1}, {"target": T2, "targets": [T2, f"{T2}-low"]}]
    assert [str(t) for t in _targets(["all", T1], live, 8)] == [T1, T2, f"{T2}-low"]
    assert _targets(["cpu", "CPU"], live, 8) == [Target("cpu")]
    with pytest.raises(Unprocessable, match="AOTC_MAX_TARGETS_PER_REQUEST"):
        _targets(["all"], live, 2)


# -- picking a version's artifact for a host ----------------------------------------------------------------------


def _publish(store: Store, tmp_path, model_id: str, target: str, shape: list[Any], torch: str = "2.13.0") -> str:
    return publish(store, tmp_path, model_id, [{"name": "x", "dtype": "float32", "shape": shape}], target, torch=torch)


def _pick(url: str, ref: str, host: str, **params: Any) -> httpx.Response:
    return api.get(f"{url}/v1/refs/{ref}/pick", params={"host": host, **params})


def test_the_pick_takes_the_exact_target_then_the_highest_compatible_and_says_why(api_url, store, tmp_path):
    name = f"fleet-{RUN}"
    model_id = _model(store)
    v4 = _publish(store, tmp_path, model_id, "cpu-x86_64-v4", [8, 4])
    v3 = _publish(store, tmp_path, model_id, "cpu-x86_64-v3", [8, 4])
    v1 = _publish(store, tmp_path, model_id, "cpu-x86_64-v2", [8, 4])
    gpu = _publish(store, tmp_path, model_id, "cuda-sm90", [8, 4])
    api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_id, "tags": ["prod"]})

    exact = _pick(api_url, f"{name}:prod", "cpu-x86_64-v4", shape="x=8x4", torch="2.13.0").json()
    assert (exact["key"], exact["match"]) == (v4, "exact")
    why = {r["key"]: r["why"] for r in exact["rejected"]}
    assert why[gpu] == ["target: it was built for cuda-sm90; load it on a CUDA device"]
    assert why[v3][0].startswith("not picked") and why[v1][0].startswith("not picked")

    lower = _pick(api_url, f"{name}:prod", "cpu-x86_64-v3").json()
    assert (lower["key"], lower["match"]) == (v3, "exact")
    assert any("this machine's CPU is cpu-x86_64-v3" in w for w in {r["key"]: r["why"] for r in lower["rejected"]}[v4])

    # No exact build: the highest level the host can run (v3 over v2 on a v4 host).
    other = _model(store)
    c3 = _publish(store, tmp_path, other, "cpu-x86_64-v3", [8, 4])
    _publish(store, tmp_path, other, "cpu-x86_64-v2", [8, 4])
    api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": other, "tags": ["canary"]})
    compat = _pick(api_url, f"{name}:canary", "cpu-x86_64-v4").json()
    assert (compat["key"], compat["match"]) == (c3, "compatible")
    assert "cpu-x86_64-v3 runs on it" in compat["reason"]

    # A package of an old label was built with -march=native: never picked (as lookup never serves one), and said so.
    legacy = _model(store)
    old = _publish(store, tmp_path, legacy, "cpu-x86_64-avx2", [8, 4])
    api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": legacy, "tags": ["legacy"]})
    refused = _pick(api_url, f"{name}:legacy", "cpu-x86_64-v3")
    assert refused.status_code == 404
    assert "-march=native" in refused.json()["error"]["candidates"][0]["why"][0], refused.text
    assert refused.json()["error"]["candidates"][0]["key"] == old

    # A remembered pick never outlives a tag move, nor an artifact published since.
    assert _pick(api_url, f"{name}:prod", "cpu-x86_64-v4").json()["key"] == v4
    api.put(f"{api_url}/v1/names/{name}/tags/prod", json={"version": 2})
    assert _pick(api_url, f"{name}:prod", "cpu-x86_64-v4").json()["key"] == c3
    c4 = _publish(store, tmp_path, other, "cpu-x86_64-v4", [8, 4])
    assert _pick(api_url, f"{name}:prod", "cpu-x86_64-v4").json()["key"] == c4


def test_when_nothing_fits_the_error_lists_each_candidate_and_why(api_url, store, tmp_path):
    name = f"nofit-{RUN}"
    model_id = _model(store)
    high = _publish(store, tmp_path, model_id, "cpu-x86_64-v4", [8, 4])
    old = _publish(store, tmp_path, model_id, "cpu-x86_64-v3", [8, 4], torch="2.11.0")
    small = _publish(store, tmp_path, model_id, "cpu-x86_64-v2", [2, 4])
    api.post(f"{api_url}/v1/names/{name}/versions", json={"model_id": model_id})
    r = _pick(api_url, name, "cpu-x86_64-v3", shape="x=8x4", torch="2.13.0")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    why = {c["key"]: c["why"] for c in err["candidates"]}
    assert why[high] == ["target: it was built for cpu-x86_64-v4; this machine's CPU is cpu-x86_64-v3"]
    assert why[old] == ["toolchain: built with torch 2.11.0; this host has torch 2.13.0"]
    assert why[small] == ["shapes: it serves x=2x4; asked for x=8x4"]
    for key in (high, old, small):
        assert key[:12] in err["message"]
    assert _pick(api_url, f"{name}:nope", "cpu-x86_64-v3").status_code == 404
    kind = _pick(api_url, name, "cpu")  # a device kind is not a host
    assert kind.status_code == 422 and "not a host's target" in kind.json()["error"]["message"]


def test_a_version_keeps_its_models_artifacts_from_eviction_until_the_last_holder_goes(tmp_path):
    from service.store import StorageOptions
    from service.store.embedded import EmbeddedRedis

    own = EmbeddedRedis(tmp_path / "redis").start()  # it evicts all it may: not the session's artifacts
    bounded = Store(own.url, storage=StorageOptions(max_artifact_bytes=10**12))
    try:
        held, free = _model(bounded, "default"), _model(bounded, "default")
        kept = _publish(bounded, tmp_path, held, "cpu-x86_64-v3", [8, 4])
        evictable = _publish(bounded, tmp_path, free, "cpu-x86_64-v3", [8, 4])
        one = bounded.names.add_version("default", f"keep-{RUN}", held, "test")
        two = bounded.names.add_version("default", f"also-{RUN}", held, "test")
        bounded.artifacts.max_bytes = 0  # everything must go that may
        evicted = bounded.artifacts.make_room()
        assert evictable in evicted and kept not in evicted and bounded.artifacts.get(kept)
        bounded.names.delete_version("default", one.name, one.version, "test")
        assert kept not in bounded.artifacts.make_room()  # the other version still holds the model
        bounded.names.delete_version("default", two.name, two.version, "test")
        assert kept in bounded.artifacts.make_room()  # nothing holds it now: eviction takes it as any other
    finally:
        bounded.close()
        own.stop()


def test_deleting_a_version_counts_only_this_namespaces_holders_of_the_model(api_url, store):
    """B's answer for deleting its version says nothing of A's versions of the same model: counting every
    namespace's told B whether A's registry held it."""
    a, b = f"holda{RUN}", f"holdb{RUN}"
    key_a, key_b = _key(api_url, "compile", a), _key(api_url, "compile", b)
    model = _model(store, a, b)  # the same bytes uploaded by both
    for key in (key_a, key_a, key_b, key_b):
        r = httpx.post(f"{api_url}/v1/names/held/versions", json={"model_id": model}, headers=_bearer(key))
        assert r.status_code == 201, r.text
    assert len(store.names.holders(model)) == 4  # all four pin its artifacts
    gone = httpx.delete(f"{api_url}/v1/names/held/versions/2", headers=_bearer(key_b)).json()
    assert gone["model_still_held_by"] == 1, gone  # B's version 1; A's two are not B's to count
    gone = httpx.delete(f"{api_url}/v1/names/held/versions/1", headers=_bearer(key_b)).json()
    assert gone["model_still_held_by"] == 0, gone
    assert store.names.holders(model) == [f"{a}/held@1", f"{a}/held@2"]  # A's still pin it
