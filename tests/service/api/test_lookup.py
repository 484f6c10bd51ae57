"""Deploy-time lookup ranks among the artifacts that satisfy every filter, `mode` included."""

from __future__ import annotations

import time

import httpx

from compiler import cachekey
from procs import api


def _publish(store, tmp_path, model_id: str, spec: list, mode: str, ms: float | None = None,
             device: str = "Test CPU", method: str | None = None, graph_ms: float | None = None,
             graph_ok: bool = True, eager_ms: float | None = None, embed: bool = False) -> str:
    options = {"mode": mode, **({"embed_weights": True} if embed else {})}
    factors = cachekey.factors(model_id, spec, "cpu-x86_64-test", {"torch": "test"}, options)
    key = cachekey.cache_key(factors)
    package = tmp_path / f"{key}.pt2"
    package.write_bytes(b"package bytes for " + key.encode())
    record = {"key": key, "factors": factors, "model_id": model_id, "target": "cpu-x86_64-test", "spec": spec,
              "options": options, "worker": {"device_name": device}}
    if ms is not None:
        record["check"] = {"passed": True, "compiled_ms": ms}
    if method is not None:  # a check that kept its spread: the median, how it was taken, and on what
        record["check"] = {"passed": True, "compiled_ms": round(ms or 0, 1), "device_info": {"name": device},
                           "latency": {"compiled": {"median_ms": ms, "p25_ms": ms, "p75_ms": ms, "method": method}}}
    if graph_ms is not None:  # a CUDA check that also captured and timed a graph replay
        record["check"]["graphs"] = {"captured": True, "ok": graph_ok, "pays": graph_ok}
        record["check"]["latency"]["graph"] = {"median_ms": graph_ms, "p25_ms": graph_ms, "p75_ms": graph_ms,
                                               "method": method}
    if eager_ms is not None:
        record["check"]["eager_ms"] = eager_ms
    store.artifacts.put(record, package)
    return key


def _model(store, model_id: str) -> None:
    dims = [{"symbol": "s0", "min": 1, "max": 64}, 4]
    store.models.put({"id": model_id, "name": "lookup", "size": 1, "created": time.time(),
                      "inputs": [{"name": "x", "dtype": "float32", "shape": dims}]})


def _lookup(api_url: str, model_id: str, **params: str) -> httpx.Response:
    return api.get(f"{api_url}/v1/artifacts/lookup",
                     params={"model_id": model_id, "target": "cpu", "shape": "x=8x4", **params})


def test_lookup_by_mode_finds_the_matching_artifact_behind_a_better_ranked_one(api_url, store, tmp_path):
    model_id = "ab" * 32
    _model(store, model_id)
    static = _publish(store, tmp_path, model_id, [{"name": "x", "dtype": "float32", "shape": [8, 4]}], "default")
    dynamic = _publish(store, tmp_path, model_id,
                       [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}], "max-autotune")

    def lookup(**params: str) -> httpx.Response:
        return _lookup(api_url, model_id, **params)

    assert lookup().json()["key"] == static  # static ranks first without a mode
    assert lookup(mode="max-autotune").json()["key"] == dynamic
    assert lookup(mode="default").json()["key"] == static
    assert lookup(mode="max-autotune", shape="x=33x4").status_code == 404


def test_of_equally_specialised_artifacts_the_faster_measured_one_is_served(api_url, store, tmp_path):
    model_id = "cd" * 32
    _model(store, model_id)
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    _publish(store, tmp_path, model_id, static, "max-autotune", ms=2.0)
    fast_default = _publish(store, tmp_path, model_id, static, "default", ms=1.5)  # newer, and faster
    assert _lookup(api_url, model_id).json()["key"] == fast_default

    other = "ce" * 32
    _model(store, other)
    default = _publish(store, tmp_path, other, static, "default", ms=1.5)
    tuned = _publish(store, tmp_path, other, static, "max-autotune", ms=0.9)  # the faster one, whichever is newer
    assert _lookup(api_url, other).json()["key"] == tuned
    assert _lookup(api_url, other, mode="default").json()["key"] == default


def test_a_self_contained_build_serves_only_where_no_as_specialised_weightless_one_fits(api_url, store, tmp_path):
    """A self-contained build (weights inside, for tools that cannot bind a blob) is newer than what it was built
    from and often as fast: it once won lookups by that, and tests/e2e/test_compile_path.py's lookup found it
    instead of the artifact it asked about whenever tests/e2e/test_self_contained.py had run first."""
    model_id = "e1" * 32
    _model(store, model_id)
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    weightless = _publish(store, tmp_path, model_id, static, "default", ms=1.0)
    _publish(store, tmp_path, model_id, static, "default", ms=0.8, embed=True)  # newer and faster
    assert _lookup(api_url, model_id).json()["key"] == weightless

    only = "e2" * 32
    _model(store, only)
    embedded = _publish(store, tmp_path, only, static, "default", embed=True)
    wide = _publish(store, tmp_path, only, [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}],
                    "default")
    assert _lookup(api_url, only).json()["key"] == embedded  # the more specialised, self-contained or not
    assert _lookup(api_url, only, shape="x=9x4").json()["key"] == wide


