"""The serialized program (models/model.json): node targets, every string, every int, the user inputs and weights.

torch/_export/serde/schema.py describes the layout. The walk checks what torch would resolve or evaluate (node
targets by getattr chains, against ops.txt; `expr_str` by sympify), every other string against the grammar of
where it sits (compiler.archive.strings: codegen pastes names and string arguments into C++ and Python source),
and every int against int64. It reads what the API answers with: each user input's name, dtype and shape, a dim
being an int or a symbol or expression with its range; and each weight's view, checked against its file.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from compiler.archive.container import require
from compiler.archive.exprs import Bounds, check_sym_expr, expr_bounds, parse_expr, sym_to_text
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.ops import is_operator_target
from compiler.archive.strings import check, shown
from compiler.errors import Unprocessable, UnsafeArchive
from compiler.shapes import DTYPE_BYTES

UNBOUNDED = 2**62  # torch writes int_oo as null; older writers used sys.maxsize-like sentinels

# torch/_export/serde/schema.py ScalarType -> torch dtype name without "torch.".
SCALAR_TYPES: dict[int, str] = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "complex32",
    10: "complex64",
    11: "complex128",
    12: "bool",
    13: "bfloat16",
    28: "uint16",
    29: "float8_e4m3fn",
    30: "float8_e5m2",
    31: "float8_e4m3fnuz",
    32: "float8_e5m2fnuz",
    33: "float8_e8m0fnu",
    34: "uint32",
    35: "uint64",
}


INT64 = (-(2**63), 2**63 - 1)

# Where a string sits decides its grammar (compiler.archive.strings). Strings under these keys have grammars of
# their own (compiler.archive.exprs), checked where they are read; node metadata is free text, dropped by the
# worker after loading (compiler.loading) and never pasted by it.
_OWN_GRAMMAR = frozenset({"expr_str", "guards_code", "in_spec", "out_spec"})
_TEXT_KEYS = frozenset({"as_string", "as_strings"})
_IDENT_KEYS = frozenset({"name", "as_name", "as_names", "forward_arg_names", "user_input_name", "arg_name"})
_FQN_KEYS = frozenset({"parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "fqn"})
_IDENT_MAPS = frozenset({"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values",
                         "custom_obj_values"})

_Path = tuple[object, ...]  # (parent path, key): rendered only for an error message


def _render(path: _Path | None) -> str:
    keys: list[str] = []
    while path is not None:
        parent, key = path
        keys.append(f"[{key}]" if isinstance(key, int) else f".{shown(key, 40).strip(chr(39))}")
        path = parent  # type: ignore[assignment]
    return "".join(reversed(keys)).lstrip(".")


def _node_target(target: object, where: str, node: str) -> None:
    if not isinstance(target, str) or not is_operator_target(target):
        raise UnsafeArchive(
            f"{where}: node {node} calls {shown(target, 120)}, which is not a torch operator this service "
            "compiles (compiler/archive/ops.txt lists them)", node=node)


def walk_program(doc: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Check the whole serialized program: every node target against the operator list, every `expr_str` against
    the symbolic-expression grammar, every other string (values and keys) against the grammar of where it sits,
    and every integer against int64. Refusals name the node and the argument, or the path to the value."""
    stack: list[tuple[Any, Any, _Path | None, object, object]] = [(doc, "", None, None, None)]
    passed: set[tuple[str, str]] = set()  # (grammar, string) already checked: programs repeat names and keys
    while stack:
        value, key, path, node, arg = stack.pop()
        if isinstance(value, dict):
            if "target" in value and "inputs" in value and "outputs" in value:  # a graph node
                node, arg = value.get("name"), None
                _node_target(value["target"], where, shown(node))
                check(node, "ident", lambda: f"{where}: node {shown(node)} name", limits, node=shown(node))
            elif "name" in value and "arg" in value and node is not None:  # a node's named argument
                arg = value.get("name")
            for k, v in value.items():
                here = (path, k)
                # keys of value maps are names; range_constraints keys are symbols or expressions ('2*s77')
                kind = "ident" if key in _IDENT_MAPS else "text" if key == "range_constraints" else "token"
                if (kind, k) not in passed:
                    check(k, kind, lambda: f"{where}: {_render(here)} key", limits)
                    passed.add((kind, k))
                if k == "expr_str":
                    check_sym_expr(v, where)
                elif k == "metadata" and node is not None and "target" in value:
                    continue
                elif k not in _OWN_GRAMMAR:
                    stack.append((v, k, here, node, arg))
        elif isinstance(value, list):
            stack.extend((v, key, (path, i), node, arg) for i, v in enumerate(value))
        elif isinstance(value, str):
            if key == "target" and node is not None:
                continue  # checked against the operator list above
            # '' fits no identifier but can close nothing: a higher-order op's positional arguments (the grad-mode
            # and autocast regions export makes of `with torch.no_grad()`) have the name ''. A node's own name is
            # checked as an identifier above.
            grammar = ("text" if key in _TEXT_KEYS else "ident" if key in _IDENT_KEYS and value != ""
                       else "fqn" if key in _FQN_KEYS and value != "" else "token")
            if (grammar, value) in passed:
                continue
            try:
                check(value, grammar, _Where(where, path, node, arg), limits)
                passed.add((grammar, value))
            except UnsafeArchive as e:
                if node is not None:
                    e.detail.update(node=shown(node), argument=shown(arg) if arg is not None else "")
                raise
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT64[0] <= value <= INT64[1]:
                raise Unprocessable(f"{where}: {_render(path)} is {value}, which does not fit in int64")


