"""The serving benchmark's table, targets and chart (bench/bench.py results of schema 2); bench/report.py calls it.

One row per model and batch: each peer's latency (median of do_bench, across rounds), the artifact's speedups,
time to first inference, memory, and the worker's check figure against do_bench. The summary holds the geomeans
per batch and the issue-13 targets, each met or missed with the gap.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

PEERS = ("eager", "tc_default", "tc_reduce_overhead", "tc_max_autotune", "aot", "aot_graphs")
LABEL = {"eager": "eager", "tc_default": "t.compile", "tc_reduce_overhead": "t.c. reduce-overhead",
         "tc_max_autotune": "t.c. max-autotune", "aot": "aotc", "aot_graphs": "aotc + graphs"}
TTFI_TARGET_S = 1.5  # time to first inference after import torch: pull, load, first call
AGREE = 0.10  # the worker's check and do_bench agree within this


def _geomean(xs: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def _first(peer: dict[str, Any], key: str) -> Any:
    """A figure of the peer's first round (TTFI is a cold-process figure: the first round's)."""
    for r in peer.get("rounds", []):
        if key in r:
            return r[key]
    return None


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, m in result["models"].items():
        for batch, b in sorted(m.get("batches", {}).items(), key=lambda kv: int(kv[0])):
            art = b.get("artifact") or {}
            peers = b.get("peers", {})
            ms = {p: peers[p].get("latency_ms") for p in PEERS if p in peers}
            row: dict[str, Any] = {"model": name, "family": m.get("family"), "batch": int(batch),
                                   "compiled": bool(art.get("ok")), "ms": ms}
            if not art.get("ok"):
                row.update(stage=art.get("stage"), error=str(art.get("error"))[:300])
            e, a, g, ro = ms.get("eager"), ms.get("aot"), ms.get("aot_graphs"), ms.get("tc_reduce_overhead")
            row["aot_x_eager"] = e / a if e and a else None
            row["graphs_x_eager"] = e / g if e and g else None
            row["graphs_x_aot"] = a / g if a and g else None
            row["graphs_x_reduce_overhead"] = ro / g if ro and g else None
            row["ttfi_after_import_s"] = {p: _first(peers[p], "ttfi_after_import_s") for p in peers}
            row["first_batch_of_process"] = row["ttfi_after_import_s"].get("aot") is not None
            row["aot_ttfi_parts_s"] = {k: _first(peers.get("aot", {}), k) for k in ("pull_s", "load_s",
                                                                                    "first_call_s")}
            row["tc_compile_s"] = {p: _first(peers[p], "compile_s") for p in peers if p.startswith("tc_")}
            row["aotc_compile_s"] = art.get("compile_s")
            row["device_mem_mb"] = {p: (_first(peers[p], "device_mem_bytes") or 0) / 2**20 for p in peers}
            check = art.get("check") or {}
            row["check_ms"] = check.get("compiled_ms")
            row["check_graph_ms"] = check.get("graph_ms")
            row["check_graphs_pay"] = (check.get("graphs") or {}).get("pays")
            row["check_vs_do_bench"] = check["compiled_ms"] / a if check.get("compiled_ms") and a else None
            row["check_graph_vs_do_bench"] = check["graph_ms"] / g if check.get("graph_ms") and g else None
            meas = _first(peers.get("aot", {}), "measure") or {}
            row["measure_vs_do_bench"] = meas["median_ms"] / a if meas.get("median_ms") and a else None
            graph_stats = (_first(peers.get("aot_graphs", {}), "graphs") or {}).get("stats") or []
            row["graph_mem_mb"] = sum((s.get("memory") or {}).get("total_bytes", 0) for s in graph_stats) / 2**20
            row["graph_used"] = (_first(peers.get("aot_graphs", {}), "graphs") or {}).get("last") == "graph"
            out.append(row)
    return out


def _agreeing(rs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Models whose `key` ratio is within AGREE at every batch it was measured at."""
    by_model: dict[str, list[float]] = {}
    for r in rs:
        if r.get(key):
            by_model.setdefault(r["model"], []).append(r[key])
    ok = sorted(m for m, xs in by_model.items() if all(abs(x - 1) <= AGREE for x in xs))
    return {"models": ok, "count": len(ok), "of": len(by_model)}


