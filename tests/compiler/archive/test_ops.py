"""compiler/archive/ops.txt: the node targets an upload may call. It must hold every operator of the installed
torch (regenerated here) and every op the tests' models call, and nothing that is not an operator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import make_ops
import pytest
import torch
from make_ops import read

from archives import ConvBNReLU, TinyMLP
from compiler.archive.ops import known_targets
from modelzoo import MLP, ConvNet, InplaceReduce, export
from realistic import export_realistic

ROOT = Path(__file__).resolve().parents[3]


def test_ops_txt_covers_the_installed_torch() -> None:
    """In a fresh interpreter: importing Inductor (as other tests do) registers its own internal prims, which no
    exported program calls and the list leaves out."""
    out = subprocess.run([sys.executable, str(Path(make_ops.__file__)), "--print"], check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    missing = sorted(set(out.split()) - known_targets())
    assert not missing, (f"{len(missing)} operators of torch {torch.__version__} are not in ops.txt, e.g. "
                         f"{missing[:5]}: run tests/compiler/archive/make_ops.py")
    _, versions = read()
    assert torch.__version__.split("+")[0] in versions


def _targets(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        root = z.namelist()[0].split("/")[0]
        doc = json.loads(z.read(f"{root}/models/model.json"))
    found: set[str] = set()
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if "target" in v and "inputs" in v and "outputs" in v:
                found.add(v["target"])
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return found


def test_every_op_of_the_test_models_is_listed(tmp_path: Path) -> None:
    paths = list(export_realistic(tmp_path).values())
    for cls, args in [(ConvNet, (torch.randn(2, 3, 16, 16),)), (MLP, (torch.randn(2, 32),)),
                      (InplaceReduce, (torch.randn(2, 16),)), (ConvBNReLU, (torch.randn(2, 3, 8, 8),)),
                      (TinyMLP, (torch.randn(2, 16),))]:
        paths.append(export(cls(), args, tmp_path / f"{cls.__name__}.pt2"))

    class Cond(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    paths.append(export(Cond(), (torch.randn(3),), tmp_path / "cond.pt2"))
    used = set().union(*(_targets(p) for p in paths))
    assert "torch.ops.higher_order.cond" in used and "torch.ops.aten._assert_async.msg" in used
    assert used <= known_targets(), sorted(used - known_targets())


@pytest.mark.parametrize("target", [
    "builtins.eval", "torch.ops.aten.__class__.default", "torch.__builtins__", "torch.ops.aten.add",
    "torch.ops.aten.add.overloads", "torch.ops.higher_order.triton_kernel_wrapper_functional",
    "torch.ops.higher_order.print", "#mylib:op", "torch.ops.mylib.op.default", "torch.load", "_operator.attrgetter",
])
def test_what_is_not_an_operator_is_not_listed(target: str) -> None:
    assert target not in known_targets()


def test_every_refused_operator_is_a_listed_one_so_its_refusal_is_reached() -> None:
    """UNBOUNDED refuses by exact name, after the name is found on the list: a misspelt or unlisted entry would
    refuse nothing (the upload would fail as 'not an operator' at best), so each must be a listed target."""
    from compiler.archive.ops import UNBOUNDED

    assert sorted(set(UNBOUNDED) - known_targets()) == []
