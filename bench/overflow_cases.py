"""Where the adversarial check's cases take a zoo model's float arithmetic: per case, whether eager returns, how many
of its outputs' values are not finite, and the float64 run's peak (the largest finite magnitude of any value it
computed, intermediates included: compiler.fp64.float64_peak_run) against the edge that `beyond range` uses (the
dtype's largest finite value over OVERFLOW_MARGIN). No package is built or run: this says which cases a package
could only disagree on by overflowing, and which it could not.

    python3 bench/overflow_cases.py --model hf_deberta_v3_small --input attention_mask --out overflow.json

The cases are the check's own (compiler.inputs.adversarial_cases at the spec's smallest point, the zoo's serving
batch, seed 0), so a row names a case as the check's failure message does. Runs on the CPU by default; each case
runs eager in the zoo's dtype and once more in float64.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.zoo import build, spec_of  # noqa: E402
from compiler import adversarial, fp64  # noqa: E402
from compiler import inputs as inputs_mod  # noqa: E402


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a zoo model (bench/zoo.py)")
    ap.add_argument("--input", default=None, help="only the cases of this input (default: every integer input)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    model, args = build(a.model, device=a.device)
    with torch.no_grad():
        ep = torch.export.export(model, args)
    del model
    spec = spec_of(ep, args)
    shapes = next(iter(inputs_mod.points(spec).values()))
    ranges = inputs_mod.int_ranges(ep)
    base = inputs_mod.random_inputs(spec, shapes, a.device, ranges, 0)
    poisons = adversarial.cases_at(ep, spec, shapes, ranges)[0]
    eager = ep.module()
    rows: list[dict[str, Any]] = []
    print(f"{'case':74s} {'eager':>12s} {'fp64 peak':>10s}  edge")
    for p in poisons:
        if a.input and p.name != a.input:
            continue
        call, kwargs = inputs_mod.call_args(ep, inputs_mod.poisoned(base, p))
        t0 = time.perf_counter()
        row: dict[str, Any] = {"case": p.describe(base[p.input].numel()), "input": p.name, "value": p.value,
                               "whole": p.whole}
        try:
            with torch.no_grad():
                out = _first(eager(*call, **kwargs))
        except Exception as e:  # noqa: BLE001 - eager refuses the case: the check wants the package to refuse too
            row.update(eager=f"raises {type(e).__name__}", seconds=round(time.perf_counter() - t0, 1))
            rows.append(row)
            print(f"{row['case'][:74]:74s} {'raises':>12s}")
            continue
        ref, peak = fp64.float64_peak_run(eager, call, kwargs)
        edge = torch.finfo(out.dtype).max / fp64.OVERFLOW_MARGIN if out.is_floating_point() else None
        row.update(eager="returns", dtype=str(out.dtype).removeprefix("torch."),
                   eager_nonfinite=int((~torch.isfinite(out.float())).sum()) if out.is_floating_point() else 0,
                   fp64_nonfinite=int((~torch.isfinite(_first(ref))).sum()) if out.is_floating_point() else 0,
                   fp64_peak=peak, edge=edge, at_edge=bool(peak is not None and edge is not None and peak >= edge),
                   seconds=round(time.perf_counter() - t0, 1))
        rows.append(row)
        print(f"{row['case'][:74]:74s} {row['eager_nonfinite']:>5d} non-fin. {peak or 0:10.3g}  "
              f"{'at the edge' if row['at_edge'] else ''}", flush=True)
    result = {"model": a.model, "device": a.device, "torch": torch.__version__,
              "overflow_margin": fp64.OVERFLOW_MARGIN, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    at_edge = sum(r.get("at_edge", False) for r in rows)
    print(f"{at_edge} of {len(rows)} cases at the edge of the dtype's range; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
