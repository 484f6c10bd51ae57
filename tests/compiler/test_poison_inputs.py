"""Which inputs the adversarial check varies besides the integer ones (compiler.inputs): float inputs whose values
the program casts to an integer, and bool masks it indexes by; found by walking the exported graph (no compile)."""

from __future__ import annotations

import torch

from compiler import inputs as inputs_mod


def _spec(*pairs: tuple[str, str]) -> list[dict[str, object]]:
    return [{"name": n, "dtype": d, "shape": []} for n, d in pairs]


class Casts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 3))

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                e: torch.Tensor) -> torch.Tensor:
        rows = a.long() + (b * 4).round().to(torch.int32) + c.view(torch.int32)  # a cast, a rounded cast, a bitcast
        scaled = d * 2 + e.floor()  # floats that stay floats
        return self.table[rows].sum() + scaled.sum()


def test_float_inputs_cast_or_bitcast_to_an_integer_are_found_and_others_not():
    args = tuple(torch.zeros(4) for _ in range(5))
    ep = torch.export.export(Casts(), args)
    spec = _spec(("a", "float32"), ("b", "float32"), ("c", "float32"), ("d", "float32"), ("e", "float32"))
    assert inputs_mod.index_inputs(ep, spec)[0] == [0, 1, 2]


class InGradRegion(torch.nn.Module):
    """A cast inside a region export keeps as a higher-order op (torch.no_grad inside a training-mode export)."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            i = x.long()
        return t[i]


def test_a_cast_inside_a_higher_order_ops_subgraph_is_found():
    ep = torch.export.export(InGradRegion().train(), (torch.zeros(2), torch.randn(5)))
    assert inputs_mod.index_inputs(ep, _spec(("x", "float32"), ("t", "float32")))[0] == [0]


class Masks(torch.nn.Module):
    def forward(self, x: torch.Tensor, pick: torch.Tensor, count: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        rows = torch.cumsum(count.long(), 0)  # a running count: row numbers
        return x[pick].sum() + x[rows.clamp(max=3)].sum() + torch.where(keep, x, 0.0).sum()


def test_bool_masks_that_index_or_count_are_found_and_a_where_mask_is_not():
    ep = torch.export.export(Masks(), (torch.randn(4), torch.ones(4, dtype=torch.bool),
                                       torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool)))
    spec = _spec(("x", "float32"), ("pick", "bool"), ("count", "bool"), ("keep", "bool"))
    assert inputs_mod.index_inputs(ep, spec)[1] == [1, 2]
    assert inputs_mod.index_inputs(ep, spec)[0] == []


def test_float_cases_keep_to_what_the_dtype_holds_and_to_a_defined_cast():
    values = [v for v, _ in inputs_mod.adversarial_floats(torch.float32, [16, 4])]
    assert values == [2.0**40, -2.0**40, 400000.0, -400000.0, -1.0, 16.0, -17.0, 4.0, -5.0, 0.0]
    assert all(abs(v) < 2**63 / 2**22 for v in values)  # scaled by up to 2**22, still inside int64
    half = [v for v, _ in inputs_mod.adversarial_floats(torch.float16, [16])]
    assert half == [-1.0, 16.0, -17.0, 0.0]  # 65504 is float16's largest: no 400000, no 2**40


def test_cases_take_turns_between_integer_float_and_mask_inputs():
    spec = [{"name": "i", "dtype": "int64", "shape": [2]}, {"name": "f", "dtype": "float32", "shape": [2]},
            {"name": "m", "dtype": "bool", "shape": [2]}]
    cases = inputs_mod.adversarial_cases(spec, [[2], [2], [2]], [None, None, None], [8], 9, floats=[1], masks=[2])
    assert [(c.name, c.value, c.whole) for c in cases] == [
        ("i", 2**63 - 1, False), ("f", 2.0**40, False), ("m", True, False),
        ("i", 2**63 - 1, True), ("f", 2.0**40, True), ("m", True, True),
        ("i", -2**63, False), ("f", -2.0**40, False), ("m", False, False)]
