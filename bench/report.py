"""Table, summary and chart for a bench/bench.py result file.

    python bench/report.py bench/results/h100-2026-11-22.json --svg bench/results/h100-2026-11-22.svg
    python bench/report.py bench/results/h200-2026-11-22.json --png bench/results/h200-2026-11-22.png

Prints one row per model (per model and batch for schema 2: batch 1 and the serving batch, six peers) and the
targets' summary, writes the summary as JSON beside the input (<name>.summary.json), and draws a chart: an SVG
(no dependency) or a PNG (needs matplotlib; schema 1 only).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, r in result["models"].items():
        row: dict[str, Any] = {"model": name, "ok": bool(r.get("ok"))}
        if r.get("ok"):
            a, t = r["artifact_fresh"], r.get("torch_compile", {})
            row.update(
                eager_ms=r["eager_ms"], torch_compile_ms=r.get("torch_compile_ms"), aoti_ms=r["aoti_ms"],
                speedup=r["eager_ms"] / r["aoti_ms"],
                vs_torch_compile=(r["torch_compile_ms"] / r["aoti_ms"]) if r.get("torch_compile_ms") else None,
                compile_s=r["compile_s"], artifact_mb=r["artifact_bytes"] / 2**20,
                torch_compile_cold_s=r.get("torch_compile_cold_s"), ttfi_torch_compile_s=t.get("ttfi_s"),
                ttfi_artifact_s=a.get("ttfi_s"), ttfi_artifact_after_import_s=a.get("ttfi_after_import_s"),
                pull_s=a.get("pull_s"), load_s=a.get("load_s"), first_call_s=a.get("first_call_s"),
                max_rel_err=r.get("max_rel_err"), parallel_compiles=r.get("parallel_compiles") or 1,
            )
        else:
            row.update(stage=r.get("stage"), error=r.get("error"))
        out.append(row)
    return out


def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rs if r["ok"]]
    return {
        "models": len(rs),
        "compiled": len(ok),
        "geomean_speedup_over_eager": math.exp(statistics.fmean(math.log(r["speedup"]) for r in ok)) if ok else None,
        "artifact_at_least_as_fast_as_torch_compile": sum(
            1 for r in ok if r["vs_torch_compile"] and r["vs_torch_compile"] >= 1.0),
        "median_ttfi_torch_compile_s": statistics.median(r["ttfi_torch_compile_s"] for r in ok) if ok else None,
        "median_ttfi_artifact_s": statistics.median(r["ttfi_artifact_s"] for r in ok) if ok else None,
        "median_ttfi_artifact_after_import_s": (
            statistics.median(r["ttfi_artifact_after_import_s"] for r in ok) if ok else None),
        "max_ttfi_artifact_after_import_s": max(r["ttfi_artifact_after_import_s"] for r in ok) if ok else None,
    }


def table(rs: list[dict[str, Any]]) -> str:
    head = ["model", "eager ms", "t.compile ms", "aotc ms", "x eager", "x t.compile", "aotc compile s",
            "t.compile cold s", "TTFI t.compile s", "TTFI aotc s", "(after import)"]
    lines = [head]
    for r in rs:
        if not r["ok"]:
            lines.append([r["model"], f"FAILED at {r.get('stage')}: {str(r.get('error'))[:60]}"] + [""] * 9)
            continue
        lines.append([r["model"], f"{r['eager_ms']:.2f}", f"{r['torch_compile_ms']:.2f}", f"{r['aoti_ms']:.2f}",
                      f"{r['speedup']:.2f}", f"{r['vs_torch_compile']:.2f}", f"{r['compile_s']:.0f}",
                      f"{r['torch_compile_cold_s']:.1f}", f"{r['ttfi_torch_compile_s']:.1f}",
                      f"{r['ttfi_artifact_s']:.2f}", f"{r['ttfi_artifact_after_import_s']:.2f}"])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(v).rjust(w) if i else str(v).ljust(w)
                               for i, (v, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)


TTFI_TARGET_S = 2.0  # a pulled artifact's time to first inference, after import torch


def misses(rs: list[dict[str, Any]]) -> list[str]:
    """Each model that misses a target, and what the measurement says about why."""
    out = []
    for r in rs:
        if not r["ok"]:
            out.append(f"{r['model']}: did not compile (stage {r.get('stage')}): {str(r.get('error'))[:200]}")
            continue
        if r["vs_torch_compile"] is not None and r["vs_torch_compile"] < 1.0:
            gap_us = (r["aoti_ms"] - r["torch_compile_ms"]) * 1e3
            out.append(f"{r['model']}: {r['aoti_ms']:.3f} ms against torch.compile's {r['torch_compile_ms']:.3f} ms, "
                       f"{gap_us:.0f} us ({100 * (1 - r['vs_torch_compile']):.1f} %) slower")
        if r["ttfi_artifact_after_import_s"] > TTFI_TARGET_S:
            out.append(f"{r['model']}: time to first inference {r['ttfi_artifact_after_import_s']:.2f} s after import "
                       f"= pull {r['pull_s']:.2f} s + load {r['load_s']:.2f} s + first call {r['first_call_s']:.2f} s")
    return out


def chart(rs: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rs if r["ok"]]
    names = [r["model"].replace("timm_", "").replace("hf_", "") for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    y = range(len(ok))
    ax1.barh([i + 0.2 for i in y], [r["speedup"] for r in ok], height=0.4, label="aotc artifact")
    ax1.barh([i - 0.2 for i in y], [r["eager_ms"] / r["torch_compile_ms"] for r in ok], height=0.4,
             label="torch.compile (default)")
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.set_yticks(list(y), names)
    ax1.set_xlabel("speedup over eager (bf16)")
    ax1.legend(loc="lower right")
    ax2.barh([i + 0.2 for i in y], [r["ttfi_artifact_s"] for r in ok], height=0.4, label="pull + load + call (aotc)")
    ax2.barh([i - 0.2 for i in y], [r["ttfi_torch_compile_s"] for r in ok], height=0.4,
             label="torch.compile from cold")
    ax2.set_yticks(list(y), [""] * len(ok))
    ax2.set_xlabel("time to first inference in a fresh process, s (includes import torch)")
    ax2.legend(loc="lower right")
    v = meta.get("versions", {})
    fig.suptitle(f"{meta.get('device')} · torch {v.get('torch')} · triton {v.get('triton')} · {meta.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("result")
    ap.add_argument("--png", default=None)
    ap.add_argument("--svg", default=None)
    a = ap.parse_args()
    result = json.loads(Path(a.result).read_text())
    if result.get("schema") == 2:
        from bench.report_serving import main as serving

        serving(result, Path(a.result), Path(a.svg) if a.svg else None)
        return
    rs = rows(result)
    print(f"{result.get('device')}  {result.get('date')}  {result.get('versions')}")
    print(table(rs))
    s = summary(rs)
    s["misses"] = misses(rs)
    print("misses:" if s["misses"] else "misses: none")
    for m in s["misses"]:
        print(f"  {m}")
    print(json.dumps(s, indent=1))
    Path(a.result).with_suffix(".summary.json").write_text(json.dumps({"summary": s, "rows": rs}, indent=1))
    if a.png:
        chart(rs, result, Path(a.png))


if __name__ == "__main__":
    main()
