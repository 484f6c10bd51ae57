"""CPU packages: an out-of-range index raises an exception the caller can catch, before any kernel reads it.

The index asserts every compile forces (compiler.options.FORCED_INDUCTOR_CONFIGS) keep a package from reading out of
bounds, but on a CPU the assert (`AOTI_TORCH_CHECK` in an Inductor C++ kernel) throws from inside an OpenMP
parallel region when the kernel runs in parallel: the exception cannot leave the region, and `std::terminate` ends
the process. The process is the consumer's inference server: one request with a token id past the vocabulary, or a
label of -1, took down every model it served, where eager raises an IndexError the server answers with a 400.

So on a CPU target, each op that indexes with a tensor from the graph is preceded, in the rewrite compiler.bounds
applies right after loading, by a check of the whole index tensor against the bounds eager enforces:

    bad   = ((idx < lo) | (idx >= hi)) [& (idx != ignore_index)]
    count = bad.sum().item()                                  -> _local_scalar_dense, in the C++ wrapper
    torch._assert_async(scalar_tensor(count) == 0, MESSAGE)   -> a kernel of one element (no loop, so no OpenMP
                                                                 region) that throws std::runtime_error

The count is read in the wrapper (`.item()`), so the assert's kernel cannot be fused into the parallel reduction
that counts; it throws in the calling thread, AOTInductor's run returns an error code, and the caller sees a
RuntimeError naming the op and the bound. The kernels' own asserts stay, as the backstop for what this misses.

Bounds are eager's (torch 2.13, CPU): index, index_put, index_fill, take, put take -n..n-1 (negatives wrap);
index_select, gather, scatter*, index_add/copy/reduce, embedding, embedding_bag take 0..n-1; a class target takes
0..C-1 or ignore_index; max_unpool's indices 0..plane-1. Not on CUDA, where the kernels' own asserts bound these
(device-side asserts: they end the context, but nothing is read), and reading the count would cost a device sync
per index tensor per call; except embedding_bag's offsets (below), which no kernel bounds there.

Not for train steps (mode=training): AOTAutograd's joint trace cannot carry the data-dependent count, so a train
step keeps the kernel asserts alone (compiler.stages.capture). Not covered (the kernel asserts still bound them,
at the old cost): take_along_dim (eager accepts some indices below -n along a dim), one_hot, and ops whose indices
Inductor computes itself. embedding_bag's offsets are checked (2026-11-30): each in 0..len(ids), ascending; ATen
checks only the first and the last, and no kernel assert bounds them. On a CUDA target too (Span.on_cuda), there as
`_assert_async` of the device's count, which Inductor makes a Triton kernel's tl.device_assert: no sync, and a bad
offset ends the context before the bag kernel reads (tests/gpu/test_gpu_bounds.py, run on an H200 2026-11-30).
The message is ours, pasted into generated C++ (compiler.archive.strings' TEXT grammar: no quotes or backslash):
op names from the table below and integer bounds, never a string from the upload.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch

from compiler.archive.strings import TEXT

aten = torch.ops.aten


@dataclass(frozen=True)
class Span:
    index: torch.Tensor
    lo: Any  # int or SymInt
    hi: Any  # exclusive
    what: str  # "index 0 of aten.index.Tensor (dim 0)": ours
    arg: int  # where the op takes it: args[arg], or args[arg][item]
    item: int | None = None
    allowed: int | None = None  # one more value eager accepts (a loss's ignore_index)
    ascending: bool = False  # each value also no less than the one before it (embedding_bag's offsets)
    on_cuda: bool = False  # checked on CUDA targets too: no kernel assert bounds it there


def _size(x: torch.Tensor, dim: int) -> Any:
    return x.size(dim) if x.dim() > 0 else 1


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % max(x.dim(), 1)


def _integer(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() \
        and t.dtype not in (torch.bool, torch.uint8)


def _list_spans(name: str, x: torch.Tensor, indices: Any) -> Iterator[Span]:
    """aten.index / index_put: index k bounds dim k of x, -n..n-1; a bool (or uint8) mask of m dims takes m dims."""
    d = 0
    for k, i in enumerate(indices):
        if i is None:
            d += 1
        elif isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            d += i.dim()
        elif _integer(i) and d < x.dim():
            n = x.size(d)
            yield Span(i, -n, n, f"index {k} of {name} (dim {d})", 1, k)
            d += 1
        else:
            d += 1


def _leading(name: str, x: torch.Tensor, indices: Any, *_: Any, **__: Any) -> Iterator[Span]:
    return _list_spans(name, x, indices)


def _dim_index(negatives: bool) -> Callable[..., Iterator[Span]]:
    """(x, dim, index, ...): index bounds x's dim, 0..n-1 (or -n..n-1 where eager wraps)."""
    def spans(name: str, x: torch.Tensor, dim: int, index: torch.Tensor, *_: Any, **__: Any) -> Iterator[Span]:
        if _integer(index):
            n = _size(x, _dim(x, dim))
            yield Span(index, -n if negatives else 0, n, f"the index of {name} (dim {_dim(x, dim)})", 2)
    return spans


