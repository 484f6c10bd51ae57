"""The serialized program (models/model.json): a walk driven by the export schema, and what the API reads from it.

compiler.archive.schema tables every type torch.export's serializer writes; `walk_program` walks a document with
it, so every field is checked by the grammar of where it sits or refused: an unknown key, a value of another type
or a missing required field is refused with its path. Where torch would resolve or evaluate a string, the grammar
is that check: node targets against the operator list (compiler.archive.ops; one that ops.EXCLUDED leaves off is
refused with its reason), `expr_str` against the symbolic-expression grammar, guards and tree specs against theirs
(compiler.archive.exprs); names and string arguments against the grammars of where they sit
(compiler.archive.strings: codegen pastes them into C++ and Python source); every int against int64. The callables
a program can name are held to the operator list by meaning, not by field: a node's target must be on it, a
higher-order op must be one of compiler.archive.ops.HOPS and each argument it calls must be a subgraph
(`as_graph`), walked with the same rules; a subgraph anywhere else, an operator-valued argument (`as_operator`) and
a custom object are refused wherever they stand.

It also reads what the API answers with: each user input's name, dtype and shape, a dim being an int or a symbol or
expression with its range; and each weight's view, checked against its file.
"""

from __future__ import annotations

import ast
import re
from typing import Any, NamedTuple

from compiler.archive.container import require
from compiler.archive.exprs import (
    Bounds,
    check_guard,
    check_sym_expr,
    check_treespec,
    expr_bounds,
    parse_expr,
    sym_to_text,
)
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.ops import HOP_PREFIX, HOPS, Hop, excluded, is_operator_target, unbounded
from compiler.archive.schema import ENUMS, REFUSED, UNIONS, Field, Type, fields
from compiler.archive.strings import check, shown
from compiler.errors import Unprocessable, UnsafeArchive
from compiler.shapes import DTYPE_BYTES

UNBOUNDED = 2**62  # torch writes int_oo as null; older writers used sys.maxsize-like sentinels

# How torch's serializer writes a float that JSON cannot hold (serialize.py's _dataclass_to_dict): a masked_fill with
# -inf, in every nn.TransformerEncoder given a padding mask, is {"as_float": "-Infinity"}. Any other string in a
# float's place is refused.
NONFINITE = frozenset({"Infinity", "-Infinity", "NaN"})

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
_OPS_TXT = "compiler/archive/ops.txt lists them"
_NEVER_NEEDED = ("no model's exported graph calls it, so it is left off the operator list "
                 "(compiler/archive/ops.py EXCLUDED)")
_CHEAP = frozenset({"ident", "fqn", "text", "token"})  # grammars whose verdict on a string is cached per walk

_Path = tuple[object, ...]  # (parent path, key): rendered only for an error message


def _render(path: _Path | None) -> str:
    keys: list[str] = []
    while path is not None:
        parent, key = path
        keys.append(f"[{key}]" if isinstance(key, int) else f".{shown(key, 40).strip(chr(39))}")
        path = parent  # type: ignore[assignment]
    return "".join(reversed(keys)).lstrip(".")


class _At(NamedTuple):
    """Where the walk stands, for the checks that depend on it and the words of a refusal: the node and argument
    (names as written), and, at a position a higher-order op calls, that op and the position."""

    node: object = None
    arg: object = None
    hop: str | None = None
    position: int = -1


_NOWHERE = _At()


LONG_EXPR = 512  # compiler.archive.exprs caches checks of expressions up to this length across uploads
LONG_EXPRS_BUDGET = 2 * 2**20  # the characters of one document's distinct longer expressions, together


