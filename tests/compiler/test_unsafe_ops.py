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


def refused_at_upload_and_by_the_worker(ep: torch.export.ExportedProgram, op: str, why: str, tmp_path: Any) -> None:
    """`ep` calls `op` ('aten.<op>.<overload>'): the API's check (no torch) refuses its archive and the worker's
    rewrite refuses the program, each naming the op and saying `why`."""
    assert op in ops(ep)
    path = tmp_path / "refused.pt2"
    torch.export.save(ep, str(path))
    with pytest.raises(UnsafeArchive) as upload:
        inspect_archive(str(path))
    assert f"calls torch.ops.{op}, which {why}" in upload.value.message
    with pytest.raises(BadModel) as worker:
        bound_program(ep)
    assert worker.value.stage == "capture" and f"calls {op}, which {why}" in worker.value.message


@pytest.mark.parametrize("op", ["_convert_indices_from_coo_to_csr", "_convert_indices_from_csr_to_coo"])
def test_an_aten_fallback_that_trusts_its_indices_is_refused_at_upload_and_by_the_worker(op, tmp_path):
    """An audit had the first of these checked and signed: indices computed from a float input (zero for every value
    the check drew, the caller's otherwise) made the package write 1,020 int64 values past a 5-element buffer.
    Inductor has no lowering for it, so none of its index asserts apply, and compiler.bounds had no checked form."""
    def f(x: torch.Tensor) -> torch.Tensor:
        rows = torch.where(x > 1000, x, torch.zeros_like(x)).long()
        return getattr(aten, op).default(rows, 4) if op.endswith("csr") else getattr(aten, op).default(
            rows[:5].int(), rows.int())

    refused_at_upload_and_by_the_worker(exported(f, torch.randn(8)), f"aten.{op}.default",
                                        "trusts the index values it is given", tmp_path)


def _from_float(x: torch.Tensor) -> torch.Tensor:
    """Indices an attacker hides from the check: zero at every value the check draws, the caller's value past 1000."""
    return torch.where(x > 1000, x, torch.zeros_like(x)).long()


_pool_in, _pool_ind = torch.nn.functional.adaptive_max_pool2d(torch.randn(1, 1, 4, 4), 2, return_indices=True)
_pool3_in = torch.randn(1, 1, 4, 4, 4)
_, _pool3_ind = torch.nn.functional.max_pool3d(_pool3_in, 2, return_indices=True)
TRUSTING: dict[str, tuple[Any, tuple[torch.Tensor, ...]]] = {
    # 2026-11-30's review: each, compiled and bounds-rewritten for a CPU, ended in SIGSEGV at x = 5e6.
    "adaptive_max_pool2d_backward": (
        lambda x, g: aten.adaptive_max_pool2d_backward(g, _pool_in, _pool_ind + _from_float(x)),
        (torch.randn(1), torch.randn(1, 1, 2, 2))),
    "max_pool3d_with_indices_backward": (
        lambda x, g: aten.max_pool3d_with_indices_backward(g, _pool3_in, [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1],
                                                          False, _pool3_ind + _from_float(x)),
        (torch.randn(1), torch.randn(1, 1, 2, 2, 2))),
    "_embedding_bag_dense_backward": (
        lambda x, g: aten._embedding_bag_dense_backward(g, torch.tensor([1, 2, 3]) + _from_float(x),
                                                        torch.tensor([0, 0, 1]), torch.tensor([2, 1]),
                                                        torch.tensor([0, 0]), 10, False, 0, None),
        (torch.randn(1), torch.randn(2, 3))),
    "_embedding_bag_per_sample_weights_backward": (
        lambda x, g: aten._embedding_bag_per_sample_weights_backward(
            g, torch.randn(10, 3), torch.tensor([1, 2, 3]) + _from_float(x), torch.tensor([0, 2]),
            torch.tensor([0, 0, 1]), 0),
        (torch.randn(1), torch.randn(2, 3))),
}


def test_the_attention_kernels_under_sdpa_with_their_sequence_offsets_are_refused(tmp_path):
    """Variable-length attention's offsets (cum_seq_q/k) index the CUDA kernel's reads, not known to be checked; an
    exported model calls scaled_dot_product_attention, never the kernel under it."""
    q = torch.randn(6, 2, 8)
    ep = exported(lambda q, cs: aten._flash_attention_forward(q, q, q, cs, cs, 4, 4, 0.0, False, False)[0],
                  q, torch.tensor([0, 2, 6], dtype=torch.int32))
    refused_at_upload_and_by_the_worker(ep, "aten._flash_attention_forward.default", "is the attention kernel under "
                                        "scaled_dot_product_attention, which takes sequence offsets", tmp_path)


@pytest.mark.parametrize("op", sorted(TRUSTING))
def test_a_backward_kernel_that_trusts_its_indices_is_refused_at_upload_and_by_the_worker(op, tmp_path):
    """Inductor runs these as fallbacks (no index asserts), and their CPU kernels scatter to or gather from the
    indices they are given unchecked. A forward program never needs them: a train step's backward is derived on the
    worker from the forward program, not uploaded."""
    fn, args = TRUSTING[op]
    refused_at_upload_and_by_the_worker(exported(fn, *args), f"aten.{op}.default",
                                        "trusts the index values it is given", tmp_path)