def _flat(name: str, x: torch.Tensor, index: torch.Tensor, *_: Any, **__: Any) -> Iterator[Span]:
    """take / put: an index into the flattened tensor, -numel..numel-1."""
    if _integer(index):
        yield Span(index, -x.numel(), x.numel(), f"the index of {name} (flattened)", 1)


def _rows(name: str, weight: torch.Tensor, indices: torch.Tensor, *_: Any, **__: Any) -> Iterator[Span]:
    """embedding / embedding_bag: a row of the table, 0..rows-1 (padding_idx changes what is read, not the range)."""
    if _integer(indices):
        yield Span(indices, 0, weight.size(0), f"the ids of {name} (rows of the table)", 1)


def _bags(name: str, weight: torch.Tensor, indices: torch.Tensor, offsets: Any = None, *_: Any,
          **__: Any) -> Iterator[Span]:
    """embedding_bag: the ids as for embedding; and the offsets, where given, each in 0..len(ids) and none below
    the one before it. ATen checks only the first and the last: a lower offset in between had the kernel read
    outside the ids (a compiled package ended in SIGSEGV; eager's error quoted a word of the heap)."""
    yield from _rows(name, weight, indices)
    if _integer(offsets) and _integer(indices) and offsets.dim() == 1:
        yield Span(offsets, 0, indices.numel() + 1, f"the offsets of {name} (ascending, into the ids)", 2,
                   ascending=True, on_cuda=True)


def _class_target(ignore_at: int) -> Callable[..., Iterator[Span]]:
    """(input, target, weight, reduction, ignore_index, ...): a class, 0..C-1, or ignore_index."""
    def spans(name: str, x: torch.Tensor, target: torch.Tensor, *rest: Any, **kwargs: Any) -> Iterator[Span]:
        if not _integer(target):
            return  # a probability target
        ignore = rest[ignore_at] if len(rest) > ignore_at else kwargs.get("ignore_index", -100)
        classes = x.size(1) if x.dim() > 1 else x.size(0)
        yield Span(target, 0, classes, f"the class target of {name}", 1, allowed=int(ignore))
    return spans


def _unpool(name: str, x: torch.Tensor, indices: torch.Tensor, output_size: Any, *_: Any,
            **__: Any) -> Iterator[Span]:
    if _integer(indices):
        yield Span(indices, 0, reduce(operator.mul, output_size, 1), f"the indices of {name} (into each plane)", 1)


def _table() -> dict[str, Callable[..., Iterator[Span]]]:
    table: dict[str, Callable[..., Iterator[Span]]] = {}
    for op in ("index.Tensor", "index.Tensor_hacked_twin", "_unsafe_index.Tensor", "_unsafe_index.Tensor_hacked_twin",
               "index_put.default", "index_put.hacked_twin", "index_put_.default", "index_put_.hacked_twin",
               "_unsafe_index_put.default", "_unsafe_index_put.hacked_twin", "_index_put_impl.default",
               "_index_put_impl_.default", "_index_put_impl_.hacked_twin"):
        table[f"aten.{op}"] = _leading
    for op in ("index_select.default", "gather.default", "scatter.src", "scatter.value", "scatter.reduce",
               "scatter.value_reduce", "scatter_.src", "scatter_.value", "scatter_.reduce", "scatter_.value_reduce",
               "scatter_add.default", "scatter_add_.default", "scatter_reduce.two", "scatter_reduce_.two",
               "index_add.default", "index_add_.default", "index_copy.default", "index_copy_.default",
               "index_reduce.default", "index_reduce_.default"):
        table[f"aten.{op}"] = _dim_index(negatives=False)
    for op in ("index_fill.int_Scalar", "index_fill.int_Tensor", "index_fill_.int_Scalar", "index_fill_.int_Tensor"):
        table[f"aten.{op}"] = _dim_index(negatives=True)
    for op in ("take.default", "put.default", "put_.default"):
        table[f"aten.{op}"] = _flat
    table["aten.embedding.default"] = _rows
    for op in ("embedding_bag.default", "embedding_bag.padding_idx", "_embedding_bag.default",
               "_embedding_bag_forward_only.default"):
        table[f"aten.{op}"] = _bags
    for op in ("nll_loss.default", "nll_loss_nd.default", "nll_loss2d.default", "nll_loss_forward.default",
               "nll_loss2d_forward.default", "cross_entropy_loss.default"):
        table[f"aten.{op}"] = _class_target(ignore_at=2)  # after weight and reduction
    for op in ("max_unpool2d.default", "max_unpool3d.default"):
        table[f"aten.{op}"] = _unpool
    return table