def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    batches: dict[str, list[dict[str, Any]]] = {"1": [r for r in rs if r["batch"] == 1],
                                                "serving": [r for r in rs if r["batch"] != 1]}
    measured = [r for r in rs if r["ms"]]
    compile_s = sorted(r["aotc_compile_s"] for r in rs if r["compiled"] and r.get("aotc_compile_s"))
    s: dict[str, Any] = {"models": len({r["model"] for r in rs}), "rows": len(rs),
                         "compiled": sum(r["compiled"] for r in rs),
                         "models_compiled": len({r["model"] for r in rs if r["compiled"]}),
                         "models_measured": len({r["model"] for r in measured}),
                         "not_measured": sorted({r["model"] for r in rs if r["compiled"] and not r["ms"]}),
                         "refused_or_failed": sorted({f"{r['model']}: {r.get('error', '')[:160]}" for r in rs
                                                      if not r["compiled"]}),
                         "aotc_compile_s": {"median": statistics.median(compile_s) if compile_s else None,
                                            "min": compile_s[0] if compile_s else None,
                                            "max": compile_s[-1] if compile_s else None}}
    for label, group in batches.items():
        group = [r for r in group if r["ms"]]
        g: dict[str, Any] = {"rows": len(group)}
        for k in ("aot_x_eager", "graphs_x_eager", "graphs_x_aot", "graphs_x_reduce_overhead"):
            g[f"geomean_{k}"] = _geomean([r[k] for r in group if r.get(k)])
        for p in ("tc_default", "tc_reduce_overhead", "tc_max_autotune"):
            g[f"geomean_{p}_x_eager"] = _geomean([r["ms"]["eager"] / r["ms"][p] for r in group
                                                   if r["ms"].get("eager") and r["ms"].get(p)])
        s[f"batch_{label}"] = g
    b1, serving = batches["1"], batches["serving"]
    ttfi = [(r["model"], r["ttfi_after_import_s"].get("aot")) for r in rs if r["ttfi_after_import_s"].get("aot")]
    agree = [r["check_vs_do_bench"] for r in rs if r.get("check_vs_do_bench")]
    agree_graph = [r["check_graph_vs_do_bench"] for r in rs if r.get("check_graph_vs_do_bench")]
    ttfi_graphs = [(r["model"], r["ttfi_after_import_s"].get("aot_graphs")) for r in rs
                   if r["ttfi_after_import_s"].get("aot_graphs")]
    s["targets"] = {
        "graphs_at_least_reduce_overhead_at_batch_1": {
            "met": sum(1 for r in b1 if (r.get("graphs_x_reduce_overhead") or 0) >= 1.0),
            "of": sum(1 for r in b1 if r.get("graphs_x_reduce_overhead")),
            "misses": [f"{r['model']}: {r['ms']['aot_graphs']:.3f} ms against {r['ms']['tc_reduce_overhead']:.3f} ms"
                       for r in b1 if r.get("graphs_x_reduce_overhead") and r["graphs_x_reduce_overhead"] < 1.0]},
        "geomean_graphs_over_plain_at_batch_1_ge_1.3": s["batch_1"]["geomean_graphs_x_aot"],
        "geomean_over_eager_at_serving_batch_ge_2.5": {
            "aot": s["batch_serving"]["geomean_aot_x_eager"],
            "best_of_aot_and_graphs": _geomean([max(r.get("aot_x_eager") or 0, r.get("graphs_x_eager") or 0)
                                                for r in serving if r.get("aot_x_eager")])},
        "ttfi_after_import_le_1.5_s": {"max": max((t for _, t in ttfi), default=None),
                                      "misses": [f"{m}: {t:.2f} s" for m, t in ttfi if t > TTFI_TARGET_S]},
        "ttfi_after_import_le_1.5_s_with_graphs": {
            "max": max((t for _, t in ttfi_graphs), default=None),
            "misses": [f"{m}: {t:.2f} s" for m, t in ttfi_graphs if t > TTFI_TARGET_S]},
        "worker_check_vs_do_bench_within_10_percent": {
            "within": sum(1 for x in agree if abs(x - 1) <= AGREE), "of": len(agree),
            "ratios": [round(x, 3) for x in agree]},
        "worker_check_graph_vs_do_bench_within_10_percent": {
            "within": sum(1 for x in agree_graph if abs(x - 1) <= AGREE), "of": len(agree_graph),
            "ratios": [round(x, 3) for x in agree_graph]},
        "models_whose_every_row_agrees": {k: _agreeing(rs, k) for k in ("check_vs_do_bench",
                                                                       "check_graph_vs_do_bench",
                                                                       "measure_vs_do_bench")},
    }
    return s