def test_select_at_an_index_from_the_data_gets_a_runtime_bound():
    """Inductor lowers select to a view at whatever index it is given; one from `.item()` of a float input made the
    compiled package read past its tensor (SIGSEGV) where eager raises."""
    class Select(torch.nn.Module):
        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return t.select(0, _from_float(x).sum().item()) + t.select(0, 2)  # the constant one is left alone

    t = torch.randn(5, 4)
    ep = torch.export.export(Select(), (torch.randn(3), t))
    report = bound_program(ep)
    assert report.facts()["ops"] == {"aten.select.int": 1}
    assert report.rewritten[0]["became"] == "aten.select.int after a run-time bound on its index"
    bounded = ep.module()
    assert torch.equal(bounded(torch.randn(3), t), t[0] + t[2])
    for x in ([1005.0, 0, 0], [5e6, 0, 0], [1e12, 0, 0]):
        with pytest.raises(RuntimeError, match="select: the index lies outside its dim"):
            bounded(torch.tensor(x), t)
    again = torch.export.export(bounded, (torch.randn(3), t))  # as the compile re-exports it: an assert in the graph
    assert "aten._assert_async.msg" in ops(again)


def test_segment_reduce_loses_its_unsafe_flag():
    def f(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return aten.segment_reduce(d, "sum", lengths=torch.tensor([2, 4]) + _from_float(x), unsafe=True)

    d = torch.randn(6)
    ep = exported(f, torch.randn(1), d)
    report = bound_program(ep)
    assert report.facts()["ops"] == {"aten.segment_reduce.default": 1}
    bounded = ep.module()
    assert torch.allclose(bounded(torch.randn(1), d), torch.stack([d[:2].sum(), d[2:].sum()]))
    with pytest.raises(RuntimeError, match="lengths"):  # the kernel's own check, which unsafe=True skipped
        bounded(torch.tensor([5e6]), d)
    safe = exported(lambda d: aten.segment_reduce(d, "sum", lengths=torch.tensor([2, 4])), d)
    assert bound_program(safe).facts()["rewritten"] == 0  # unsafe=False (the default) is left alone


def test_embedding_bag_offsets_are_checked_ascending_into_the_ids_on_a_cpu():
    """ATen checks only the first offset (0) and the last (<= the number of ids); a lower one in between had a
    compiled package read outside the ids (SIGSEGV), and eager's own error quoted a word of its heap."""
    w = torch.randn(10, 3)
    ids = torch.tensor([1, 2, 3, 4])

    def f(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding_bag(ids, w, offsets - _from_float(x) * torch.tensor([0, 1, 0]),
                                                 mode="sum")

    ep = exported(f, torch.randn(1), torch.tensor([0, 2, 3]))
    original = ep.module()
    report = bound_program(ep, device="cpu")
    assert report.facts()["range_checked"]["ops"] == {"aten.embedding_bag.padding_idx": 1}
    bounded = ep.module()
    for offsets in ([0, 2, 3], [0, 0, 4], [0, 4, 4], [0, 1, 2]):
        o = torch.tensor(offsets)
        assert torch.equal(bounded(torch.randn(1), o), original(torch.randn(1), o)), offsets
    for x, offsets in ((5e6, [0, 2, 3]), (0.0, [0, 3, 2]), (0.0, [0, 2, 5])):
        with pytest.raises(RuntimeError, match=r"offsets of aten.embedding_bag.padding_idx \(ascending, into the ids\)"
                                               r" must lie in 0..4, each no less than the one before"):
            bounded(torch.tensor([x]), torch.tensor(offsets))


def test_a_cuda_target_checks_only_the_embedding_bag_offsets_no_kernel_assert_bounds():
    """On CUDA the kernels' own asserts bound ids and indices (a device-side assert), so only embedding_bag's
    offsets, which nothing bounds there, get the check (a tl.device_assert on the device; run here on a CPU copy,
    its host form)."""
    w = torch.randn(10, 3)

    def f(ids: torch.Tensor, offsets: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.nn.functional.embedding_bag(ids, w, offsets, mode="sum"), torch.gather(w, 0, i)

    args = (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 3]), torch.zeros(2, 3, dtype=torch.long))
    on_cpu, on_cuda = exported(f, *args), exported(f, *args)
    assert set(bound_program(on_cpu, device="cpu").facts()["range_checked"]["ops"]) == {
        "aten.embedding_bag.padding_idx", "aten.gather.default"}
    assert bound_program(on_cuda, device="cuda:0").facts()["range_checked"]["ops"] == {
        "aten.embedding_bag.padding_idx": 1}
    bounded = on_cuda.module()
    assert torch.equal(bounded(*args)[0], f(*args)[0])
    with pytest.raises(RuntimeError, match=r"offsets of aten.embedding_bag.padding_idx \(ascending, into the ids\)"):
        bounded(args[0], torch.tensor([0, 3, 2]), args[2])
    with pytest.raises((IndexError, RuntimeError)) as raised:  # the ids: the kernel's own check, not ours
        bounded(torch.tensor([1, 2, 3, 40]), args[1], args[2])
    assert "checked before the kernel" not in str(raised.value)


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
