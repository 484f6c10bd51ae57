"""No compiled memory access without a bound: ops that skip bounds checks, rewritten before any stage sees them.

torch has ops whose point is to skip a check: `aten._unsafe_index` is `aten.index` without the bounds check, and
Inductor compiles it with none (torch/_inductor/lowering.py: `index_impl(..., check=False)`), while eager raises.
An upload that calls one directly gets a package that reads or writes wherever an index points. The program is
rewritten on the worker, in place, right after loading (compiler.stages.capture), so the re-export, every stage and
the package see only the checked forms; the artifact check compares the package with the program as uploaded.

    uploaded                                          compiled as
    _unsafe_index(x, idx)                             index(x, idx)
    _unsafe_index_put(x, idx, v, acc)                 index_put(x, idx, v, acc)
    _unsafe_masked_index(x, m, idx, fill)             index(x, clamp(idx, -n, n-1)).masked_fill(~m, fill): ATen's
                                                      own eager definition; Inductor's lowering clamps nothing
    _unsafe_masked_index_put_accumulate(x, m, idx, v) index_put(x, clamp(idx, -n, n-1), v.masked_fill(~m, 0), True)
    _index_put_impl(_)(..., unsafe=True)              the same with unsafe=False
    max_unpool2d/3d(x, idx, size, ...)                zeros.scatter(-1, idx.flatten(-d), x.flatten(-d)): Inductor's
                                                      decomposition indexes one buffer for all planes, so its
                                                      asserts bound an index by the batch, not by its plane, and
                                                      -1 lands in the previous plane where eager raises
    embedding(w, ids, ...)                            embedding(w, ids.masked_fill(ids < 0, w.size(0)), ...), and
    cross_entropy_loss / nll_loss(x, target, ...)     the same with a class target < 0 other than ignore_index moved
                                                      to the class count, on a torch whose Inductor wraps a negative
                                                      id where eager raises (compiler.compat.
                                                      INDUCTOR_WRAPS_NEGATIVE_IDS): the forced index assert fires
    segment_reduce(..., unsafe=True)                  the same with unsafe=False (the kernel then checks its lengths)
    select(x, dim, i), i from the data (.item())      select after a run-time assert that -n <= i < n: Inductor
                                                      lowers select to a view at whatever i is (narrow asserts)
    as_strided(x, size, stride, offset)               on a copy of x, after torch._check of offset >= 0, strides >= 0
    (and as_strided_, as_strided_copy,                and offset + sum((size-1)*stride) < numel: Inductor lowers
     as_strided_scatter)                              as_strided to a view of the buffer with no check at all, and a
                                                      symbolic offset can be in bounds at the checked shapes and
                                                      far outside at others (the check becomes a run-time assert)

Refused (`BadModel`, final), having no checked form aotc compiles: the `_sparse_*_unsafe` constructors (a sparse
tensor whose indices nothing validates; eager `to_dense` then writes where they point), the `out=` overloads of
the ops above (export never writes them), and ATen kernels that index with values they never check, which Inductor
runs as fallbacks (compiler.archive.ops.UNBOUNDED lists them with the reason).

Inductor's own decompositions (masked_scatter's `_unsafe_masked_index`, col2im, embedding_dense_backward, ...) are
bounded by the index asserts every compile forces (compiler.options.FORCED_INDUCTOR_CONFIGS), not here.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import torch

from compiler.archive.ops import UNBOUNDED
from compiler.compat import INDUCTOR_WRAPS_NEGATIVE_IDS
from compiler.errors import BadModel
from compiler.ranges import CHECKED, CHECKED_ON_CUDA, range_checked

aten = torch.ops.aten
# Pasted by Inductor into generated C++ and Triton (`device_assert_async`): plain text, no quotes.
EXTENT_MESSAGE = "as_strided: the view reaches outside its tensor (negative offset or stride, or past the end)"


def _clamped(x: torch.Tensor, indices: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each index clamped into its dim, negatives kept (they wrap), as ATen's eager `_unsafe_masked_index*` do."""
    return [None if i is None else i.clamp(-x.size(d), x.size(d) - 1) for d, i in enumerate(indices)]


