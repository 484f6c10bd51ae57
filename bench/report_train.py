"""The training benchmark's results (bench/train.py JSON, one or more runs): the table, the goals, and a plot.

    python3 bench/report_train.py bench/results/train-h200x2-2026-11-28.json \
        bench/results/train-h200x2-2026-11-28-rerun.json --svg bench/results/train-h200x2-2026-11-28.svg

Rows of later files replace rows of the same model in earlier ones only where the earlier row made no package (a
rerun of refused models). The SVG has two panels: the step's speed-up over eager (aotc's package and
torch.compile's default mode, both against eager in the same process), and the time to first step in a fresh
process (aotc: import, pull, load, bind, first step; torch.compile: import, build, compile, first step). No
dependency: plain SVG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.train import table  # noqa: E402


def merged(paths: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        meta = meta or {k: d.get(k) for k in ("device", "amp", "torch", "gpu", "host")}
        for r in d.get("rows", []):
            if r["model"] not in rows or not rows[r["model"]].get("package"):
                rows[r["model"]] = r
    return list(rows.values()), meta


def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in rows if "speedup_vs_eager" in r]
    out: dict[str, Any] = {"models": len(rows), "packaged": sum(1 for r in rows if r.get("package")),
                           "timed": len(timed)}
    if timed:
        out["step_geomean_vs_eager"] = round(statistics.geometric_mean([r["speedup_vs_eager"] for r in timed]), 3)
        vs = [r["speedup_vs_compile"] for r in timed if r.get("speedup_vs_compile")]
        out["step_geomean_vs_compile"] = round(statistics.geometric_mean(vs), 3) if vs else None
        out["slower_than_compile"] = [r["model"] for r in timed if (r.get("speedup_vs_compile") or 0) < 1.0]
        ttfs = {r["model"]: (r.get("ttfs_aotc") or {}).get("ttfs_s") for r in timed}
        out["ttfs_aotc_s"] = {k: round(v, 2) for k, v in ttfs.items() if v is not None}
        out["ttfs_over_3s"] = sorted(k for k, v in ttfs.items() if v is not None and v > 3.0)
        # From C++ (examples/cpp's aotc_run: no Python import), the pull included.
        cpp = {r["model"]: (r.get("ttfs_cpp") or {}).get("with_pull_s") for r in timed}
        out["ttfs_cpp_s"] = {k: round(v, 2) for k, v in cpp.items() if v is not None}
        out["ttfs_cpp_over_3s"] = sorted(k for k, v in cpp.items() if v is not None and v > 3.0)
        imports = [(r.get("ttfs_aotc") or {}).get("import_s") for r in timed]
        out["ttfs_aotc_import_s"] = [round(min(i for i in imports if i), 2), round(max(i for i in imports if i), 2)] \
            if any(imports) else None
        comp = [(r.get("ttfs_compile") or {}).get("ttfs_s") for r in timed]
        out["ttfs_compile_median_s"] = round(statistics.median([c for c in comp if c]), 2) if any(comp) else None
    out["refused"] = {r["model"]: r.get("reason") for r in rows if not r.get("package")}
    return out


def svg(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    timed = [r for r in rows if "speedup_vs_eager" in r]
    bar, gap, left, width, top = 8, 8, 190, 300, 56
    height = top + len(timed) * (2 * bar + gap) + 40
    sx = width / max([r["speedup_vs_eager"] for r in timed] + [r["step_ms"]["eager"] / r["step_ms"]["compile_default"]
                                                                for r in timed if r["step_ms"].get("compile_default")]
                     + [1.0])
    tmax = max([(r.get("ttfs_compile") or {}).get("ttfs_s") or 0 for r in timed] + [1.0])
    st = width / tmax
    x2 = left + width + 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{x2 + width + 30}" height="{height}" '
           'font-family="sans-serif" font-size="10">',
           f'<text x="10" y="16" font-size="12">Train steps, {meta.get("gpu") or meta.get("device")}, torch '
           f'{meta.get("torch")}, {meta.get("amp")} autocast: speed-up over eager (left), time to first step in a '
           'fresh process (right)</text>',
           f'<text x="{left}" y="{top - 12}">step: eager ms / ms</text>',
           f'<text x="{x2}" y="{top - 12}">time to first step, s (import torch included)</text>']
    y = top
    for r in timed:
        out.append(f'<text x="{left - 6}" y="{y + bar + 3}" text-anchor="end">{r["model"]}</text>')
        comp = r["step_ms"].get("compile_default")
        pairs = [("#e6550d", r["speedup_vs_eager"], "aotc"),
                 ("#4292c6", r["step_ms"]["eager"] / comp if comp else 0.0, "torch.compile")]
        for i, (color, v, label) in enumerate(pairs):
            out.append(f'<rect x="{left}" y="{y + i * bar}" width="{v * sx:.1f}" height="{bar - 1}" fill="{color}">'
                       f'<title>{label}: {v:.2f}x</title></rect>'
                       f'<text x="{left + v * sx + 3:.1f}" y="{y + i * bar + bar - 1}" font-size="8">{v:.2f}</text>')
        times = [("#e6550d", (r.get("ttfs_aotc") or {}).get("ttfs_s"), "aotc"),
                 ("#4292c6", (r.get("ttfs_compile") or {}).get("ttfs_s"), "cold torch.compile")]
        for i, (color, v, label) in enumerate(times):
            if v is None:
                continue
            out.append(f'<rect x="{x2}" y="{y + i * bar}" width="{v * st:.1f}" height="{bar - 1}" fill="{color}">'
                       f'<title>{label}: {v:.2f} s</title></rect>'
                       f'<text x="{x2 + v * st + 3:.1f}" y="{y + i * bar + bar - 1}" font-size="8">{v:.1f}</text>')
        y += 2 * bar + gap
    one = left + sx
    out.append(f'<line x1="{one:.1f}" y1="{top - 4}" x2="{one:.1f}" y2="{y}" stroke="#555" stroke-dasharray="3,3"/>')
    three = x2 + 3.0 * st
    out.append(f'<line x1="{three:.1f}" y1="{top - 4}" x2="{three:.1f}" y2="{y}" stroke="#555" '
               'stroke-dasharray="3,3"/>'
               f'<text x="{three + 3:.1f}" y="{y + 10}" font-size="8">3 s goal</text>')
    for i, (color, label) in enumerate([("#e6550d", "aotc train-step package"),
                                        ("#4292c6", "torch.compile (default)")]):
        out.append(f'<rect x="{left + i * 170}" y="{y + 16}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{left + i * 170 + 14}" y="{y + 25}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--svg", default=None)
    ap.add_argument("--out", default=None, help="the goals as JSON")
    a = ap.parse_args()
    rows, meta = merged(a.results)
    print(table(rows))
    g = goals(rows)
    print(json.dumps(g, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "goals": g}, indent=1))
    if a.svg:
        Path(a.svg).write_text(svg(rows, meta))


if __name__ == "__main__":
    main()