class _Where:
    """Words where a string sits, only when a refusal needs them."""

    def __init__(self, where: str, path: _Path | None, node: object, arg: object) -> None:
        self.where, self.path, self.node, self.arg = where, path, node, arg

    def __call__(self) -> str:
        if self.node is None:
            return f"{self.where}: {_render(self.path)}"
        return (f"{self.where}: node {shown(self.node)}"
                + (f" argument {shown(self.arg)}" if self.arg is not None else "") + " string")


ITEMSIZE = DTYPE_BYTES
_PATH_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")


def check_payload_config(doc: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, dict[str, Any]]:
    """A weights or constants config ({"config": {fqn: payload}}): every name in the FQN grammar (AOTInductor
    writes constant names into its C++ wrapper), plain file names, and the generic string and int checks."""
    config = require(doc, "config", dict, where)
    walk_program(doc, where, limits)
    for fqn, meta in config.items():
        check(fqn, "fqn", f"{where}: name", limits)
        if not isinstance(meta, dict):
            raise Unprocessable(f"{where}: entry {fqn!r} is not an object")
        path_name = meta.get("path_name")
        if not isinstance(path_name, str) or not _PATH_NAME.match(path_name) or path_name in (".", ".."):
            raise Unprocessable(f"{where}: payload path {shown(path_name)} is not a plain file name")
        for flag in ("use_pickle", "is_param"):
            if not isinstance(meta.get(flag, False), bool):
                raise Unprocessable(f"{where}: {flag} of {fqn!r} is not a boolean")
    return config


def _static_ints(values: Any, what: str) -> list[int]:
    if not isinstance(values, list):
        raise Unprocessable(f"{what} is not a list")
    out = []
    for v in values:
        n = v.get("as_int") if isinstance(v, dict) and set(v) == {"as_int"} else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise Unprocessable(f"{what}: {shown(str(v))} is not a non-negative int")
        out.append(n)
    return out


def storage_bytes(what: str, meta: Any) -> tuple[int, int, int]:
    """(itemsize, numel, bytes of storage the view needs) for a serialized tensor meta of static sizes."""
    if not isinstance(meta, dict):
        raise Unprocessable(f"{what} has no tensor metadata")
    dtype = SCALAR_TYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise Unprocessable(f"{what} has dtype {shown(str(meta.get('dtype')))}, which this service does not know")
    sizes = _static_ints(meta.get("sizes"), f"{what} sizes")
    strides = _static_ints(meta.get("strides"), f"{what} strides")
    (offset,) = _static_ints([meta.get("storage_offset")], f"{what} storage_offset")
    if len(sizes) != len(strides):
        raise Unprocessable(f"{what} has {len(sizes)} sizes and {len(strides)} strides")
    numel = 1
    for n in sizes:
        numel *= n
    itemsize = ITEMSIZE[dtype]
    if numel == 0:
        return itemsize, 0, 0
    return itemsize, numel, (offset + sum((n - 1) * st for n, st in zip(sizes, strides)) + 1) * itemsize


