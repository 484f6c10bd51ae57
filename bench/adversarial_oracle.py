"""What the adversarial check's CPU oracle costs: eager's verdicts on the poisoned integer inputs of a train-step
program, each case running again every node its poisoned input reaches (`may_raise_only=False`, before) against only
the nodes that can raise and what they read (`compiler.adversarial._may_raise_cone`, after), alternating rounds in
one process. Both must give the same verdicts (the script exits 1 where they do not).

On an H200 the training check's adversarial part took 100-363 s on text models whose probes took 38-64 s of it
(2026-11-28): the rest was this oracle running the whole network on the CPU again for each in-range token-id case.

    python bench/adversarial_oracle.py --models hf_distilbert,hf_bert_base,resnet18 --batch 8 \\
        --out bench/results/adversarial-oracle-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(name: str, batch: int, rounds: int) -> dict[str, Any]:
    from bench import trainmodels
    from compiler import adversarial
    from compiler import inputs as inputs_mod

    _, _, ep, spec = trainmodels.exported(name, batch, "cpu")
    shapes, ranges = [s["shape"] for s in spec], inputs_mod.int_ranges(ep)
    base = inputs_mod.random_inputs(spec, shapes, "cpu", ranges, 0)
    poisons = adversarial.cases_at(ep, spec, shapes, ranges)[0]
    flats = [inputs_mod.poisoned(base, p) for p in poisons]
    module = ep.module()
    times: dict[str, list[float]] = {"before": [], "after": []}
    got: dict[str, Any] = {}
    for _ in range(rounds):
        for way, only in (("before", False), ("after", True)):
            t0 = time.perf_counter()
            got[way] = adversarial.partial_verdicts(ep, module, base, flats, [p.input for p in poisons],
                                                    may_raise_only=only)
            times[way].append(time.perf_counter() - t0)
    before, after = got["before"], got["after"]
    row: dict[str, Any] = {
        "model": name, "batch": batch, "cases": len(flats), "graph_nodes": len(module.graph.nodes),
        "inputs": {spec[k]["name"]: sum(1 for p in poisons if p.input == k) for k in inputs_mod.integer_inputs(spec)},
        "seconds_before": round(statistics.median(times["before"]), 3),
        "seconds_after": round(statistics.median(times["after"]), 3),
        "nodes_before": before[1] if before else None, "nodes_after": after[1] if after else None,
        "refused": sum(1 for v in (after[0] if after else []) if v is not None),
        "same_verdicts": bool(before and after and before[0] == after[0]),
    }
    row["speedup"] = round(row["seconds_before"] / max(row["seconds_after"], 1e-9), 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="hf_distilbert,hf_bert_base,resnet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from bench.upload_sweep import stub_torchvision_ops

    stub_torchvision_ops()
    torch.manual_seed(0)
    rows = []
    print(f"{'model':<28}{'cases':>6}{'refused':>8}{'nodes before':>14}{'nodes after':>12}{'s before':>10}"
          f"{'s after':>9}{'x':>7}  same")
    for name in filter(None, a.models.split(",")):
        r = measure(name, a.batch, a.rounds)
        rows.append(r)
        print(f"{r['model']:<28}{r['cases']:>6}{r['refused']:>8}{r['nodes_before']:>14}{r['nodes_after']:>12}"
              f"{r['seconds_before']:>10.2f}{r['seconds_after']:>9.2f}{r['speedup']:>7.1f}  {r['same_verdicts']}",
              flush=True)
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": a.rounds, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["same_verdicts"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