class _Walk:
    def __init__(self, where: str, limits: Limits) -> None:
        self.where, self.limits = where, limits
        self.fields = fields()
        self.required = {name: frozenset(k for k, f in table.items() if f.required)
                         for name, table in self.fields.items()}
        self.passed: set[tuple[str, str]] = set()  # (grammar, string) already checked: programs repeat names
        self.long_expr_chars = 0  # distinct expressions past exprs' cache (512 characters), parsed here in full

    # -- refusals ---------------------------------------------------------------------------------------------

    def _words(self, path: _Path | None, at: _At) -> str:
        if at.node is None:
            return f"{self.where}: {_render(path)}"
        return (f"{self.where}: node {shown(at.node)}" + (f" argument {shown(at.arg)}" if at.arg is not None else "")
                + f" ({_render(path)})")

    def _refuse(self, path: _Path | None, at: _At, why: str) -> UnsafeArchive:
        detail: dict[str, Any] = {"path": _render(path)}
        if at.node is not None:
            detail.update(node=shown(at.node), argument=shown(at.arg) if at.arg is not None else "")
        return UnsafeArchive(f"{self._words(path, at)} {why}", **detail)

    # -- values by type ---------------------------------------------------------------------------------------

    def value(self, v: Any, t: Type, path: _Path | None, at: _At) -> None:
        if v is None:
            if not t.nullable:
                raise self._refuse(path, at, f"is null; the export schema has {t.text} there")
            return
        kind = t.kind
        if kind == "ref":
            if t.arg in REFUSED:
                raise self._refuse(path, at, f"is a {t.arg}: {REFUSED[t.arg]}")
            self.union(v, t.arg, path, at) if t.arg in UNIONS else self.struct(v, t.arg, path, at)
        elif kind == "list":
            if not isinstance(v, list):
                raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")
            item = t.item
            assert item is not None
            plain_int = item.kind == "int"
            for i, x in enumerate(v):
                if plain_int and type(x) is int and INT64[0] <= x <= INT64[1]:
                    continue  # the common case, without a call
                self.value(x, item, (path, i), at)
        elif kind == "dict":
            if not isinstance(v, dict):
                raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")
            item = t.item
            assert item is not None
            for k, x in v.items():
                here = (path, k)
                self.string(k, t.arg, here, at, key=True)
                self.value(x, item, here, at)
        elif kind == "str":
            if not isinstance(v, str):
                raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")
            self.string(v, t.arg, path, at)
        elif kind == "int" or kind == "enum":
            if type(v) is not int:
                raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")
            if not INT64[0] <= v <= INT64[1]:
                raise Unprocessable(f"{self.where}: {_render(path)} is {v}, which does not fit in int64")
            if kind == "enum" and v not in ENUMS[t.arg]:
                raise self._refuse(path, at, f"is {v}, which is no {t.arg} torch writes")
        elif kind == "float":
            if type(v) not in (int, float) and v not in NONFINITE:
                raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")
        elif type(v) is not bool:  # bool
            raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has {t.text} there")

    def _fields(self, v: Any, name: str, path: _Path | None, at: _At) -> dict[str, Field]:
        """The fields of struct `name` after checking that `v` has no key the schema lacks and every required one."""
        table = self.fields[name]
        if not isinstance(v, dict):
            raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has a {name} there")
        if not v.keys() <= table.keys():
            k = next(k for k in v if k not in table)
            raise self._refuse((path, k), at, f"is not a field of {name} in the export schema this service "
                                              "knows (compiler/archive/schema.py); it is refused unread")
        if not self.required[name] <= v.keys():
            k = min(self.required[name] - v.keys())
            raise self._refuse(path, at, f"has no {k!r}, which a {name} must have")
        return table

    def struct(self, v: Any, name: str, path: _Path | None, at: _At) -> None:
        table = self._fields(v, name, path, at)
        if name == "Node":
            self.node(v, path)
            return
        for k, x in v.items():
            self.value(x, table[k].type, (path, k), at)

    def union(self, v: Any, name: str, path: _Path | None, at: _At) -> None:
        table = self.fields[name]
        if not isinstance(v, dict) or len(v) != 1:
            got = f"{len(v)} keys" if isinstance(v, dict) else f"a {_json_type(v)}"
            raise self._refuse(path, at, f"is {got}; a {name} is an object of exactly one of {sorted(table)}")
        ((member, x),) = v.items()
        here = (path, member)
        if member not in table:
            raise self._refuse(here, at, f"is not a member of {name} in the export schema this service knows "
                                         "(compiler/archive/schema.py); it is refused unread")
        t = table[member].type
        if name == "Argument":
            self.argument(member, x, t, here, at)
        elif not (t.kind == "int" and type(x) is int and INT64[0] <= x <= INT64[1]):  # SymInt's as_int, mostly
            self.value(x, t, here, at)

    # -- what the callables of a program may be --------------------------------------------------------------

    def node(self, v: dict[str, Any], path: _Path | None) -> None:
        name, target = v.get("name"), v.get("target")
        at = _At(node=name)
        check(name, "ident", lambda: f"{self.where}: node {shown(name)} name", self.limits, node=shown(name))
        if not isinstance(target, str) or not is_operator_target(target):
            if isinstance(target, str) and (why := excluded(target)) is not None:
                raise UnsafeArchive(f"{self.where}: node {shown(name)} calls {target}, which {why}; {_NEVER_NEEDED}",
                                    node=shown(name), path=_render((path, "target")))
            raise UnsafeArchive(
                f"{self.where}: node {shown(name)} calls {shown(target, 120)}, which is not a torch operator this "
                f"service compiles ({_OPS_TXT})", node=shown(name), path=_render((path, "target")))
        if (why := unbounded(target)) is not None:
            raise UnsafeArchive(f"{self.where}: node {shown(name)} calls {target}, which {why}",
                                node=shown(name), path=_render((path, "target")))
        hop = HOPS.get(target)
        if target.startswith(HOP_PREFIX) and hop is None:
            raise UnsafeArchive(
                f"{self.where}: node {shown(name)} calls {target}, a higher-order op whose callables this service "
                f"does not know how to check (it checks {', '.join(sorted(h.signature for h in HOPS.values()))})",
                node=shown(name), path=_render((path, "target")))
        table = self.fields["Node"]
        for k, x in v.items():
            if k == "inputs":
                self.inputs(x, target, hop, (path, k), at)
            elif k not in ("name", "target"):
                self.value(x, table[k].type, (path, k), at)

    def inputs(self, v: Any, target: str, hop: Hop | None, path: _Path, at: _At) -> None:
        if not isinstance(v, list):
            raise self._refuse(path, at, f"is a {_json_type(v)}; the export schema has list[NamedArgument] there")
        named = self.fields["NamedArgument"]
        position, called = 0, set()
        for i, inp in enumerate(v):
            here = (path, i)
            self._fields(inp, "NamedArgument", here, at)
            arg_name = inp.get("name")
            # torch 2.13's deserializer passes a higher-order op's input positionally when its kind is POSITIONAL
            # (1) or its name is '', torch 2.11's when its name is '': count positions the same way, and refuse
            # an input the two would place differently
            positional = inp.get("kind") == 1 or arg_name == ""
            if hop is not None and positional != (arg_name == ""):
                raise self._refuse(here, at, f"is named {shown(arg_name)} but marked positional; a higher-order "
                                             "op's positional inputs are named '' (torch 2.11 reads this one as a "
                                             "keyword, torch 2.13 as positional)")
            slot = _At(at.node, arg_name if arg_name != "" else f"#{position}")
            if hop is not None and positional and position in hop.graphs:
                slot = slot._replace(hop=hop.signature, position=position)
                called.add(position)
            position += positional
            for k, x in inp.items():
                self.value(x, named[k].type, (here, k), slot)
        if hop is not None and called != set(hop.graphs):
            missing = sorted(set(hop.graphs) - called)
            raise self._refuse(path, at, f"calls {target} with {position} positional argument(s); {hop.signature} "
                                         f"calls its argument(s) {missing}, which must be subgraphs")

    def argument(self, member: str, x: Any, t: Type, path: _Path, at: _At) -> None:
        if at.hop is not None:  # a position the higher-order op calls
            if member != "as_graph":
                what = f"an operator-valued argument naming {shown(x, 120)}" if member == "as_operator" else member
                if member == "as_operator" and isinstance(x, str) and (why := excluded(x)) is not None:
                    what += f" (which {why}; {_NEVER_NEEDED})"
                raise self._refuse(path, at, f"is {what}, but {at.hop} calls its argument {at.position}: it must "
                                             "be a subgraph (as_graph), checked like the program")
            self.value(x, t, path, _NOWHERE)  # a graph of its own: its nodes are checked as nodes
            return
        if member == "as_graph":
            raise self._refuse(path, at, "is a subgraph, but not at a position that a higher-order op this service "
                                         "compiles calls; a subgraph is accepted only there")
        if member == "as_operator":
            named = shown(x, 120)
            why = ("an operator passed as a value is called by the op that takes it, and no operator this service "
                   "compiles takes one" if isinstance(x, str) and is_operator_target(x)
                   else f"which {reason}; {_NEVER_NEEDED}" if isinstance(x, str) and (reason := excluded(x))
                   else f"which is not a torch operator this service compiles ({_OPS_TXT}); and an operator passed "
                        "as a value is called by the op that takes it, which no operator this service compiles does")
            raise self._refuse(path, at, f"is an operator-valued argument naming {named}: {why}")
        self.value(x, t, path, at._replace(hop=None, position=-1))

    # -- strings ----------------------------------------------------------------------------------------------

    def string(self, s: str, grammar: str, path: _Path | None, at: _At, key: bool = False) -> None:
        if grammar in _CHEAP or grammar in ("ident0", "fqn0"):
            if grammar in ("ident0", "fqn0"):
                if s == "":
                    return
                grammar = grammar[:-1]
            if (grammar, s) in self.passed:
                return
            try:
                check(s, grammar, lambda: self._words(path, at) + (" key" if key else " string"), self.limits)
            except UnsafeArchive as e:
                e.detail.setdefault("path", _render(path))
                if at.node is not None:
                    e.detail.update(node=shown(at.node), argument=shown(at.arg) if at.arg is not None else "")
                raise
            self.passed.add((grammar, s))
        elif grammar == "expr":
            if len(s) <= LONG_EXPR:
                check_sym_expr(s, self.where)  # cached across uploads
            elif ("expr", s) not in self.passed:
                # Each parse of a long one costs about 0.8 ms a kB: 400 distinct 76 kB expressions (a 7 MB upload)
                # once cost 24 s of the API's CPU. A real program's are short, and repeat.
                self.long_expr_chars += len(s)
                if self.long_expr_chars > LONG_EXPRS_BUDGET:
                    raise Unprocessable(f"{self.where}: the program's symbolic expressions longer than {LONG_EXPR} "
                                        f"characters hold more than {LONG_EXPRS_BUDGET} characters together; an "
                                        "exported program's are short")
                check_sym_expr(s, self.where)
                self.passed.add(("expr", s))
        elif grammar == "guard":
            check_guard(s, f"{self.where}: {_render(path)}")
        elif grammar == "treespec":
            check_treespec(s, f"{self.where}: {_render(path)}", self.limits)
        elif grammar == "free":
            return  # node metadata: never resolved by the worker's loader, never kept (compiler.compat.safe_load)
        else:  # target and operator stand only where node() and argument() read them first
            raise self._refuse(path, at, f"is a string of kind {grammar!r} where the walk did not expect one")


def _json_type(v: object) -> str:
    return {dict: "JSON object", list: "JSON array", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def walk_program(doc: Any, where: str, limits: Limits = DEFAULT_LIMITS, root: str = "ExportedProgram") -> None:
    """Check a whole serialized document against the export schema (compiler.archive.schema), from its `root`
    type: every key known, every value of its type and grammar, every callable on the operator list and in a
    place that may hold one. Refusals name the path, and the node and argument where there is one."""
    _Walk(where, limits).value(doc, Type("ref", root, text=root), None, _NOWHERE)


ITEMSIZE = DTYPE_BYTES
_PATH_NAME = re.compile(r"^[A-Za-z0-9_.-]+\Z")


def check_payload_config(doc: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, dict[str, Any]]:
    """A weights or constants config ({"config": {fqn: payload}}): every name in the FQN grammar (AOTInductor
    writes constant names into its C++ wrapper), plain file names, and the generic string and int checks."""
    config = require(doc, "config", dict, where)
    walk_program(doc, where, limits, root="PayloadConfig")
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
