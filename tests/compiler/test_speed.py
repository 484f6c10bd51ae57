"""compiler.speed: the record's speed verdict, and a dynamic artifact's check without the graph figures no client
can reproduce."""

from __future__ import annotations

from compiler import speed

STATIC = [{"name": "x", "dtype": "float32", "shape": [8, 4]}]
DYNAMIC = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, 4]}]


def _check() -> dict:
    graph = {"median_ms": 0.4, "method": "cuda-events-l2flush"}
    return {"passed": True, "eager_ms": 2.0, "compiled_ms": 1.0, "graph_ms": 0.4,
            "graphs": {"impl": "aotc", "captured": True, "ok": True, "pays": True, "speedup": 2.5},
            "latency": {"compiled": {"median_ms": 1.0}, "graph": graph},
            "points": [{"point": "min", "graph_ms": 0.4, "graph_speedup": 2.5,
                        "graph": {"captured": True, "ok": True, "pays": True},
                        "latency": {"compiled": {"median_ms": 1.0}, "graph": graph}}]}


def test_verdicts():
    assert speed.verdict(_check(), STATIC) == {"vs_eager": 2.0, "slower_than_eager": False, "graphs": "replayable",
                                               "graphs_vs_eager": 5.0}
    assert speed.verdict(_check(), DYNAMIC)["graphs"] == "not replayable"
    slow = {**_check(), "compiled_ms": 2.5}
    assert speed.verdict(slow, STATIC)["slower_than_eager"] is True
    assert speed.verdict(None, STATIC) == {"vs_eager": None, "slower_than_eager": None, "graphs": "none"}
    assert speed.verdict({"eager_ms": 1.0, "compiled_ms": True}, STATIC)["slower_than_eager"] is None


def test_a_dynamic_artifacts_check_keeps_no_graph_figure():
    check = _check()
    out = speed.not_replayable(check)
    assert "graph_ms" not in out and "graph" not in out["latency"]
    point = out["points"][0]
    assert "graph_ms" not in point and "graph_speedup" not in point and "graph" not in point["latency"]
    assert point["graph"] == {"captured": True, "ok": True}  # the capture agreed with eager: a correctness finding
    assert out["graphs"]["replayable"] is False and out["graphs"]["pays"] is None
    assert out["graphs"]["reason"].startswith("not replayable")
    assert check["graph_ms"] == 0.4  # the worker's copy is untouched
    assert speed.verdict(out, DYNAMIC)["graphs"] == "not replayable"


def test_the_timing_pass_replaces_every_figure_the_check_took_and_says_how_it_was_taken():
    check = {**_check(), "speedup": 2.0, "host": {"exclusive": False}}
    timed_graph = {"median_ms": 0.9, "method": "cuda-events-l2flush"}
    timed = {"device_info": {"name": "NVIDIA H100"},
             "points": [{"point": "min", "eager_ms": 1.2, "compiled_ms": 1.5, "speedup": 0.8, "graph_ms": 0.9,
                         "graph_speedup": 1.667, "graph_pays": True,
                         "latency": {"eager": {"median_ms": 1.2}, "compiled": {"median_ms": 1.5, "method": "m"},
                                     "graph": timed_graph}}]}
    held = {"exclusive": True, "waited_s": 3.2, "load_avg_1m": 1.0, "cpus": 16, "seconds": 4.0}
    out = speed.with_timing(check, timed, held)
    assert (out["eager_ms"], out["compiled_ms"], out["speedup"], out["graph_ms"]) == (1.2, 1.5, 0.8, 0.9)
    assert out["latency"] == {"method": "m", "eager": {"median_ms": 1.2}, "compiled": {"median_ms": 1.5, "method": "m"},
                              "graph": timed_graph}
    assert out["points"][0]["graph_speedup"] == 1.667 and out["points"][0]["graph"]["pays"] is True
    assert out["graphs"]["speedup"] == 1.667 and out["graphs"]["pays"] is True
    assert out["timing"] == {**held, "pass": "separate"} and out["device_info"] == {"name": "NVIDIA H100"}
    assert speed.verdict(out, STATIC)["slower_than_eager"] is True  # the quiet figure decides, not the busy one
    assert check["compiled_ms"] == 1.0  # the check is not changed in place

    # No graph figure from the pass: none in the record either, whatever the check took beside other work.
    bare = {"points": [{**timed["points"][0], "latency": {"eager": {}, "compiled": {}}}]}
    for k in ("graph_ms", "graph_speedup", "graph_pays"):
        bare["points"][0].pop(k)
    out = speed.with_timing(check, bare, held)
    assert "graph_ms" not in out and "graph" not in out["latency"] and "graph_ms" not in out["points"][0]
    assert out["graphs"]["pays"] is False and speed.verdict(out, STATIC)["graphs"] == "none"

    untimed = {**check, "latency": {"compiled": {"median_ms": 1.0, "method": speed.UNTIMED}}}
    assert speed.verdict(speed.with_timing(untimed, None, {"pass": "failed"}), STATIC)["slower_than_eager"] is None
    kept = speed.with_timing(check, None, {"exclusive": True, "waited_s": 0.0, "pass": "failed"})
    assert kept["compiled_ms"] == 1.0 and kept["timing"]["pass"] == "failed" and "beside other work" in \
        kept["timing"]["note"]
