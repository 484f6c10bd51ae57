"""Does the worker's timing method (compiler.check.measure) agree with triton.testing.do_bench?

Runs each model of the zoo eagerly (bf16, random weights) at each batch, and times the same call with both methods
in alternating rounds in one process; prints a table and writes JSON. Eager at batch 1 is the hardest case for a
timing method: launch-bound, so the figure depends on how the CPU and the GPU overlap.

    python3 bench/agreement.py --models resnet50,hf_bert_base --batches 1,serving --out $OUT/agreement.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,hf_bert_base")
    ap.add_argument("--batches", default="1,serving")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/agreement.json")
    a = ap.parse_args()

    import torch
    from triton.testing import do_bench

    from bench.zoo import MODELS, build
    from compiler.check import device_info, measure

    rows: list[dict[str, Any]] = []
    for name in a.models.split(","):
        for b in a.batches.split(","):
            batch = MODELS[name].batch if b == "serving" else int(b)
            model, inputs = build(name, batch=batch)
            ours: list[float] = []
            theirs: list[float] = []
            call = functools.partial(model, *inputs)
            with torch.inference_mode():
                for _ in range(a.rounds):
                    ours.append(measure(call, "cuda:0")["median_ms"])
                    theirs.append(float(do_bench(call, warmup=25, rep=200, return_mode="median")))
            o, t = statistics.median(ours), statistics.median(theirs)
            rows.append({"model": name, "batch": batch, "measure_ms": ours, "do_bench_ms": theirs,
                         "measure_median_ms": o, "do_bench_median_ms": t, "ratio": o / t})
            print(f"{name:28s} b={batch:<3d} measure {o:8.3f} ms  do_bench {t:8.3f} ms  ratio {o / t:5.2f}  "
                  f"(rounds {[round(x, 3) for x in ours]} / {[round(x, 3) for x in theirs]})", flush=True)
            del model, inputs, call
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device_info("cuda:0"), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
