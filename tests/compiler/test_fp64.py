"""The float64 second opinion (compiler/fp64.py): the rules that judge a value the first comparison refused, on
values whose distances from float64 are set by hand."""

from __future__ import annotations

import torch

from compiler import fp64
from compiler.check import compare


def _around(ref: torch.Tensor, size: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return ref + size * torch.randn(ref.shape, generator=gen, dtype=torch.float64)


REF = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_the_float64_second_opinion_passes_rounding_and_refuses_a_real_difference():
    """Two bf16 implementations may both be a tolerance or more from float64; the package passes where it is no
    farther from float64 than FP64_MULTIPLIER times eager, plus the tolerance; a package off by what a weight moves
    does not."""
    ref = REF
    eager = _around(ref, 0.08, 1)  # eager's own rounding: 8 % off
    good = _around(ref, 0.01, 2)
    first = compare(eager, good, 0.05)
    assert not first["ok"]
    second = fp64.second_opinion(first, eager, good, ref, 0.05)
    assert second["ok"] and second["fp64"]["package"] < second["fp64"]["eager"] and second["first_judgment"]
    wrong = ref + 2.0  # a bias the package ignores shifts every element
    verdict = fp64.second_opinion(compare(eager, wrong, 0.05), eager, wrong, ref, 0.05)
    assert not verdict["ok"] and "output 0: against float64 the package is off by" in verdict["why"]




def test_the_rms_rule_passes_a_value_off_as_a_whole_by_rounding_and_not_one_element_far_off():
    """efficientnet_b0's BatchNorm-weight gradient on the H200s: the package's largest element 3.6x eager's distance
    from float64 (3x allowed), its root-mean-square 2.6x. Torchbench's measure passes it; a value right everywhere
    but one element (an index off by one) is refused by the cap on the largest element."""
    eager = _around(REF, 0.01, 1)
    spread = _around(REF, 0.026, 2)  # off as a whole, 2.6x eager's spread, its largest element 3.6x eager's
    spread[7, 7] = REF[7, 7] + 3.6 * float((eager - REF).abs().max())
    j = fp64.judge(spread, eager, REF, 1.0, 0.0)
    assert j["package"] > j["bound"] and j["ok"] and j["rule"] == "rms", j
    spike = eager.clone()
    spike[3, 5] += 10 * float((eager - REF).abs().max())
    j = fp64.judge(spike, eager, REF, 1.0, 0.0)
    assert j["rmse"]["package"] <= j["rms_bound"] and not j["ok"], j
    assert "allowed" in fp64.describe(j) and "root-mean-square" in fp64.describe(j)
    assert fp64.judge(eager, eager, REF, 1.0, 0.0)["rule"] == "largest"
