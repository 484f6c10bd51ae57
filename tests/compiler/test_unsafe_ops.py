"""compiler.bounds on real exported programs, without a compile: each op that skips a bounds check becomes a checked
form that means what eager means (the same values where eager returns, an error where eager raises), the rewrite is
reported, and ops with no checked form are refused. The compiled side is in test_check.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from compiler.archive.inspect import inspect_archive
from compiler.bounds import bound_program
from compiler.errors import BadModel, UnsafeArchive
from modelzoo import exported

aten = torch.ops.aten


def ops(ep: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


def outcome(module: Any, *args: Any) -> Any:
    try:
        return module(*args)
    except Exception as e:  # noqa: BLE001 - the error's type is the outcome
        return type(e)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    return bool(torch.equal(a, b))


def test_unsafe_index_becomes_index_and_raises_where_eager_raises():
    ep = exported(lambda x, i: aten._unsafe_index.Tensor(x, [i]), torch.randn(16, 4), torch.zeros(8, dtype=torch.long))
    original = ep.module()
    report = bound_program(ep)
    assert report.facts()["ops"] == {"aten._unsafe_index.Tensor": 1}
    assert report.rewritten[0]["became"] == "aten.index.Tensor"
    assert ops(ep) == {"aten.index.Tensor"}
    bounded = ep.module()
    x = torch.randn(16, 4)
    for i in ([0, 15, -1, -16, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 16], [-17] * 8, [400000] * 8):
        idx = torch.tensor(i)
        assert same(outcome(bounded, x, idx), outcome(original, x, idx)), i
    assert outcome(bounded, x, torch.tensor([-400000] * 8)) is IndexError


def test_unsafe_masked_index_and_its_put_keep_eagers_clamp_where_inductor_would_read_anywhere():
    x = torch.arange(10.0)
    mask = torch.tensor([True, True, True, False, True])
    idx = torch.tensor([0, 9, -1, 100, 10])
    ep = exported(lambda x, m, i: (aten._unsafe_masked_index(x, m, [i], -7.0),
                                   aten._unsafe_masked_index_put_accumulate(x, m, [i], torch.ones(5))), x, mask, idx)
    original = ep.module()
    report = bound_program(ep)
    assert set(report.facts()["ops"]) == {"aten._unsafe_masked_index.default",
                                          "aten._unsafe_masked_index_put_accumulate.default"}
    assert not any("_unsafe" in op for op in ops(ep))
    bounded = ep.module()
    for i in (idx, torch.tensor([-400000, 400000, 5, -11, 10]), torch.full((5,), 2**62)):
        for got, want in zip(bounded(x, mask, i), original(x, mask, i), strict=True):
            assert torch.equal(got, want)


def test_max_unpool_bounds_each_index_by_its_plane_as_eager_does():
    x = torch.randn(2, 3, 4, 4)
    _, ind = torch.nn.functional.max_pool2d(torch.randn(2, 3, 8, 8), 2, return_indices=True)
    ep = exported(lambda x, i: torch.nn.functional.max_unpool2d(x, i, 2), x, ind)
    original = ep.module()
    assert bound_program(ep).facts()["ops"] == {"aten.max_unpool2d.default": 1}
    bounded = ep.module()
    assert torch.equal(bounded(x, ind), original(x, ind))
    # -1 and 64 are in bounds of the batch's one buffer (Inductor's decomposition), not of a plane.
    for bad in (-1, 64, 2 * 3 * 64 - 1):
        poisoned = ind.clone()
        poisoned[1, 2, 0, 0] = bad
        assert isinstance(outcome(original, x, poisoned), type) and isinstance(outcome(bounded, x, poisoned), type)


def test_as_strided_with_a_symbolic_offset_gets_a_runtime_bound():
    # In bounds at the checked shapes (2 and 10), 60 KB past the end at 5: Inductor lowers as_strided to a view.
    class Strided(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s = x.shape[0]
            return torch.as_strided(x, (4,), (1,), (s - 2) * (10 - s) * 1000)

    b = torch.export.Dim("b", min=2, max=10)
    ep = torch.export.export(Strided(), (torch.randn(10, 4),), dynamic_shapes=({0: b},))
    assert bound_program(ep).facts()["ops"] == {"aten.as_strided.default": 1}
    bounded = ep.module()
    for n in (2, 10):
        x = torch.randn(n, 4)
        assert torch.equal(bounded(x), x.flatten()[:4])
    with pytest.raises(RuntimeError, match="as_strided: the view reaches outside its tensor"):
        bounded(torch.randn(5, 4))
    # Re-exported as the compile does, the bound is a run-time assert in the graph, not a guard on the range.
    again = torch.export.export(bounded, (torch.randn(6, 4),), dynamic_shapes=({0: b},))
    assert "aten._assert_async.msg" in ops(again)


def test_index_put_impl_loses_its_unsafe_flag():
    def f(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return aten._index_put_impl(x, [i], torch.ones(2), True, True)

    ep = exported(f, torch.zeros(8), torch.tensor([1, 2]))
    assert bound_program(ep).facts()["ops"] == {"aten._index_put_impl.default": 1}
    bounded = ep.module()
    assert torch.equal(bounded(torch.zeros(8), torch.tensor([1, 1])), f(torch.zeros(8), torch.tensor([1, 1])))
    assert outcome(bounded, torch.zeros(8), torch.tensor([1, 8])) in (IndexError, RuntimeError)


def test_a_sparse_tensor_built_from_unchecked_indices_is_refused_at_upload_and_by_the_worker(tmp_path):
    ep = exported(lambda i, v: aten._sparse_coo_tensor_unsafe.default(i, v, [10]).to_dense(),
                  torch.tensor([[1, 2]]), torch.ones(2))
    path = tmp_path / "sparse.pt2"
    torch.export.save(ep, str(path))
    with pytest.raises(UnsafeArchive) as upload:  # the API's check, no torch
        inspect_archive(str(path))
    assert "calls torch.ops.aten._sparse_coo_tensor_unsafe.default, which builds a sparse tensor from indices " \
           "nothing validates (eager code then writes where they point); aotc compiles no sparse tensors" \
           in upload.value.message
    with pytest.raises(BadModel) as worker:
        bound_program(ep)
    assert worker.value.stage == "capture"
    assert "calls aten._sparse_coo_tensor_unsafe.default, which builds a sparse tensor from indices nothing " \
           "validates" in worker.value.message


@pytest.mark.parametrize("op", ["_convert_indices_from_coo_to_csr", "_convert_indices_from_csr_to_coo"])
def test_an_aten_fallback_that_trusts_its_indices_is_refused_at_upload_and_by_the_worker(op, tmp_path):
    """An audit had the first of these checked and signed: indices computed from a float input (zero for every value
    the check drew, the caller's otherwise) made the package write 1,020 int64 values past a 5-element buffer.
    Inductor has no lowering for it, so none of its index asserts apply, and compiler.bounds had no checked form."""
    def f(x: torch.Tensor) -> torch.Tensor:
        rows = torch.where(x > 1000, x, torch.zeros_like(x)).long()
        return getattr(aten, op).default(rows, 4) if op.endswith("csr") else getattr(aten, op).default(
            rows[:5].int(), rows.int())

    ep = exported(f, torch.randn(8))
    assert f"aten.{op}.default" in ops(ep)
    path = tmp_path / "fallback.pt2"
    torch.export.save(ep, str(path))
    with pytest.raises(UnsafeArchive) as upload:
        inspect_archive(str(path))
    assert f"calls torch.ops.aten.{op}.default, which trusts the index values it is given" in upload.value.message
    with pytest.raises(BadModel) as worker:
        bound_program(ep)
    assert f"calls aten.{op}.default, which trusts the index values" in worker.value.message


def test_programs_without_unsafe_ops_are_left_alone():
    ep = exported(lambda x, i: torch.nn.functional.embedding(i, x) + torch.nn.functional.interpolate(
        x[None, None], scale_factor=2)[0, 0, :4, :4].sum(), torch.randn(16, 4), torch.zeros(4, dtype=torch.long))
    before = ep.graph_module.code
    assert bound_program(ep, negative_ids=False).facts() == {"rewritten": 0, "ops": {}, "nodes": []}
    assert ep.graph_module.code == before


def test_a_decomposed_upsample_keeps_working_through_the_rewrite():
    """What a user's own run_decompositions leaves for upsample_nearest: _unsafe_index over computed indices. The
    rewrite keeps its values, and the re-export (what the compile sees) holds only checked indexing."""
    from torch._decomp import get_decompositions

    class Up(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.interpolate(x, scale_factor=2, mode="nearest")

    x = torch.randn(2, 3, 5, 7)
    table = get_decompositions([aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default])
    ep = torch.export.export(Up(), (x,)).run_decompositions(table)
    assert "aten._unsafe_index.Tensor" in ops(ep)
    assert bound_program(ep).facts()["ops"] == {"aten._unsafe_index.Tensor": 1}
    bounded = ep.module()
    assert torch.equal(bounded(x), Up()(x))
    again = torch.export.export(bounded, (x,))
    assert "aten.index.Tensor" in ops(again) and not any("_unsafe" in op for op in ops(again))


def test_where_the_lowering_wraps_negative_ids_embedding_moves_them_out_of_range():
    """torch 2.11's Inductor reads row 9 of a 10-row table for id -1, where eager raises IndexError (DistilBERT's
    package returned there on an H100 and failed the adversarial check; compiler.compat.INDUCTOR_WRAPS_NEGATIVE_IDS).
    The rewrite moves a negative id one past the table, where the forced index assert fires: every id eager takes
    reads the same row, every id eager refuses is still refused, and the re-export holds the move."""
    w, ids = torch.randn(10, 4), torch.tensor([0, 9, 3])
    ep = exported(lambda w, i: torch.nn.functional.embedding(i, w), w, ids)
    original = ep.module()
    report = bound_program(ep, negative_ids=True)
    assert report.facts()["ops"] == {"aten.embedding.default": 1}
    bounded = ep.module()
    for i in ([0, 9, 3], [-1, 0, 0], [-10, 1, 2], [10, 0, 0], [-11, 0, 0], [2**62, 0, 0]):
        assert same(outcome(bounded, w, torch.tensor(i)), outcome(original, w, torch.tensor(i))), i
    again = torch.export.export(bounded, (w, ids))
    moved = next(n for n in again.graph.nodes if n.target is aten.masked_fill.Scalar)
    lookup = next(n for n in again.graph.nodes if n.target is aten.embedding.default)
    assert lookup.args[1] is moved and moved.args[2] == 10


def test_where_inductor_wraps_negative_ids_a_class_target_below_zero_is_moved_out_of_range():
    """The same for a loss's class target (torch 2.11: every classifier's train step returned at label -1, the
    gather of nll_loss's decomposition wrapping it to the last class): eager's answer is kept for every target,
    ignore_index included, and a probability target is left alone."""
    x, target = torch.randn(4, 3), torch.tensor([0, 2, 1, -100])
    ep = exported(lambda x, t: torch.nn.functional.cross_entropy(x, t), x, target)
    original = ep.module()
    assert bound_program(ep, negative_ids=True).facts()["ops"] == {"aten.cross_entropy_loss.default": 1}
    bounded = ep.module()
    for t in ([0, 2, 1, -100], [0, -1, 1, 2], [3, 0, 0, 0], [-3, 0, 0, 0], [-101, 0, 0, 0]):
        assert same(outcome(bounded, x, torch.tensor(t)), outcome(original, x, torch.tensor(t))), t
    soft = exported(lambda x, t: torch.nn.functional.cross_entropy(x, t), x, torch.softmax(torch.randn(4, 3), 1))
    probs = torch.softmax(torch.randn(4, 3), 1)
    before = soft.module()(x, probs)
    bound_program(soft, negative_ids=True)
    assert torch.equal(soft.module()(x, probs), before)
