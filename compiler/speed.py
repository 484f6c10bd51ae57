"""What an artifact's check says about its speed, in the words every reader of the record uses: the lookup's answer
and its ranking (service/api/lookup.py), GET /v1/artifacts/{key}/meta, and `aotc report`.

- `slower_than_eager`: the check timed the package slower than the exported program run eagerly, at the spec's
  first point, the same way on the same device. Such an artifact is still published (it is correct, and a caller
  may want it for other reasons), but it says so, and lookup never ranks it above one that is not slower.
- A dynamic artifact (any input dim a range) is never replayed as a CUDA graph by the client (`cuda_graphs=True`
  runs it plainly: client/graphs.py), so a graph figure its check took would promise what no caller gets. The
  worker drops those figures from the record (`not_replayable`), keeps why, and lookup ranks it by its plain figure.

Torch-free: the API imports it.
"""

from __future__ import annotations

import copy
from typing import Any

UNTIMED = "untimed-one-call"  # compiler.check.METHOD_UNTIMED (that module imports torch)
NOT_REPLAYABLE = ("not replayable: a dynamic artifact runs plainly under cuda_graphs=True (client/graphs.py), so "
                  "its check's CUDA-graph figures are not recorded; compile buckets for the shapes you serve")


def is_dynamic(spec: list[dict[str, Any]]) -> bool:
    """Whether any input dim of an artifact's spec is a range."""
    return any(isinstance(d, dict) for inp in spec for d in inp.get("shape", []))


def _ms(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 else None


def verdict(check: dict[str, Any] | None, spec: list[dict[str, Any]]) -> dict[str, Any]:
    """The record's `speed`: `vs_eager` (eager's median over the package's, at the first point; None untimed),
    `slower_than_eager` (None when either figure is missing), `graphs_vs_eager` (the CUDA-graph replay's, where
    one was captured, agreed with eager, and can be replayed) and `graphs` ("replayable", "not replayable" or
    "none": no figure)."""
    check = check or {}
    eager, plain = _ms(check.get("eager_ms")), _ms(check.get("compiled_ms"))
    if ((check.get("latency") or {}).get("compiled") or {}).get("method") == UNTIMED:
        eager = plain = None  # one call of a check whose timing pass failed: no figure to judge by
    out: dict[str, Any] = {"vs_eager": round(eager / plain, 3) if eager and plain else None,
                           "slower_than_eager": (plain > eager) if eager and plain else None}
    graph = _ms(check.get("graph_ms")) if (check.get("graphs") or {}).get("ok") else None
    if is_dynamic(spec):
        out["graphs"] = "not replayable"
    elif graph and eager:
        out["graphs"] = "replayable"
        out["graphs_vs_eager"] = round(eager / graph, 3)
    else:
        out["graphs"] = "none"
    return out


def not_replayable(check: dict[str, Any]) -> dict[str, Any]:
    """A dynamic artifact's check without the CUDA-graph figures it took (a copy): `graphs` says why, and keeps
    whether the capture agreed with eager (a correctness finding, not a speed one)."""
    out = copy.deepcopy(check)
    took = out.get("graphs") or {}
    out.pop("graph_ms", None)
    (out.get("latency") or {}).pop("graph", None)
    for point in out.get("points") or []:
        for k in ("graph_ms", "graph_speedup"):
            point.pop(k, None)
        (point.get("latency") or {}).pop("graph", None)
        (point.get("graph") or {}).pop("pays", None)
    out["graphs"] = {"impl": took.get("impl"), "captured": took.get("captured", False), "ok": took.get("ok"),
                     "replayable": False, "pays": None, "reason": NOT_REPLAYABLE}
    return out


# The figures a timing pass replaces, at the top of a check and in each of its points.
_FIGURES = ("eager_ms", "compiled_ms", "speedup", "graph_ms", "graph_speedup")


def with_timing(check: dict[str, Any], timed: dict[str, Any] | None, conditions: dict[str, Any]) -> dict[str, Any]:
    """The check (a copy) with the timing pass's figures in place of its own, and `timing`: the conditions the
    figures were taken under (`conditions`: the device lock held or not, the wait, the load; `pass`). Without a
    timing pass (`timed` None: it failed or was not run), the check's own figures stay and `timing` says so."""
    out = copy.deepcopy(check)
    if timed is None:
        out["timing"] = {**conditions, "pass": conditions.get("pass", "check"),
                         "note": "figures from the check itself, taken beside other work on the device"}
        return out
    by_point = {p["point"]: p for p in timed.get("points") or []}
    for point in out.get("points") or []:
        t = by_point.get(point.get("point"))
        if t is None:
            continue
        for k in _FIGURES:
            point.pop(k, None)
        latency = point.setdefault("latency", {})
        for k in ("eager", "compiled", "graph"):
            latency.pop(k, None)
        point.update({k: t[k] for k in _FIGURES if t.get(k) is not None})
        latency.update(t.get("latency") or {})
        if (point.get("graph") or {}).get("ok"):  # no figure from the pass: it does not pay, as far as we know
            point["graph"]["pays"] = bool(t.get("graph_pays"))
    first = (out.get("points") or [{}])[0]
    for k in _FIGURES:
        out.pop(k, None)
        if first.get(k) is not None:
            out[k] = first[k]
    method = ((first.get("latency") or {}).get("compiled") or {}).get("method")
    out["latency"] = {"method": method, **{k: v for k, v in (first.get("latency") or {}).items()}}
    graphs = out.get("graphs")
    if isinstance(graphs, dict) and graphs.get("ok"):
        graphs["speedup"] = first.get("graph_speedup")
        graphs["pays"] = bool((first.get("graph") or {}).get("pays"))
        graphs["pays_at"] = [p["point"] for p in out.get("points") or [] if (p.get("graph") or {}).get("pays")]
    if timed.get("device_info"):
        out["device_info"] = timed["device_info"]
    out["timing"] = {**conditions, "pass": "separate"}
    return out