def checked_masked_index(x: torch.Tensor, mask: torch.Tensor, indices: list[torch.Tensor | None],
                         fill: Any) -> torch.Tensor:
    return aten.index.Tensor(x, _clamped(x, indices)).masked_fill(~mask, fill)


def checked_masked_index_put_accumulate(x: torch.Tensor, mask: torch.Tensor, indices: list[torch.Tensor | None],
                                        values: torch.Tensor) -> torch.Tensor:
    return aten.index_put.default(x, _clamped(x, indices), values.masked_fill(~mask, 0), True)


def checked_max_unpool(x: torch.Tensor, indices: torch.Tensor, output_size: Sequence[int],
                       *_stride_padding: Any) -> torch.Tensor:
    """max_unpool2d/3d as a scatter into each plane: an index outside its plane raises, as in eager."""
    d = len(output_size)
    torch._check(indices.shape == x.shape,
                 lambda: f"max_unpool: indices have shape {tuple(indices.shape)}, the input {tuple(x.shape)}")
    flat = x.flatten(-d)
    plane = reduce(operator.mul, output_size, 1)
    out = flat.new_zeros((*flat.shape[:-1], plane)).scatter(-1, indices.flatten(-d), flat)
    return out.view(*flat.shape[:-1], *output_size)


def checked_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                      scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    """A negative id becomes one past the last row: out of range, where eager raises IndexError and the package's
    index assert fires. Every id eager accepts is unchanged."""
    safe = indices.masked_fill(indices < 0, weight.size(0))
    return aten.embedding.default(weight, safe, padding_idx, scale_grad_by_freq, sparse)


def _checked_class_target(op: Any) -> Callable[..., Any]:
    """`op(input, target, weight, reduction, ignore_index, ...)` with an integer class target below 0 (other than
    ignore_index) moved to the class count: out of range, where eager raises IndexError and the package's index
    assert fires. A probability target (floating) is left as it is."""
    def checked(x: torch.Tensor, target: torch.Tensor, *rest: Any, **kwargs: Any) -> torch.Tensor:
        if target.is_floating_point():
            return op(x, target, *rest, **kwargs)
        ignore = rest[2] if len(rest) > 2 else kwargs.get("ignore_index", -100)
        classes = x.size(1) if x.dim() > 1 else x.size(0)
        return op(x, target.masked_fill((target < 0) & (target != ignore), classes), *rest, **kwargs)

    checked.__name__ = checked.__qualname__ = f"checked_{str(op).split('.')[1]}"
    return checked


def _check_extent(x: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], offset: Any) -> None:
    """Raise unless the view lies inside x (`_check_nonnegative`: now, or when the package runs)."""
    last = offset
    for n, s in zip(size, stride, strict=True):
        last = last + (torch.sym_max(n, 1) - 1) * s
    # Every one of these must be >= 0: the offset, each stride, and the room left after the last element.
    _check_nonnegative(reduce(torch.sym_min, [offset, *stride, x.numel() - 1 - last]), EXTENT_MESSAGE)


def _check_nonnegative(margin: Any, message: str) -> None:
    """Raise unless margin >= 0: now, when it is known, else when the package runs. A symbolic margin becomes a
    run-time assert on a scalar tensor (`_assert_async`), not a torch._check: on a dim the request made dynamic,
    torch._check would be a guard, and export refuses a guard that narrows the range."""
    if isinstance(margin, int):
        torch._check(margin >= 0, lambda: message)
    else:
        # On the CPU, also for a CUDA program: a throw in the wrapper, not a device assert that ends the context.
        torch._assert_async(torch.scalar_tensor(margin, dtype=torch.int64, device="cpu") >= 0, message)


def checked_as_strided(x: torch.Tensor, size: Sequence[Any], stride: Sequence[Any],
                       storage_offset: Any = None) -> torch.Tensor:
    # A copy: Inductor lowers as_strided to a view of the buffer under x, which for an expanded or sliced x is not
    # x's elements. For a whole contiguous tensor (what export hands as_strided) the copy means the same.
    base = x.contiguous().clone()
    offset = 0 if storage_offset is None else storage_offset
    _check_extent(base, size, stride, offset)
    return aten.as_strided.default(base, size, stride, offset)


