"""The callables an uploaded program may name: a list of real operators, and what each higher-order op calls.

torch's deserializer resolves a node's target, and an operator-valued argument (`as_operator`), by a chain of
getattr calls under `torch`, `_operator` or `math`, so anything reachable that way would otherwise be accepted as
"an operator". ops.txt (next to this module) lists what a real exported program calls: every ATen and prims
overload, the higher-order operators in `HOPS`, and the Python callables of symbolic arithmetic.
tests/compiler/archive/make_ops.py generates it from torch, as a union over the torch versions the service runs.

A higher-order op calls some of its arguments. Each one in `HOPS` takes its callables as subgraphs (`as_graph`) at
fixed positions, and the upload checks (compiler.archive.program) and the worker's walk of the loaded graph
(compiler.loading) hold every such position to a subgraph, walked with the same rules, and refuse a subgraph
anywhere else. No allowed op takes an operator as a value, so an `as_operator` argument is refused wherever it
appears. Left out on purpose, so refused as node targets and as values alike: `print` (its format string walks
attributes, up to a function's `__globals__`), `triton_kernel_wrapper_*` and `inline_asm_elementwise` (code the
upload brings), `run_const_graph`, `executorch_call_delegate`, `call_torchbind`, `with_effects`,
`auto_functionalized(_v2)` (they wrap only custom ops, never ATen's, and custom ops are not on the list),
`flex_attention` (torch cannot serialize its block mask), and every other higher-order op.

`UNBOUNDED` lists operators that are real but skip a bounds check with no checked form aotc compiles; they are
refused at upload, and by the worker (compiler.bounds, which rewrites the ones that have a checked form).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

OPS_TXT = Path(__file__).with_name("ops.txt")
HOP_PREFIX = "torch.ops.higher_order."


@dataclass(frozen=True)
class Hop:
    """A higher-order op: the positional arguments it calls (each must be a subgraph), and its signature for
    messages. Positions are counted over the node's positional inputs, as torch's deserializer counts them."""

    graphs: tuple[int, ...]
    signature: str


# The same positions in torch 2.11 and 2.13 (torch/_higher_order_ops/: cond.py, while_loop.py, map.py, scan.py,
# associative_scan.py, wrap.py, invoke_subgraph.py).
HOPS: dict[str, Hop] = {
    HOP_PREFIX + "cond": Hop((1, 2), "cond(pred, true_fn, false_fn, operands)"),
    HOP_PREFIX + "while_loop": Hop((0, 1), "while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)"),
    HOP_PREFIX + "map_impl": Hop((0,), "map_impl(f, xs, pos_args)"),
    HOP_PREFIX + "scan": Hop((0,), "scan(combine_fn, init, xs, additional_inputs)"),
    HOP_PREFIX + "associative_scan": Hop((0,), "associative_scan(combine_fn, xs, additional_inputs)"),
    HOP_PREFIX + "wrap_with_set_grad_enabled": Hop((1,), "wrap_with_set_grad_enabled(enable, fn, *args)"),
    HOP_PREFIX + "wrap_with_autocast": Hop(
        (4,), "wrap_with_autocast(device_type, dtype, enabled, cache_enabled, fn, *args)"),
    HOP_PREFIX + "invoke_subgraph": Hop((0,), "invoke_subgraph(subgraph, identifier, *operands)"),
}


_SPARSE_UNSAFE = "builds a sparse tensor from indices nothing validates (eager code then writes where they point); " \
    "aotc compiles no sparse tensors"
_OUT_FORM = "is the out= form of an op that aotc compiles only in its checked functional form; export never writes it"
UNBOUNDED: dict[str, str] = {
    **{f"torch.ops.aten._sparse_{k}_tensor_unsafe.default": _SPARSE_UNSAFE
       for k in ("coo", "csr", "csc", "bsr", "bsc", "compressed")},
    **{f"torch.ops.aten.{op}.out": _OUT_FORM
       for op in ("max_unpool2d", "max_unpool3d", "as_strided_copy", "as_strided_scatter", "_index_put_impl")},
}


def unbounded(target: str) -> str | None:
    """Why `target` is refused for skipping a bounds check, if it is."""
    return UNBOUNDED.get(target)


@lru_cache(maxsize=1)
def known_targets() -> frozenset[str]:
    return frozenset(line for line in OPS_TXT.read_text().splitlines() if line and not line.startswith("#"))


def is_operator_target(target: str) -> bool:
    return target in known_targets()


def hop(target: str) -> Hop | None:
    """The higher-order op `target` names, if it is one the service compiles."""
    return HOPS.get(target) if target in known_targets() else None
