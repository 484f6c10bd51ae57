"""What the forced index asserts cost, and whether they ever fire on real models' in-range inputs.

    python bench/bounds.py --out bench/results/bounds-cpu.json

For each model the same specialised program is compiled twice through compiler.stages.inductor: `off` with
Inductor's defaults (what main built), `on` with compiler.options.FORCED_INDUCTOR_CONFIGS (assert_indirect_indexing,
debug_index_asserts), the fallbacks' error checks in both. Reported: compile seconds (the median of `--compiles`
per variant, compiled off, on, on, off), the package's median call on
the model's inputs (compiler.check.measure, alternating `off` and `on`), the index asserts left in the generated
code after range analysis, and the full artifact check of the `on` package (random in-range inputs at every point,
then the adversarial integer inputs): no false assert, no false alarm.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from compiler import options as options_mod  # noqa: E402
from compiler import stages  # noqa: E402
from compiler.archive.inspect import inspect_archive  # noqa: E402
from compiler.check import check_artifact, measure  # noqa: E402
from compiler.compat.aoti import aoti_load_package  # noqa: E402
from compiler.loading import load_program  # noqa: E402
from compiler.options import CompileOptions  # noqa: E402
from compiler.shapes import canonical_spec  # noqa: E402
from modelzoo import MLP, ConvNet, InplaceReduce, seeded  # noqa: E402
from realistic import TinyLM  # noqa: E402


class Upsample(torch.nn.Module):
    """Nearest, nearest-exact and bilinear upsampling: Inductor indexes with computed indices (_unsafe_index in its
    decompositions), which range analysis should prove in bounds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        a = F.interpolate(y, scale_factor=2, mode="nearest")
        b = F.interpolate(y, scale_factor=2, mode="nearest-exact")
        c = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=False)
        return a + b + c


class Embedder(torch.nn.Module):
    """Token ids through an embedding, a gather by position and a bag mean: indices from the caller."""

    def __init__(self, vocab: int = 1000, d: int = 64) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.randn(512, d))
        self.head = torch.nn.Linear(d, 16)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos[positions]
        return self.head(torch.tanh(x).mean(dim=1))


def models() -> list[tuple[str, torch.nn.Module, tuple[Any, ...], dict[str, list[int]]]]:
    torch.manual_seed(0)
    return [
        ("convnet", seeded(ConvNet, 1), (torch.randn(8, 3, 32, 32),), {"x": [8, 3, 32, 32]}),
        ("mlp", seeded(MLP, 2), (torch.randn(64, 32),), {"x": [64, 32]}),
        ("inplace_reduce", seeded(InplaceReduce, 3), (torch.randn(64, 16),), {"x": [64, 16]}),
        ("tiny_lm", seeded(TinyLM, 4), (torch.randint(0, 100, (4, 64)), torch.ones(4, 64, dtype=torch.int64)),
         {"input_ids": [4, 64], "attention_mask": [4, 64]}),
        ("upsample", seeded(Upsample, 5), (torch.randn(4, 3, 32, 32),), {"x": [4, 3, 32, 32]}),
        ("embedding", seeded(Embedder, 6), (torch.randint(0, 1000, (16, 128)), torch.randint(0, 512, (16, 128))),
         {"ids": [16, 128], "positions": [16, 128]}),
    ]


ASSERT = re.compile(r"index out of bounds")


def asserts_in(package: str) -> int:
    with zipfile.ZipFile(package) as zf:
        return sum(len(ASSERT.findall(zf.read(n).decode("utf-8", "replace")))
                   for n in zf.namelist() if n.endswith(".kernel.cpp") or n.endswith(".wrapper.cpp"))


def compile_one(captured: stages.Captured, forced: bool, out: str) -> tuple[str, float]:
    saved = dict(options_mod.FORCED_INDUCTOR_CONFIGS)
    if not forced:
        options_mod.FORCED_INDUCTOR_CONFIGS.clear()
    try:
        t0 = time.perf_counter()
        compiled = stages.inductor(captured, CompileOptions(), out, "cpu")
        return compiled.package, time.perf_counter() - t0
    finally:
        options_mod.FORCED_INDUCTOR_CONFIGS.update(saved)


def bench(name: str, model: torch.nn.Module, args: tuple[Any, ...], shapes: dict[str, list[int]], rounds: int,
          compiles: int, work: Path) -> dict[str, Any]:
    path = work / f"{name}.pt2"
    torch.export.save(torch.export.export(model.eval(), args), str(path))
    inputs = inspect_archive(str(path))["inputs"]
    spec = canonical_spec(inputs, shapes)
    captured = stages.capture(load_program(str(path)), spec, inputs, "cpu")
    row: dict[str, Any] = {"model": name}
    packages: dict[str, str] = {}
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    # off, on, on, off: neither variant always compiles first (the first compile of a process warms caches).
    for n, variant in enumerate(("off", "on", "on", "off")[: 2 * compiles]):
        package, s = compile_one(captured, variant == "on", str(work / f"{name}-{variant}-{n}.pt2"))
        packages[variant] = package
        seconds[variant].append(s)
    for variant in ("off", "on"):
        row[f"compile_s_{variant}"] = round(statistics.median(seconds[variant]), 2)
        row[f"asserts_{variant}"] = asserts_in(packages[variant])
    loaded = {v: aoti_load_package(p, "cpu") for v, p in packages.items()}
    times: dict[str, list[float]] = {"off": [], "on": []}
    with torch.inference_mode():
        for _ in range(rounds):  # alternate, so a busy machine weighs on both alike
            for v in ("off", "on"):
                times[v].append(measure(lambda v=v: loaded[v](*args), "cpu", budget_s=2.0)["median_ms"])
        for _ in range(20):  # in-range inputs of the model's own kind: no assert may fire
            fresh = [torch.randint(0, int(a.max()) + 1, a.shape) if not a.is_floating_point() else torch.randn(a.shape)
                     for a in args]
            loaded["on"](*fresh)
    for v in ("off", "on"):
        row[f"run_ms_{v}"] = round(statistics.median(times[v]), 4)
    row["run_ratio"] = round(row["run_ms_on"] / row["run_ms_off"], 3)
    row["compile_ratio"] = round(row["compile_s_on"] / row["compile_s_off"], 3)
    check = check_artifact(str(path), packages["on"], spec, "cpu")
    adv = check.get("adversarial", {})
    row.update(check_passed=check["passed"], adversarial_cases=adv.get("cases", 0),
               adversarial_outcomes=adv.get("outcomes", {}), adversarial_s=adv.get("seconds", 0.0),
               adversarial_probes=adv.get("probes", 0))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per model (median reported)")
    ap.add_argument("--compiles", type=int, choices=(1, 2), default=2,
                    help="compiles per variant, in the order off, on, on, off (median reported)")
    ap.add_argument("--only", nargs="*", help="model names")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aotc-bench-bounds-") as tmp:
        for name, model, args, shapes in models():
            if a.only and name not in a.only:
                continue
            rows.append(bench(name, model, args, shapes, a.rounds, a.compiles, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    header = ["model", "compile_s_off", "compile_s_on", "compile_ratio", "run_ms_off", "run_ms_on", "run_ratio",
              "asserts_off", "asserts_on", "check_passed", "adversarial_cases", "adversarial_s"]
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(r[h]).ljust(w) for h, w in zip(header, widths)))
    if a.out:
        a.out.write_text(json.dumps({"device": "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                     "threads": torch.get_num_threads(), "rounds": a.rounds, "compiles": a.compiles,
                                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