CHECKED = _table()
# The ops with a span no kernel assert bounds on CUDA either (Span.on_cuda): checked on CUDA targets too.
CHECKED_ON_CUDA = frozenset(key for key, spans in CHECKED.items() if spans is _bags)


def _bound(v: Any) -> str:
    return str(v) if isinstance(v, int) else "the dim size"


def message(span: Span) -> str:
    hi = f"{span.hi - 1}" if isinstance(span.hi, int) else "its size less one"
    text = f"index out of bounds: {span.what} must lie in {_bound(span.lo)}..{hi}"
    if span.allowed is not None:
        text += f" or be {span.allowed}"
    if span.ascending:
        text += ", each no less than the one before"
    text += " (checked before the kernel)"
    # Pasted into generated C++: our words and integers only, which the grammar holds.
    assert TEXT.match(text), text
    return text


def check_span(span: Span) -> torch.Tensor:
    """Assert that every index lies in the span, in a kernel of one element; return the index as the op should
    take it: itself when the check passes, and all `lo` (in range) when it fails, so that whichever order Inductor
    runs the kernels in, the op's own kernel never sees a bad index and its assert (in a parallel region, fatal)
    cannot fire before this one, which raises."""
    i = span.index
    bad = (i < span.lo) | (i >= span.hi)
    if span.allowed is not None:
        bad = bad & (i != span.allowed)
    if span.ascending:  # 1-D; with fewer than two values the second part is empty
        bad = torch.cat([bad[:1], bad[1:] | (i[1:] < i[:-1])])
    count = bad.sum()
    if i.device.type == "cpu":
        # Read in the wrapper: the assert cannot land inside the reduction's parallel kernel.
        torch._assert_async(torch.scalar_tensor(count.item(), dtype=torch.int64, device="cpu") == 0, message(span))
    else:
        # On the device, no sync: a Triton kernel's tl.device_assert (compiled with debug, as the index asserts are).
        torch._assert_async(count == 0, message(span))
    return torch.where(count == 0, i, torch.zeros((), dtype=i.dtype, device=i.device) + span.lo)


def _positional(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Every argument that can be positional, as a position (defaults filled in up to the last one given)."""
    named = [a for a in op._schema.arguments if not a.kwarg_only]
    out = list(args)
    rest = dict(kwargs)
    last = max([k for k, a in enumerate(named) if a.name in rest] + [len(out) - 1])
    for k in range(len(out), last + 1):
        a = named[k]
        out.append(rest.pop(a.name) if a.name in rest else a.default_value)
    return out, rest


def range_checked(key: str, op: Any, then: Callable[..., Any], cuda: bool = False) -> Callable[..., Any]:
    """`then` (the op `op`, or the rewrite compiler.bounds gives it) taking each of its index tensors checked; for
    a CUDA target (`cuda`), only those no kernel assert bounds there (Span.on_cuda)."""
    spans = CHECKED[key]

    def checked(*args: Any, **kwargs: Any) -> Any:
        pos, rest = _positional(op, args, kwargs)
        for span in [s for s in spans(key, *pos, **rest) if s.on_cuda or not cuda]:
            safe = check_span(span)
            if span.item is None:
                pos[span.arg] = safe
            else:
                pos[span.arg] = [safe if k == span.item else v for k, v in enumerate(pos[span.arg])]
        return then(*pos, **rest)

    checked.__name__ = checked.__qualname__ = f"range_checked_{key.split('.')[1]}"
    return checked
