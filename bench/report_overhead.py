"""What the stage report costs: the same compile with and without the observers, plus the extra re-traces of the
autograd and lowering stages.

    python bench/report_overhead.py --device cpu --out bench/results/report-overhead-cpu.json

For each model: `plain` is aoti_compile_and_package on the specialised program with fx_graph_cache off (the
observed compile turns it off too, so both compile for real); `observed` is the same call under
compiler.stages.inductor (config hooks, structured-trace handler, run_and_get_code); `stages` is the autograd and
lowering stages' own re-traces. Runs alternate, and the median of `--runs` is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compiler import stages  # noqa: E402
from compiler.compat.aoti import aoti_compile_and_package  # noqa: E402
from compiler.options import CompileOptions  # noqa: E402


class InplaceReduce(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        y.add_(1.0)
        y = torch.relu(y)
        return torch.nn.functional.gelu(y / (y.sum(-1, keepdim=True) + 1.0)) * 2.0


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2), torch.nn.ReLU())
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x).mean(dim=(2, 3)))


class Transformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x)


MODELS = {
    "inplace_reduce": (InplaceReduce, (8, 64)),
    "convnet": (ConvNet, (4, 3, 64, 64)),
    "transformer": (Transformer, (4, 32, 128)),
}


def measure(name: str, device: str, runs: int) -> dict[str, Any]:
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval().to(device)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(*shape, device=device),), dynamic_shapes={"x": {0: batch}})
    spec = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 32}, *shape[1:]]}]
    program_inputs = [{"name": "x", "dtype": "float32", "shape": [{"min": 1, "max": 64, "symbol": "s0"}, *shape[1:]]}]
    captured = stages.capture(ep, spec, program_inputs, device)
    options = CompileOptions()
    plain, observed, traces = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(runs):
            from torch._inductor import config

            t0 = time.perf_counter()
            with config.patch({"fx_graph_cache": False}):
                aoti_compile_and_package(captured.program, f"{d}/plain{i}.pt2", options.inductor_configs())
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiled = stages.inductor(captured, options, f"{d}/observed{i}.pt2", device)
            stages.fusion(compiled)
            stages.codegen(compiled)
            observed.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            functional = stages.autograd(captured)
            stages.lowering(functional, captured)
            traces.append(time.perf_counter() - t0)
    p, o, t = (statistics.median(x) for x in (plain, observed, traces))
    return {"model": name, "plain_s": round(p, 3), "observed_s": round(o, 3), "stage_traces_s": round(t, 3),
            "overhead_s": round(o + t - p, 3), "overhead_pct": round(100 * (o + t - p) / p, 1),
            "runs": runs, "kernels": compiled.observation.scheduler_runs and len(
                [n for n in compiled.observation.scheduler_runs[-1]["after"] or [] if not n["extern"]])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # Warm-up: the first AOTInductor compile in a cache dir builds precompiled headers.
    measure("inplace_reduce", a.device, 1)
    rows = [measure(m, a.device, a.runs) for m in a.models.split(",")]
    header = ["model", "plain_s", "observed_s", "stage_traces_s", "overhead_s", "overhead_pct"]
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    for r in [dict(zip(header, header)), *rows]:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(header, widths)))
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": a.device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                   "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
