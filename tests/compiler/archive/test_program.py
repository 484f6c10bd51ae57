"""compiler.archive.program: operators that ATen spells as dunders are real operators, dunders that any object
has are not; the serialized dtype table matches torch's."""

from __future__ import annotations

import pytest
import torch

from compiler.archive.inspect import inspect_archive
from compiler.archive.ops import is_operator_target as _is_operator_target
from compiler.archive.program import SCALAR_TYPES


def test_attention_mask_and_is_accepted(tmp_path):
    class Masked(torch.nn.Module):
        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            keep = (m > 0) & (x > 0)  # aten.__and__.Tensor, as in every HF attention mask
            return torch.where(keep, x, torch.zeros_like(x))

    ep = torch.export.export(Masked(), (torch.randn(2, 4), torch.ones(2, 4, dtype=torch.int64)))
    assert any("__and__" in str(n.target) for n in ep.graph.nodes)
    torch.export.save(ep, str(tmp_path / "m.pt2"))
    info = inspect_archive(str(tmp_path / "m.pt2"))
    assert [i["name"] for i in info["inputs"]] == ["x", "m"]


@pytest.mark.parametrize("target", ["torch.ops.aten.__class__.default", "torch.ops.aten.__and__.__init__",
                                    "torch.__builtins__", "torch.ops.__dict__.x.y"])
def test_object_dunders_are_refused(target):
    assert not _is_operator_target(target)


def test_scalar_type_table_matches_torch() -> None:
    from torch._export.serde.schema import ScalarType
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    for st, dt in _SERIALIZE_TO_TORCH_DTYPE.items():
        if st != ScalarType.UNKNOWN:
            assert SCALAR_TYPES[int(st)] == str(dt).removeprefix("torch."), st