def checked_as_strided_copy(x: torch.Tensor, size: Sequence[Any], stride: Sequence[Any],
                            storage_offset: Any = None) -> torch.Tensor:
    return checked_as_strided(x, size, stride, storage_offset).clone()


def checked_as_strided_scatter(x: torch.Tensor, src: torch.Tensor, size: Sequence[Any], stride: Sequence[Any],
                               storage_offset: Any = None) -> torch.Tensor:
    # Inductor writes into a fresh clone of x (lowering.py as_strided_scatter), so x's own extent is the bound.
    offset = 0 if storage_offset is None else storage_offset
    _check_extent(x, size, stride, offset)
    return aten.as_strided_scatter.default(x.contiguous(), src, size, stride, offset)


SELECT_MESSAGE = "select: the index lies outside its dim (checked before the view)"


def checked_select(x: torch.Tensor, dim: int, index: Any) -> torch.Tensor:
    """select at an index computed from the data: Inductor makes the view wherever it points, with no bound, where
    eager raises. The bound is checked as as_strided's extent is (`_check_nonnegative`)."""
    n = x.size(dim)
    _check_nonnegative(torch.sym_min(index + n, n - 1 - index), SELECT_MESSAGE)  # >= 0 exactly when -n <= i < n
    return aten.select.int(x, dim, index)


def _safe(target: Any) -> Callable[..., Any]:
    """`target` with its `unsafe` flag False: the fifth positional argument (_index_put_impl), else the keyword
    (segment_reduce's is keyword-only)."""
    def checked(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            return target(*args[:4], False, *args[5:], **kwargs)
        return target(*args, **{**kwargs, "unsafe": False})

    checked.__name__ = checked.__qualname__ = f"checked{target.__name__.split('.')[0]}"
    return checked


@dataclass(frozen=True)
class Rule:
    into: Any  # an OpOverload, or a function of aten ops that the re-export traces
    becomes: str  # what the report says it became
    when: Callable[[torch.fx.Node], bool] | None = None  # only the nodes it holds for (None: every one)


def _unsafe_segments(node: torch.fx.Node) -> bool:
    return bool(node.kwargs.get("unsafe", False))  # kwarg-only in its schema


def _symbolic_index(node: torch.fx.Node) -> bool:
    """select's index is a value of the graph (an unbacked .item() or a shape expression), not a constant."""
    index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
    return isinstance(index, torch.fx.Node)


def _rules(negative_ids: bool) -> dict[str, Rule]:
    index_put_impl = _safe(aten._index_put_impl.default)
    index_put_impl_ = _safe(aten._index_put_impl_.default)
    extra: dict[str, Rule] = {}
    if negative_ids:
        extra["aten.embedding.default"] = Rule(checked_embedding, "aten.embedding.default of the ids, negative ones "
                                               "moved out of range")
        for op in (aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss2d.default,
                   aten.nll_loss_nd.default):
            extra[str(op)] = Rule(_checked_class_target(op), f"{op} of the target, negative classes moved out "
                                  "of range")
    return {**extra,
        "aten._unsafe_index.Tensor": Rule(aten.index.Tensor, "aten.index.Tensor"),
        "aten._unsafe_index.Tensor_hacked_twin": Rule(aten.index.Tensor_hacked_twin, "aten.index.Tensor_hacked_twin"),
        "aten._unsafe_index_put.default": Rule(aten.index_put.default, "aten.index_put.default"),
        "aten._unsafe_index_put.hacked_twin": Rule(aten.index_put.hacked_twin, "aten.index_put.hacked_twin"),
        "aten._unsafe_masked_index.default": Rule(
            checked_masked_index, "aten.index.Tensor of the clamped indices, masked_fill"),
        "aten._unsafe_masked_index_put_accumulate.default": Rule(
            checked_masked_index_put_accumulate, "aten.index_put.default (accumulate) of the clamped indices"),
        "aten._index_put_impl.default": Rule(index_put_impl, "aten._index_put_impl.default with unsafe=False"),
        "aten._index_put_impl_.default": Rule(index_put_impl_, "aten._index_put_impl_.default with unsafe=False"),
        "aten._index_put_impl_.hacked_twin": Rule(index_put_impl_, "aten._index_put_impl_.default with unsafe=False"),
        "aten.max_unpool2d.default": Rule(checked_max_unpool, "aten.scatter.src into each plane"),
        "aten.max_unpool3d.default": Rule(checked_max_unpool, "aten.scatter.src into each plane"),
        "aten.segment_reduce.default": Rule(_safe(aten.segment_reduce.default),
                                            "aten.segment_reduce.default with unsafe=False",
                                            when=_unsafe_segments),
        "aten.select.int": Rule(checked_select, "aten.select.int after a run-time bound on its index",
                                when=_symbolic_index),
        "aten.as_strided.default": Rule(checked_as_strided, "aten.as_strided.default of a copy, extent checked"),
        "aten.as_strided_.default": Rule(checked_as_strided, "aten.as_strided.default of a copy, extent checked"),
        "aten.as_strided_copy.default": Rule(
            checked_as_strided_copy, "aten.as_strided.default of a copy, extent checked"),
        "aten.as_strided_scatter.default": Rule(
            checked_as_strided_scatter, "aten.as_strided_scatter.default, extent checked"),
    }


# Refused at upload too (compiler.archive.ops, torch-free): serialized names there, OpOverload names here.
REFUSED: dict[str, str] = {k.removeprefix("torch.ops."): why for k, why in UNBOUNDED.items()}


@dataclass
class BoundsReport:
    rewritten: list[dict[str, str]] = field(default_factory=list)  # {"node", "op", "became"}
    range_checked: list[dict[str, str]] = field(default_factory=list)  # {"node", "op"}: compiler.ranges

    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"rewritten": len(self.rewritten),
                                 "ops": dict(Counter(r["op"] for r in self.rewritten)),
                                 "nodes": self.rewritten[:200]}
        if self.range_checked:
            facts["range_checked"] = {"count": len(self.range_checked),
                                      "ops": dict(Counter(r["op"] for r in self.range_checked)),
                                      "nodes": [r["node"] for r in self.range_checked[:200]]}
        return facts


