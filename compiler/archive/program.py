"""The serialized program (models/model.json): node targets, every expression string, and the user inputs.

torch/_export/serde/schema.py describes the layout. The walk checks what torch would resolve or evaluate (node
targets by getattr chains, `expr_str` by sympify) and reads what the API answers with: each user input's name,
dtype and shape, a dim being an int or a symbol or expression with its range.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from compiler.archive.container import require
from compiler.archive.exprs import Bounds, check_sym_expr, expr_bounds, parse_expr, sym_to_text
from compiler.errors import Unprocessable

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


_TARGET = re.compile(r"^(torch|_operator|math)(\.[A-Za-z_][A-Za-z0-9_]*)+$|^#[A-Za-z0-9_.]+:[A-Za-z0-9_.]+$")
# ATen spells some operators as dunders (aten.__and__.Tensor, from `mask & mask` in every HF attention mask).
# Only these are allowed, and only as the operator name of torch.ops.<namespace>.<op>.<overload>: a dunder
# that every Python object has (__class__, __init__...) would resolve to something other than an operator.
_OP_DUNDERS = {f"__{n}__" for n in ("and", "or", "xor", "lshift", "rshift",
                                     "iand", "ior", "ixor", "ilshift", "irshift")}


def _is_operator_target(target: str) -> bool:
    if not _TARGET.match(target):
        return False
    if "__" not in target:
        return True
    parts = target.split(".")
    return (len(parts) in (4, 5) and parts[:2] == ["torch", "ops"] and parts[3] in _OP_DUNDERS
            and not any("__" in p for i, p in enumerate(parts) if i != 3))


def walk_program(doc: Any, where: str) -> None:
    """Check every `expr_str` anywhere in the program (sizes, strides, sym values, node arguments), and that node
    targets are dotted names under torch/_operator/math without dunders. torch resolves targets by getattr
    chains and its verifier then rejects non-operators; this just keeps odd names from getting that far."""
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            target = node.get("target")
            if isinstance(target, str) and "inputs" in node and "outputs" in node:
                if not _is_operator_target(target):
                    raise Unprocessable(f"{where}: graph node calls {target[:200]!r}, which is not a torch operator")
            for k, v in node.items():
                if k == "expr_str":
                    check_sym_expr(v, where)
                else:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)


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
