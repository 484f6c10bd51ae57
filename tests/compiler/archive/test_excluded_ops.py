"""Operators left off the list (compiler.archive.ops.EXCLUDED): real ATen operators that act outside the tensors they
are given, which no model's exported graph calls. An upload naming one, as a node target or as an operator-valued
argument, is refused with the operator and the reason; ops.txt holds none of them, and make_ops.py cannot write
one back. The hostile archives are a real export (tests/archives.py AddBytes) with its model.json edited; the
worker's side is in tests/compiler/test_loading.py, the API's answer over HTTP in
tests/service/api/test_api_bad_input.py.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import make_ops
import pytest
import torch

from archives import (
    GRAD_REGION,
    AddBytes,
    Mixed,
    call_in_grad_region,
    edit_json,
    excluded_op_call,
    nodes,
    positional,
)
from compiler.archive import ops
from compiler.archive.inspect import inspect_archive
from compiler.errors import UnsafeArchive
from modelzoo import export

CALLS = {  # the op, the target torch's serializer writes, what the refusal says it does
    "from_file": ("torch.ops.aten.from_file.default", "reads the file its string argument names"),
    "print": ("torch.ops.aten._print.default", "writes its string argument to the standard output"),
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Mixed(), (torch.randn(4, 8),), tmp_path_factory.mktemp("mixed") / "mixed.pt2")


@pytest.fixture(scope="module")
def add_bytes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(AddBytes(), (torch.zeros(16, dtype=torch.uint8),), tmp_path_factory.mktemp("m") / "add.pt2")


def test_the_unedited_program_passes(add_bytes: Path) -> None:
    assert inspect_archive(str(add_bytes))["inputs"] == [{"name": "x", "dtype": "uint8", "shape": [16]}]


@pytest.mark.parametrize("op", sorted(CALLS))
def test_a_node_calling_an_excluded_op_is_refused_at_upload_with_its_reason(op: str, add_bytes: Path,
                                                                             tmp_path: Path) -> None:
    target, does = CALLS[op]
    path = excluded_op_call(add_bytes, tmp_path / f"{op}.pt2", op, "/etc/hostname" if op == "from_file" else "hi")
    with pytest.raises(UnsafeArchive) as info:
        inspect_archive(str(path))
    message = info.value.message
    assert f"calls {target}, which {does}" in message, message
    assert "left off the operator list (compiler/archive/ops.py EXCLUDED)" in message, message
    assert info.value.detail["path"].endswith(".target"), info.value.detail


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("where", ["called", "data"])
def test_an_excluded_op_passed_as_a_value_is_refused_with_its_reason(op: str, where: str, mixed: Path,
                                                                      tmp_path: Path) -> None:
    """An operator-valued argument goes through the same list: as the callable of a no_grad region, and as a plain
    argument of one."""
    target, does = CALLS[op]
    if where == "called":
        path = call_in_grad_region(mixed, tmp_path / "value.pt2", target, [{"as_string": "/etc/hostname"}])
    else:
        def append(doc: Any) -> Any:
            next(n for n in nodes(doc) if n["target"] == GRAD_REGION)["inputs"].append(
                positional({"as_operator": target})[0])
            return doc

        path = edit_json(mixed, tmp_path / "value.pt2", "models/model.json", append)
    with pytest.raises(UnsafeArchive) as info:
        inspect_archive(str(path))
    message = info.value.message
    assert f"naming {target!r}" in message and f"which {does}" in message and "EXCLUDED" in message, message
    assert info.value.detail["path"].endswith("as_operator"), info.value.detail


def test_ops_txt_holds_no_excluded_op() -> None:
    """Read raw, not through known_targets (which drops them too): a regeneration cannot bring one back unseen."""
    lines = [line for line in ops.OPS_TXT.read_text().splitlines() if line and not line.startswith("#")]
    assert len(lines) > 3000
    assert "torch.ops.aten.from_file.default" not in lines and "torch.ops.aten._print.default" not in lines
    back = sorted(line for line in lines if ops.excluded(line) is not None)
    assert not back, back


def test_every_pattern_names_a_real_operator_of_this_torch() -> None:
    """A pattern that matches nothing is a typo that leaves its operator on the list."""
    overloads = [f"torch.ops.aten.{rest}" if "." in rest else f"torch.ops.aten.{rest}.default"
                 for ns, _, rest in (q.partition("::") for q in torch._C._dispatch_get_all_op_names()) if ns == "aten"]
    for pattern in ops.EXCLUDED:
        assert any(fnmatchcase(n, pattern) for n in overloads), pattern


def test_make_ops_writes_no_excluded_op(tmp_path: Path) -> None:
    out = tmp_path / "ops.txt"
    make_ops.write({"torch.ops.aten.from_file.default", "torch.ops.aten._print.default",
                    "torch.ops.aten.set_.source_Storage", "torch.ops.aten.set_.source_Tensor",
                    "torch.ops.aten.add.Tensor"}, {"2.13.0"}, out)
    names, versions = make_ops.read(out)
    assert names == {"torch.ops.aten.set_.source_Tensor", "torch.ops.aten.add.Tensor"} and versions == {"2.13.0"}


@pytest.mark.parametrize("target", ["torch.ops.aten.add.Tensor", "torch.ops.aten.set_.source_Tensor",
                                    "torch.ops.aten._cufft_get_plan_cache_size.default",
                                    "torch.ops.aten._fused_sdp_choice.default", "torch.ops.aten.zeros.default"])
def test_ordinary_ops_and_read_only_queries_stay(target: str) -> None:
    assert ops.excluded(target) is None and target in ops.known_targets()