def op_key(target: Any) -> str | None:
    """'aten.<op>.<overload>' for an ATen OpOverload, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return None


def bound_program(ep: torch.export.ExportedProgram, negative_ids: bool | None = None,
                  device: str | None = None, eager_gaps: bool = False) -> BoundsReport:
    """Rewrite every op of `ep` that skips a bounds check (in every graph: higher-order ops' subgraphs too) to its
    checked form, in place; raise BadModel for one that has none. `negative_ids`: also move negative ids out of
    range before embedding and class-target losses (None: where this torch's Inductor wraps them). `device`, the
    target's: on a CPU, each op that indexes with a tensor also checks the whole index first, so an out-of-range
    index raises in the package's wrapper, not in a parallel kernel that ends the process (compiler.ranges).
    `eager_gaps`: whatever `device`, only the index tensors no kernel bounds (Span.on_cuda: embedding_bag's middle
    offsets, which eager ATen reads unchecked on a CPU too), so that the program can run eagerly on hostile inputs
    (the adversarial check's oracle) and raise where it would read out of bounds, eager's own errors kept
    elsewhere."""
    rules = _rules(INDUCTOR_WRAPS_NEGATIVE_IDS if negative_ids is None else negative_ids)
    kind = torch.device(device).type if device is not None else None
    ranges: Collection[str] = (CHECKED_ON_CUDA if eager_gaps or kind == "cuda" else CHECKED if kind == "cpu"
                               else ())
    report = BoundsReport()
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            key = op_key(node.target)
            if key is None:
                continue
            if key in REFUSED:
                raise BadModel(f"node {node.name} calls {key}, which {REFUSED[key]}", stage="capture")
            op = node.target
            rule = rules.get(key)
            if rule is not None and (rule.when is None or rule.when(node)):
                node.target = rule.into
                report.rewritten.append({"node": node.name, "op": key, "became": rule.becomes})
                changed = True
            if key in ranges:
                node.target = range_checked(key, op, node.target, cuda=kind == "cuda" or eager_gaps)
                report.range_checked.append({"node": node.name, "op": key})
                changed = True
        if changed:
            gm.recompile()
    return report