def test_times_from_different_devices_are_not_compared_the_newest_is_served(api_url, store, tmp_path):
    model_id = "ef" * 32
    _model(store, model_id)
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    _publish(store, tmp_path, model_id, static, "max-autotune", ms=0.5, device="NVIDIA H200")
    newest = _publish(store, tmp_path, model_id, static, "default", ms=1.0, device="NVIDIA H100 80GB HBM3")
    assert _lookup(api_url, model_id).json()["key"] == newest


def test_only_medians_taken_the_same_way_are_compared_and_old_records_still_rank(api_url, store, tmp_path):
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    model_id = "a1" * 32
    _model(store, model_id)
    fast = _publish(store, tmp_path, model_id, static, "default", ms=1.01, method="cuda-events-l2flush")
    _publish(store, tmp_path, model_id, static, "max-autotune", ms=1.04, method="cuda-events-l2flush")  # newer
    # The median decides: compiled_ms, rounded to 1.0 for both, could not tell them apart (the newest would win).
    assert _lookup(api_url, model_id).json()["key"] == fast

    other = "a2" * 32
    _model(store, other)
    _publish(store, tmp_path, other, static, "max-autotune", ms=0.5)  # an old record: no method, no spread
    newest = _publish(store, tmp_path, other, static, "default", ms=1.0, method="cuda-events-l2flush")
    assert _lookup(api_url, other).json()["key"] == newest  # timed two ways: not compared, the newest is served


def test_graphs_rank_by_the_graph_replay_where_every_candidate_has_one(api_url, store, tmp_path, client):
    """A launch-bound plain run is timed by the CPU; what a graph-replaying server gets is the replay's figure."""
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    m = "b1" * 32
    _model(store, m)
    plain_fast = _publish(store, tmp_path, m, static, "default", ms=1.0, method="cuda-events-l2flush",
                          device="NVIDIA H200", graph_ms=0.50)
    graph_fast = _publish(store, tmp_path, m, static, "max-autotune", ms=1.2, method="cuda-events-l2flush",
                          device="NVIDIA H200", graph_ms=0.40)
    assert _lookup(api_url, m).json()["key"] == plain_fast
    assert _lookup(api_url, m, graphs="true").json()["key"] == graph_fast
    assert client.lookup(m, {"x": [8, 4]}, graphs=True).key == graph_fast  # the SDK says so too
    assert client.lookup(m, {"x": [8, 4]}).key == plain_fast

    # A candidate without a replay that agreed with eager: graph figures are not compared, the plain ones are.
    other = "b2" * 32
    _model(store, other)
    plain_fast = _publish(store, tmp_path, other, static, "default", ms=1.0, method="cuda-events-l2flush",
                          device="NVIDIA H200", graph_ms=0.3, graph_ok=False)
    _publish(store, tmp_path, other, static, "max-autotune", ms=1.2, method="cuda-events-l2flush",
             device="NVIDIA H200", graph_ms=0.40)
    assert _lookup(api_url, other, graphs="true").json()["key"] == plain_fast


def test_an_artifact_slower_than_eager_says_so_and_never_outranks_one_that_is_not(api_url, store, tmp_path, client):
    m = "c1" * 32
    _model(store, m)
    dynamic = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}]
    static = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
    fast = _publish(store, tmp_path, m, dynamic, "default", ms=0.8, eager_ms=1.0)
    slow = _publish(store, tmp_path, m, static, "max-autotune", ms=1.5, eager_ms=1.0)  # static and newer, but slower
    answer = _lookup(api_url, m).json()
    assert answer["key"] == fast, "a static artifact slower than eager outranked a dynamic one that is not"
    assert answer["speed"] == {"vs_eager": 1.25, "slower_than_eager": False, "graphs": "not replayable"}
    meta = api.get(f"{api_url}/v1/artifacts/{slow}/meta").json()
    assert meta["speed"]["slower_than_eager"] is True and meta["speed"]["vs_eager"] == 0.667
    # Where it is the only one that fits, it is served, and the answer says what it is.
    answer = _lookup(api_url, m, mode="max-autotune").json()
    assert answer["key"] == slow and answer["speed"]["slower_than_eager"] is True
    assert client.lookup(m, {"x": [8, 4]}).meta["speed"]["slower_than_eager"] is False


def test_a_dynamic_artifacts_graph_figure_never_ranks(api_url, store, tmp_path):
    """A client runs a dynamic artifact plainly even with cuda_graphs=True: its graph figure promises nothing."""
    m = "c2" * 32
    _model(store, m)
    dynamic = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}]
    plain_fast = _publish(store, tmp_path, m, dynamic, "default", ms=1.0, method="cuda-events-l2flush",
                          device="NVIDIA H200", graph_ms=0.6)
    _publish(store, tmp_path, m, dynamic, "max-autotune", ms=1.2, method="cuda-events-l2flush",
             device="NVIDIA H200", graph_ms=0.3)  # newer, and the faster replay a client would never run
    answer = _lookup(api_url, m, graphs="true").json()
    assert answer["key"] == plain_fast
    assert answer["speed"]["graphs"] == "not replayable" and "graphs_vs_eager" not in answer["speed"]
