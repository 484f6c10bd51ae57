"""Compiled for a CPU through the whole pipeline: ops whose index values came from a float input (zero at every
value the check draws, so its adversarial cases never move them) raise in the caller's process where they read
outside their buffers before 2026-11-30's review (the package ended in SIGSEGV): select at an index from `.item()`,
embedding_bag with an offset below the one before it, segment_reduce with unsafe=True. The rewrites themselves are
tested without a compile in test_unsafe_ops.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[2]
SPEC = [{"name": "a", "dtype": "float32", "shape": [1]}, {"name": "b", "dtype": "float32", "shape": [1]},
        {"name": "c", "dtype": "float32", "shape": [1]}, {"name": "t", "dtype": "float32", "shape": [5, 4]},
        {"name": "d", "dtype": "float32", "shape": [6]}]


def _from_float(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 1000, x, torch.zeros_like(x)).long()


class Trusting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 3))
        self.register_buffer("ids", torch.tensor([1, 2, 3, 4]))
        self.register_buffer("offsets", torch.tensor([0, 2]))
        self.register_buffer("second", torch.tensor([0, 1]))
        self.register_buffer("lengths", torch.tensor([2, 4]))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, t: torch.Tensor,
                d: torch.Tensor) -> tuple[torch.Tensor, ...]:
        row = t.select(0, _from_float(a).sum().item())
        offsets = self.offsets - _from_float(b) * self.second
        bags = torch.nn.functional.embedding_bag(self.ids, self.w, offsets, mode="sum")
        sums = aten.segment_reduce(d, "sum", lengths=self.lengths + _from_float(c), unsafe=True)
        return row, bags, sums


CALLER = """
import sys
import torch
from compiler.compat.aoti import aoti_load_package
package = aoti_load_package(sys.argv[1], "cpu")
t, d = torch.randn(5, 4), torch.randn(6)
z = torch.zeros(1)
hostile = {"a": (torch.tensor([5e6]), z, z), "b": (z, torch.tensor([5e6]), z), "c": (z, z, torch.tensor([1e12]))}
for what, floats in hostile.items():
    try:
        package(*floats, t, d)
        print(what, "returned", flush=True)
    except RuntimeError as e:
        print(what, "raised", str(e).replace(chr(10), " ")[:600], flush=True)
print("served", len(package(z, z, z, t, d)), flush=True)
"""


CHECK = """
import json, sys
from compiler.check import check_artifact
adv = check_artifact(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), "cpu")["adversarial"]
print(json.dumps({k: adv.get(k) for k in ("failures", "outcomes", "oracle_bounds", "results")}))
"""


@pytest.mark.slow
def test_index_values_from_a_float_input_raise_in_the_callers_process(tmp_path):
    from compiler.options import CompileOptions
    from compiler.pipeline import compile_model
    from modelzoo import export, seeded

    model = seeded(Trusting, 3).eval()
    floats = (torch.zeros(1), torch.zeros(1), torch.zeros(1))  # three tensors: export would alias one passed thrice
    path = export(model, (*floats, torch.randn(5, 4), torch.randn(6)), tmp_path / "m.pt2")
    result: dict[str, Any] = compile_model(str(path), SPEC, SPEC, CompileOptions(), "cpu", str(tmp_path / "p.pt2"))
    proc = subprocess.run([sys.executable, "-c", CALLER, result["package"]], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])  # -11 before
    said = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert said["served"] == "3"
    assert said["a"].startswith("raised") and "select: the index lies outside its dim" in said["a"], said["a"]
    assert said["b"].startswith("raised") and "offsets of aten.embedding_bag.padding_idx (ascending, into the ids)" \
        in said["b"], said["b"]
    assert said["c"].startswith("raised") and "segment_reduce" in said["c"], said["c"]
    # The artifact check on the same package, in a process of its own as the worker runs it. Its adversarial cases
    # move these floats far out; eager's verdicts come from a copy of the program with the same bounds, so eager's own
    # embedding_bag never reads where a hostile offset points (before: past the ids, in the check's own process;
    # SIGSEGV on an H200, a pointer read as an offset here).
    proc = subprocess.run([sys.executable, "-c", CHECK, str(path), result["package"], json.dumps(SPEC)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    adv = json.loads(proc.stdout.splitlines()[-1])
    assert adv["failures"] == [] and adv["oracle_bounds"] == {"rewritten": 2, "range_checked": 1}, adv
    refused = [r for r in adv["results"] if r["eager"] is not None]
    assert refused and all(r["outcome"] == "refused" for r in refused), refused
    for name, words in (("b", "offsets of aten.embedding_bag"), ("c", "segment_reduce"), ("a", "select")):
        mine = [r for r in refused if SPEC[r["input"]]["name"] == name]
        assert mine and all(words in r["eager"] for r in mine), (name, mine)
