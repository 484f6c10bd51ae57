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


class NonFinite(torch.nn.Module):
    """Floats JSON cannot hold, as torch writes them: the -inf of nn.TransformerEncoder's padding mask, a NaN fill."""

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        scores = x.masked_fill(pad, float("-inf")).softmax(-1)
        return scores + torch.full_like(x, float("nan")).nan_to_num(0.0) + x.clamp(max=float("inf"))


def test_non_finite_floats_as_torch_writes_them_are_accepted_and_others_refused(tmp_path):
    """Until 2026-11-30 the door refused every program with a float argument of inf or NaN, which torch writes as the
    strings "Infinity", "-Infinity" and "NaN": nn.TransformerEncoder with a padding mask among them."""
    from archives import edit_json, nodes
    from compiler.errors import UnsafeArchive
    from compiler.loading import load_program

    x, pad = torch.randn(2, 4), torch.tensor([[False, False, True, True]] * 2)
    ep = torch.export.export(NonFinite(), (x, pad))
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    written = [a["arg"]["as_float"] for n in nodes(_model_json(path)) for a in n["inputs"]
               if isinstance(a.get("arg"), dict) and isinstance(a["arg"].get("as_float"), str)]
    assert sorted(written) == ["-Infinity", "Infinity", "NaN"], written
    assert [i["name"] for i in inspect_archive(str(path))["inputs"]] == ["x", "pad"]
    torch.testing.assert_close(load_program(str(path)).module()(x, pad), NonFinite()(x, pad))

    def spelled(doc: dict, how: str) -> dict:
        for n in nodes(doc):
            for a in n["inputs"]:
                if isinstance(a.get("arg"), dict) and a["arg"].get("as_float") == "-Infinity":
                    a["arg"]["as_float"] = how
        return doc

    for how in ("-inf", "1e999", "__import__('os')", ""):  # not what torch writes: refused, whatever it would parse to
        bad = edit_json(path, tmp_path / "bad.pt2", "models/model.json", lambda d, how=how: spelled(d, how))
        with pytest.raises(UnsafeArchive, match="is a string; the export schema has float there"):
            inspect_archive(str(bad))


def _model_json(path) -> dict:
    from archives import read_json

    return read_json(path, "models/model.json")