def _range(rc: dict[str, Any], key: str) -> Bounds | None:
    r = rc.get(key)
    if not isinstance(r, dict):
        return None
    lo, hi = r.get("min_val"), r.get("max_val")
    lo = lo if isinstance(lo, int) and not isinstance(lo, bool) else None
    hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi < UNBOUNDED else None
    return lo, hi


def _dim(size: Any, rc: dict[str, Any], where: str) -> int | dict[str, Any]:
    if not isinstance(size, dict) or len(size) != 1:
        raise Unprocessable(f"{where}: a size is neither as_int nor as_expr")
    kind, value = next(iter(size.items()))
    if kind == "as_int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise Unprocessable(f"{where}: as_int size is not an integer")
        return value
    if kind != "as_expr" or not isinstance(value, dict):
        raise Unprocessable(f"{where}: unsupported size kind {kind!r}")
    text = value.get("expr_str")
    check_sym_expr(text, where)
    tree = parse_expr(text, where).body
    ranges = {k: b for k in rc if (b := _range(rc, k)) is not None}
    if (
        isinstance(tree, ast.Call)
        and isinstance(tree.func, ast.Name)
        and tree.func.id == "Symbol"
        and tree.args
        and isinstance(tree.args[0], ast.Constant)
    ):
        sym = str(tree.args[0].value)
        lo, hi = ranges.get(sym, (None, None))
        return {"symbol": sym, "min": lo, "max": hi}
    expr = sym_to_text(tree)
    lo, hi = ranges.get(expr) or expr_bounds(tree, ranges)
    return {"expr": expr, "min": lo, "max": hi}


def user_inputs(gm: dict[str, Any], rc: dict[str, Any]) -> list[dict[str, Any]]:
    sig = require(gm, "signature", dict, "graph_module")
    specs = require(sig, "input_specs", list, "signature")
    graph = require(gm, "graph", dict, "graph_module")
    tensors = require(graph, "tensor_values", dict, "graph")
    inputs: list[dict[str, Any]] = []
    refused: list[str] = []
    for spec in specs:
        if not isinstance(spec, dict) or len(spec) != 1:
            raise Unprocessable("signature: an input spec is malformed")
        kind, body = next(iter(spec.items()))
        if kind != "user_input":
            continue
        arg = require(body, "arg", dict, "user_input")
        if set(arg) != {"as_tensor"}:
            kind_name, value = next(iter(arg.items()), ("?", None))
            name = (value.get("name") or value.get("as_name")) if isinstance(value, dict) else None
            refused.append(f"{name or f'#{len(inputs) + len(refused)}'} ({kind_name})")
            continue
        name = require(arg["as_tensor"], "name", str, "user_input")
        meta = tensors.get(name)
        if not isinstance(meta, dict):
            raise Unprocessable(f"input {name!r} has no tensor metadata in the graph")
        dtype_num = require(meta, "dtype", int, f"input {name!r}")
        if dtype_num not in SCALAR_TYPES:
            raise Unprocessable(f"input {name!r} has dtype {dtype_num}, which this service does not know")
        sizes = require(meta, "sizes", list, f"input {name!r}")
        shape = [_dim(s, rc, f"input {name!r} dim {i}") for i, s in enumerate(sizes)]
        inputs.append({"name": name, "dtype": SCALAR_TYPES[dtype_num], "shape": shape})
    if refused:
        raise Unprocessable(
            f"the exported program takes non-tensor input(s) {', '.join(refused)}; this service compiles "
            "programs whose user inputs are all tensors (export with those values baked in as constants)",
            inputs=refused,
        )
    return inputs
