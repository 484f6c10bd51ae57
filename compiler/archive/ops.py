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

`EXCLUDED` lists the ATen operators left off ops.txt because they act outside the tensors they are given (a file, a
stream, process-wide state, the autograd engine) and no model's exported graph calls them. make_ops.py never writes
them; `known_targets` drops them even if a list did hold them; and each refusal, at upload (compiler.archive.program)
and in the worker (compiler.loading), names the operator and the reason here. Left on: queries that only read such
state (`_cufft_get_plan_cache_size`, `_fused_sdp_choice`, `_nnpack_available`), which change nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
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
# ATen kernels that index with the values of an integer tensor they never check, which Inductor runs as fallbacks
# (no lowering, so none of its index asserts) and compiler.bounds has no checked form for. Found by an audit that
# had a checked, signed package write 1,020 int64 values past a 5-element buffer through the first one, from a
# float input the check's samples never pushed out of range; the others crash or read out of bounds in eager.
_TRUSTS_INDICES = ("trusts the index values it is given (an ATen kernel that checks none, which the compiled "
                   "package calls as is: a caller's out-of-range value reads or writes outside its buffers)")
_FILLS_BUFFERS = ("writes into the output buffers it is given, whatever their size (cummax's internal helper; a "
                  "program calls cummax or cummin)")
_SPARSE_UNCHECKED = ("builds a sparse tensor from indices it does not validate by default (check_invariants off); "
                     "aotc compiles no sparse tensors")
_VARLEN = ("is the attention kernel under scaled_dot_product_attention, which takes sequence offsets or a block "
           "table (variable-length or paged attention) that its CUDA kernel indexes with, not known to be checked; "
           "an exported model calls scaled_dot_product_attention")
UNBOUNDED: dict[str, str] = {
    **{f"torch.ops.aten._sparse_{k}_tensor_unsafe.default": _SPARSE_UNSAFE
       for k in ("coo", "csr", "csc", "bsr", "bsc", "compressed")},
    **{f"torch.ops.aten.{op}": _TRUSTS_INDICES
       for op in ("_convert_indices_from_coo_to_csr.default", "_convert_indices_from_coo_to_csr.out",
                  "_convert_indices_from_csr_to_coo.default", "_convert_indices_from_csr_to_coo.out",
                  "_segment_reduce_backward.default", "_segment_reduce_backward.out",
                  "_ctc_loss.default", "_ctc_loss.Tensor", "_ctc_loss.out", "_ctc_loss.Tensor_out",
                  "_ctc_loss_backward.default", "_ctc_loss_backward.Tensor", "_ctc_loss_backward.out",
                  "_cudnn_ctc_loss.default", "_cudnn_ctc_loss.Tensor", "_cudnn_ctc_loss.out")},
    # 2026-11-30, a review of every listed overload whose tensor arguments are indices, offsets or lengths: the
    # backward kernels below scatter to (or gather from) the indices they are given with no check, and Inductor runs
    # them as fallbacks. Each made a compiled, bounds-rewritten CPU package end in SIGSEGV at a hostile input. A
    # forward program never needs them (a train step's backward is derived on the worker, not uploaded).
    **{f"torch.ops.aten.{op}": _TRUSTS_INDICES
       for op in ("adaptive_max_pool2d_backward.default", "adaptive_max_pool2d_backward.grad_input",
                  "adaptive_max_pool3d_backward.default", "adaptive_max_pool3d_backward.grad_input",
                  "max_pool3d_with_indices_backward.default", "max_pool3d_with_indices_backward.grad_input",
                  "_embedding_bag_backward.default",
                  "_embedding_bag_dense_backward.default", "_embedding_bag_dense_backward.out",
                  "_embedding_bag_per_sample_weights_backward.default",
                  "_embedding_bag_per_sample_weights_backward.out")},
    **{f"torch.ops.aten.{op}": _FILLS_BUFFERS for op in ("_cummax_helper.default", "_cummin_helper.default")},
    **{f"torch.ops.aten.{op}": _VARLEN
       for op in ("_flash_attention_forward.default", "_flash_attention_forward.quantized",
                  "_flash_attention_forward_no_dropout_inplace.default", "_flash_attention_backward.default",
                  "_efficient_attention_forward.default", "_efficient_attention_backward.default")},
    **{f"torch.ops.aten.{op}": _SPARSE_UNCHECKED
       for op in ("sparse_coo_tensor.indices", "sparse_coo_tensor.indices_size",
                  "_sparse_coo_tensor_with_dims_and_tensors.default",
                  "_sparse_coo_tensor_with_dims_and_tensors.out")},
    **{f"torch.ops.aten.{op}.out": _OUT_FORM
       for op in ("max_unpool2d", "max_unpool3d", "as_strided_copy", "as_strided_scatter", "_index_put_impl",
                  "segment_reduce")},
}


# What each excluded operator does that no model needs: pattern (fnmatch, over the target as the serializer writes
# it) -> the rest of the sentence "node n calls <target>, which ...".
_READS_A_FILE = ("reads the file its string argument names from the disk of whatever machine runs the program (a "
                 "served model could return that machine's secrets as its output)")
_PRINTS = "writes its string argument to the standard output of whatever process runs the program"
_CUFFT_CACHE = "changes the cuFFT plan cache of a whole device, which every model in the process shares"
_DIST_AUTOGRAD = "reads the process's distributed-autograd context, not its arguments"
_AUTOGRAD_ENGINE = ("runs the autograd engine over whatever graph its tensor came from and writes other tensors' "
                    ".grad (an exported program spells its backward out as operators)")
_ALLOCATOR = ("marks a tensor's memory as used by a CUDA stream in the process-wide caching allocator (an exported "
              "program holds no streams)")
_RAW_STORAGE = "rebinds a tensor to a raw Storage (an exported program holds no Storage values)"
_TEST_ONLY = "exists only for PyTorch's own test suite (one of them, _test_warn_in_autograd, writes a warning)"
EXCLUDED: dict[str, str] = {
    "torch.ops.aten.from_file.*": _READS_A_FILE,
    "torch.ops.aten._print.*": _PRINTS,
    "torch.ops.aten._cufft_set_plan_cache_max_size.*": _CUFFT_CACHE,
    "torch.ops.aten._cufft_clear_plan_cache.*": _CUFFT_CACHE,
    "torch.ops.aten.get_gradients.*": _DIST_AUTOGRAD,
    "torch.ops.aten._backward.*": _AUTOGRAD_ENGINE,
    "torch.ops.aten.record_stream.*": _ALLOCATOR,
    "torch.ops.aten.set_.source_Storage*": _RAW_STORAGE,
    "torch.ops.aten.set.source_Storage*": _RAW_STORAGE,
    "torch.ops.aten._test_*": _TEST_ONLY,
    "torch.ops.aten._foobar.*": _TEST_ONLY,
}


def excluded(target: str) -> str | None:
    """Why `target` is left off the operator list although it is a real operator, if it is."""
    return next((why for pattern, why in EXCLUDED.items() if fnmatchcase(target, pattern)), None)


def unbounded(target: str) -> str | None:
    """Why `target` is refused for skipping a bounds check, if it is."""
    return UNBOUNDED.get(target)


@lru_cache(maxsize=1)
def known_targets() -> frozenset[str]:
    return frozenset(line for line in OPS_TXT.read_text().splitlines()
                     if line and not line.startswith("#") and excluded(line) is None)


def is_operator_target(target: str) -> bool:
    return target in known_targets()


def hop(target: str) -> Hop | None:
    """The higher-order op `target` names, if it is one the service compiles."""
    return HOPS.get(target) if target in known_targets() else None
