"""The stage report: a versioned JSON document, one per compile, stored beside the artifact.

Torch-free, so the worker can finish a report (adding the artifact check) and the CLI can summarise one without
importing torch. The shape, schema 1:

    {"schema": 1, "key": ..., "torch": "2.13.0+cpu", "device": "cpu", "mode": "default", "options": {...},
     "spec": [...], "hooks": {hook: "used" | why not}, "notes": [...],
     "stages": {"capture": STAGE, "autograd": STAGE, "lowering": STAGE, "fusion": STAGE, "codegen": STAGE,
                "package": STAGE}}
    STAGE = {"status": "ok" | "unavailable" | "skipped", "seconds": float | null,
             "observed_by": how the facts were obtained, "note": why a stage shows less (or ""), ...facts}

Graph facts are {"nodes": calls in the graph, "histogram": {op: count}, "code": FX code, "file": path in the
sources archive}. Stage-specific facts are documented where they are made, in compiler/stages.py.
"""

from __future__ import annotations

from typing import Any

SCHEMA = 1
STAGES = ("capture", "autograd", "lowering", "fusion", "codegen", "package")
# What a job goes through, in order: the worker's steps around the compiler's stages (progress bars walk this).
JOB_STAGES = ("queued", "fetch", "load", *STAGES, "check", "timing", "publish")
MAX_INLINE_CODE = 200_000  # characters of FX code kept inline; the whole graph is in the sources archive


def stage(status: str = "ok", seconds: float | None = None, observed_by: str = "", note: str = "",
          **facts: Any) -> dict[str, Any]:
    return {"status": status, "seconds": None if seconds is None else round(seconds, 3), "observed_by": observed_by,
            "note": note, **facts}


def unavailable(why: str, seconds: float | None = None, observed_by: str = "") -> dict[str, Any]:
    return stage("unavailable", seconds, observed_by, why)


def skipped(why: str) -> dict[str, Any]:
    return stage("skipped", None, "", why)


def attach_check(report: dict[str, Any], check: dict[str, Any] | None) -> dict[str, Any]:
    """Put the artifact check's result (a separate child process, after the compile) into the package stage."""
    pkg = report.setdefault("stages", {}).setdefault("package", stage())
    if check:
        pkg["check"] = {k: check.get(k) for k in ("passed", "max_abs_err", "max_rel_err", "eager_ms", "compiled_ms",
                                                  "speedup", "device")}
        if check.get("nonfinite"):  # outputs holding NaN or inf, accepted because the request set allow_nonfinite
            pkg["check"]["nonfinite"] = check["nonfinite"]
        pkg["check"]["points"] = [{k: p.get(k) for k in ("point", "shapes", "max_rel_err", "eager_ms", "compiled_ms",
                                                         "speedup")} for p in check.get("points", [])]
        # Timings with their spread and the device they were taken on; the CUDA-graph run where one was captured;
        # the adversarial integer inputs tried, and how each ended.
        for k in ("latency", "device_info", "graph_ms", "graphs", "adversarial"):
            if check.get(k) is not None:
                pkg["check"][k] = check[k]
        for mine, theirs in zip(pkg["check"]["points"], check.get("points", []), strict=False):
            for k in ("graph_ms", "graph_speedup"):
                if theirs.get(k) is not None:
                    mine[k] = theirs[k]
    return report


def _nodes(stage_facts: dict[str, Any], key: str) -> int | None:
    g = stage_facts.get(key)
    return g.get("nodes") if isinstance(g, dict) else None


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per stage for a table: seconds, the node count going in and coming out, and a short detail."""
    st = report.get("stages", {})
    rows = []
    for name in STAGES:
        s = st.get(name)
        if s is None:
            continue
        before = after = None
        detail = s.get("note", "") if s.get("status") != "ok" else ""
        if s.get("status") == "ok":
            if name == "capture":
                after = _nodes(s, "graph")
                dyn = s.get("dynamic_dims") or []
                detail = f"{len(dyn)} dynamic dim(s)" if dyn else "static shapes"
                rewritten = (s.get("bounds") or {}).get("rewritten")
                if rewritten:
                    detail += f"; {rewritten} unchecked op(s) rewritten to checked forms"
            elif name == "autograd":
                before, after = _nodes(st.get("capture", {}), "graph"), _nodes(s, "graph")
                detail = f"{s.get('inplace_removed', 0)} in-place op(s) functionalised"
                tr = s.get("training")
                if tr and tr.get("unavailable"):
                    detail += "; the joint graph's trace failed (its facts say why)"
                elif tr:
                    detail += (f"; joint {tr['joint']['nodes']} -> fw {tr['forward']['nodes']} + bw "
                               f"{tr['backward']['nodes']}, {tr['saved_activations']} saved")
            elif name == "lowering":
                before, after = _nodes(s, "before"), _nodes(s, "graph")
                dec = s.get("decomposed") or []
                detail = f"{len(dec)} op kind(s) decomposed to core ATen"
            elif name == "fusion":
                before, after = s.get("nodes_before"), s.get("nodes_after")
                fx = (s.get("inductor_graph") or {}).get("nodes")
                detail = (f"{s.get('kernels')} kernel(s)" + (f" from {fx} FX nodes" if fx is not None else "")
                          + f", {s.get('extern_calls')} extern call(s)")
            elif name == "codegen":
                after = s.get("kernel_count")
                detail = f"{s.get('language')}: " + ", ".join(f"{f['path']} {f['bytes']} B" for f in s.get("files", [])
                                                              if f.get("kind") in ("wrapper", "kernels"))
            elif name == "package":
                check = s.get("check") or {}
                detail = f"{s.get('bytes')} bytes"
                if check:
                    detail += (f"; check {'passed' if check.get('passed') else 'FAILED'}, max rel err "
                               f"{check.get('max_rel_err', 0):.2g}")
                    if check.get("nonfinite"):
                        detail += f", non-finite outputs allowed ({len(check['nonfinite'])})"
                scan = s.get("scan") or {}
                if scan:
                    detail += f"; {scan.get('files')} source(s) scanned, {len(scan.get('findings') or [])} finding(s)"
                isa = s.get("isa") or {}
                if isa:  # compiler.isa's evidence: a package that failed it was never published
                    read = sum(int(c.get("instructions") or 0) for c in isa.get("code") or [])
                    detail += (f"; kept to x86-64 {isa.get('level')} ({isa.get('compile_lines')} g++ line(s)"
                               + (f", {read} instruction(s) read" if read else ", code not read") + ")")
        rows.append({"stage": name, "status": s.get("status"), "seconds": s.get("seconds"), "nodes_before": before,
                     "nodes_after": after, "detail": detail})
    return rows
