"""The check's float and mask cases on a CUDA target (tests/compiler/test_check.py has them on a CPU): a float input
cast to an index and a bool mask whose running count indexes, compiled for cuda:0. A plain AOTInductor build of each
(no bound on the index, as main built them) fails the check on the input the uploader's samples never showed
out of range; aotc's build passes it, refusing the same cases eager refuses. Every refused case ends its probe's
CUDA context (a device-side assert), so each costs a probe of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from compiler.check import check_artifact
from compiler.compat.aoti import aoti_compile_and_package
from compiler.errors import CheckFailed
from compiler.options import CompileOptions
from compiler.pipeline import compile_model
from modelzoo import FLOAT_SPEC, MASK_SPEC, FloatInputIndex, MaskedGather, export


def _unbounded(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: Path) -> str:
    """A plain AOTInductor package of the model exported on the device, with none of aotc's bounds (the CPU
    program's module moved there keeps export's asserts that its tensors are on the CPU)."""
    on_device = torch.export.export(model.cuda(), tuple(t.cuda() for t in inputs))
    return aoti_compile_and_package(on_device, str(out), {})


def _masked() -> tuple[torch.Tensor, ...]:
    mask = torch.zeros(16, dtype=torch.bool)
    mask[:4] = True
    return torch.randn(16), mask


CASES: dict[str, tuple[Any, Any, list[dict[str, Any]], str]] = {
    "float": (FloatInputIndex, lambda: (torch.randn(16, 4), torch.rand(8)), FLOAT_SPEC, "f"),
    "mask": (MaskedGather, _masked, MASK_SPEC, "mask"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_float_and_mask_inputs_that_index_are_tried_out_of_range_on_cuda(tmp_path, case):
    cls, make, spec, name = CASES[case]
    inputs = make()
    path = export(cls(), inputs, tmp_path / "m.pt2")
    with pytest.raises(CheckFailed) as info:
        check_artifact(str(path), _unbounded(cls(), inputs, tmp_path / "unbounded.pt2"), spec, "cuda:0")
    assert info.value.message.startswith(f"artifact fails the adversarial check at min shapes: input '{name}' = "), \
        info.value.message

    result = compile_model(str(path), spec, spec, CompileOptions(), "cuda:0", str(tmp_path / "aotc.pt2"))
    adv = check_artifact(str(path), result["package"], spec, "cuda:0")["adversarial"]
    assert adv["failures"] == [] and set(adv["inputs"]) == {name}, adv["failures"]
    refused = [r for r in adv["results"] if r["outcome"] == "refused"]
    if case == "float":  # |f| indexes 16 rows: 16, 17 and the far values are refused, as on a CPU
        assert len(refused) >= 10 and adv["outcomes"]["agreed"] >= 10, adv["outcomes"]
    else:  # 16 set reads row 15 of 12; the random mask with one more set fits
        assert [(r["value"], r["whole"]) for r in refused] == [(True, True)], adv["results"]
    # each refused case ended its probe's context: a probe apiece, and what one cost is in the record
    assert adv["probes"] >= len(refused) and adv["probe_cost"]["context_s"] > 0, adv