def table(rs: list[dict[str, Any]]) -> str:
    head = ["model", "b", *[LABEL[p] for p in PEERS], "x eager", "graphs x aotc", "graphs x r-o", "TTFI aotc s",
            "check/do_bench", "graph MiB"]
    lines = [head]
    failed: list[str] = []
    for r in rs:
        if r["compiled"] and not r["ms"]:
            continue  # compiled, not measured: summary()["not_measured"]
        if not r["compiled"] and not r["ms"]:
            failed.append(f"{r['model']} b={r['batch']}: failed at {r.get('stage')}: {r.get('error', '')[:150]}")
            continue

        def f(x: Any, d: int = 3) -> str:
            return "-" if x is None else f"{x:.{d}f}"

        lines.append([r["model"], str(r["batch"]), *[f(r["ms"].get(p)) for p in PEERS],
                      f(r.get("graphs_x_eager") or r.get("aot_x_eager"), 2), f(r.get("graphs_x_aot"), 2),
                      f(r.get("graphs_x_reduce_overhead"), 2), f(r["ttfi_after_import_s"].get("aot"), 2),
                      f(r.get("check_vs_do_bench"), 2), f(r.get("graph_mem_mb"), 0)])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join(["  ".join(str(v).rjust(w) if i > 1 else str(v).ljust(w)
                                for i, (v, w) in enumerate(zip(line, widths))).rstrip() for line in lines]
                     + failed)


def svg(rs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Speedup over eager of each peer, per model and batch, as horizontal bars (a plain SVG: no dependency)."""
    peers = [p for p in PEERS[1:] if any(r["ms"].get(p) for r in rs)]
    colors = {"tc_default": "#9ecae1", "tc_reduce_overhead": "#4292c6", "tc_max_autotune": "#084594",
              "aot": "#fdae6b", "aot_graphs": "#e6550d"}
    ok = [r for r in rs if r["ms"].get("eager")]
    bar, gap, left, width = 7, 6, 230, 520
    top = 50
    height = top + len(ok) * (len(peers) * bar + gap) + 40
    vmax = max([r["ms"]["eager"] / r["ms"][p] for r in ok for p in peers if r["ms"].get(p)] + [1.0])
    scale = width / (math.ceil(vmax * 2) / 2)
    v = meta.get("versions", {})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 160}" height="{height}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="10" y="16" font-size="12">Speedup over eager (bf16), {meta.get("device")}, torch '
           f'{v.get("torch")}, {meta.get("date")}: batch 1 and the serving batch</text>']
    y = top
    for r in ok:
        out.append(f'<text x="{left - 6}" y="{y + len(peers) * bar / 2 + 3}" text-anchor="end">'
                   f'{r["model"]} b={r["batch"]}</text>')
        for p in peers:
            if r["ms"].get(p):
                x = r["ms"]["eager"] / r["ms"][p]
                out.append(f'<rect x="{left}" y="{y}" width="{x * scale:.1f}" height="{bar - 1}" '
                           f'fill="{colors[p]}"><title>{LABEL[p]}: {x:.2f}x</title></rect>')
            y += bar
        y += gap
    one = left + scale
    out.append(f'<line x1="{one:.1f}" y1="{top - 4}" x2="{one:.1f}" y2="{y}" stroke="#555" stroke-dasharray="3,3"/>')
    out.append(f'<text x="{one:.1f}" y="{top - 8}" text-anchor="middle">1x</text>')
    for i, p in enumerate(peers):
        out.append(f'<rect x="{left + width + 20}" y="{top + i * 16}" width="10" height="10" fill="{colors[p]}"/>'
                   f'<text x="{left + width + 36}" y="{top + i * 16 + 9}">{LABEL[p]}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(result: dict[str, Any], path: Path, svg_path: Path | None) -> None:
    rs = rows(result)
    print(f"{result.get('device')}  {result.get('date')}  {result.get('versions')}")
    print(table(rs))
    s = summary(rs)
    print(json.dumps(s, indent=1))
    path.with_suffix(".summary.json").write_text(json.dumps({"summary": s, "rows": rs}, indent=1))
    if svg_path is not None:
        svg_path.write_text(svg(rs, result))
