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
