"""Inspect an uploaded `torch.export.save` archive without torch and without unpickling anything.

The upload is untrusted, and `torch.export.load` trusts it: it unpickles sample inputs, pickled weights and
constants with weights_only=False, `pickle.loads` opaque constants, loads AOTInductor shared libraries, feeds
every `expr_str` to `sympy.sympify` (an `eval`), and `exec`s `guards_code` when the program runs. So before a
worker ever loads an upload, this module checks every one of those inputs statically: pickles against an
allow-list (compiler.archive.pickles), symbolic expressions and guards against a whitelist grammar (parsed with `ast`,
never evaluated), tree specs for the two importing hooks of torch's pytree. It also reads what the API needs
to answer: user inputs with dtypes and dynamic ranges, the output count, the weight size.

Everything that goes wrong is one of compiler.errors' classes; hostile bytes never surface as a raw exception.
Non-tensor user inputs (ints, floats, strings passed as graph inputs) are refused: the service compiles for
tensor inputs only.
"""

from __future__ import annotations

import ast
import json
import re
import zipfile
from typing import IO, Any

from compiler.archive import pickles
from compiler.errors import AotcError, UnsafeArchive, Unprocessable, UnsupportedMedia

MAX_ENTRIES = 100_000
MAX_EXPR_CHARS = 100_000
MAX_EXPR_NODES = 20_000
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

NOT_A_ZIP = "the upload is not a zip archive; save the program with torch.export.save(ep, 'model.pt2')"
NOT_EXPORT = "the upload is not a torch.export archive; save the program with torch.export.save(ep, 'model.pt2')"

# -- symbolic expressions (sympy srepr, as torch serializes SymInt/SymBool/SymFloat) ---------------------------

# Names a serialized expression may call. sympify evaluates the string, so the whitelist is what makes it safe:
# sympy core constructors plus the torch.utils._sympy.functions the deserializer puts in its namespace.
SYMPY_CALLS: frozenset[str] = frozenset(
    """Symbol Dummy Integer Rational Float Add Mul Pow Mod Max Min Abs floor ceiling sign
    Equality Unequality StrictLessThan LessThan StrictGreaterThan GreaterThan Eq Ne Lt Le Gt Ge
    And Or Not Xor Piecewise ExprCondPair BooleanTrue BooleanFalse
    FloorDiv ModularIndexing Where PythonMod CleanDiv CeilToInt FloorToInt CeilDiv LShift RShift PowByNatural
    FloatPow FloatTrueDiv IntTrueDiv IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt
    RoundDecimal ToFloat Identity""".split()
)
SYMPY_NAMES: frozenset[str] = frozenset({"oo", "zoo", "nan", "true", "false", "int_oo", "pi", "E"})
_GENERATED_FN = re.compile(r"^(OpaqueUnaryFn_[a-z0-9_]+|BitwiseFn_bitwise_[a-z_]+)$")
_STR_ARG_CALLS = frozenset({"Symbol", "Dummy", "Float"})  # the only calls that take a string
_POW_CALLS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"})
_SYMBOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_KWARG = re.compile(r"^[a-z][a-z_]*$")
MAX_INT_LITERAL = 2**128
MAX_EXPONENT = 64


def _parse(text: object, what: str) -> ast.Expression:
    if not isinstance(text, str) or len(text) > MAX_EXPR_CHARS:
        raise UnsafeArchive(f"{what} is not a string of at most {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except Exception as e:  # SyntaxError, ValueError (huge int literal), RecursionError, MemoryError
        raise UnsafeArchive(f"{what} {text[:200]!r} is not a valid expression ({type(e).__name__})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_EXPR_NODES:
        raise UnsafeArchive(f"{what} is too large ({MAX_EXPR_NODES} nodes at most)")
    return tree


def _int_literal(node: ast.AST) -> int | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_literal(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer" and node.args:
        return _int_literal(node.args[0])
    return None


def _check_sym_node(node: ast.AST, what: str) -> None:
    def bad(why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{what} is not a plain symbolic expression: {why}")

    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool) and node.value is not None:
            raise bad(f"literal {node.value!r} outside a Symbol/Float argument")
        if type(node.value) is int and abs(node.value) > MAX_INT_LITERAL:
            raise bad("integer literal too large")
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        if not isinstance(node.operand, ast.Constant):
            raise bad("unary minus on a non-literal")
        _check_sym_node(node.operand, what)
        return
    if isinstance(node, ast.Name):
        if node.id not in SYMPY_NAMES:
            raise bad(f"name {node.id!r}")
        return
    if not isinstance(node, ast.Call):
        raise bad(f"{type(node).__name__} is not allowed")
    if not isinstance(node.func, ast.Name):
        raise bad("call of something other than a plain name")
    fn = node.func.id
    if fn not in SYMPY_CALLS and not _GENERATED_FN.match(fn):
        raise bad(f"call of {fn!r}")
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if fn not in _STR_ARG_CALLS or i != 0:
                raise bad(f"string argument to {fn}")  # Max('...') etc. would sympify (eval) the string
            pattern = _FLOAT_TEXT if fn == "Float" else _SYMBOL_NAME
            if not pattern.match(arg.value):
                raise bad(f"{fn} argument {arg.value[:100]!r}")
            continue
        _check_sym_node(arg, what)
    if fn in _POW_CALLS and len(node.args) == 2:
        exp = _int_literal(node.args[1])
        if exp is not None and abs(exp) > MAX_EXPONENT:
            raise bad(f"{fn} with exponent {exp}")
    for kw in node.keywords:
        if kw.arg is None or not _KWARG.match(kw.arg):
            raise bad("keyword argument")
        if not (isinstance(kw.value, ast.Constant) and type(kw.value.value) in (bool, int)):
            raise bad(f"keyword {kw.arg} is not a bool or int literal")


def check_sym_expr(text: object, where: str = "expression") -> None:
    """Raise UnsafeArchive unless `text` is a plain sympy srepr (what torch writes as a SymExpr's expr_str)."""
    what = f"{where}: symbolic expression"
    _check_sym_node(_parse(text, what).body, what)


# -- guards ----------------------------------------------------------------------------------------------------

GUARD_CALLS: frozenset[str] = frozenset(
    {"Eq", "Ne", "Mod", "FloorDiv", "CeilDiv", "PythonMod", "Max", "Min", "Abs", "abs", "max", "min", "int",
     "float", "round", "floor", "ceiling", "sym_float", "sym_int", "sym_max", "sym_min"}
)
GUARD_METHODS: frozenset[str] = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
MATH_FUNCTIONS: frozenset[str] = frozenset({"floor", "ceil", "trunc", "sqrt", "log2", "log", "exp"})
_GUARD_FORBIDDEN_CHARS = set("\"\\#\n\r\t\x00{}")


def _check_guard_node(node: ast.AST, what: str) -> None:
    def bad(why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{what} is not a plain shape guard: {why}")

    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool) and node.value is not None:
            raise bad(f"literal {node.value!r}")
        return
    if isinstance(node, (ast.BinOp,)):
        _check_guard_node(node.left, what)
        _check_guard_node(node.right, what)
        return
    if isinstance(node, ast.UnaryOp):
        _check_guard_node(node.operand, what)
        return
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check_guard_node(v, what)
        return
    if isinstance(node, ast.Compare):
        _check_guard_node(node.left, what)
        for c in node.comparators:
            _check_guard_node(c, what)
        return
    if isinstance(node, ast.Name):
        if node.id not in ("L", "inf"):
            raise bad(f"name {node.id!r}")
        return
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            if not _SYMBOL_NAME.match(key.value):
                raise bad(f"key {key.value[:100]!r}")
        elif _int_literal(key) is None:
            raise bad("subscript that is not a name or an integer")
        _check_guard_node(node.value, what)
        return
    if isinstance(node, ast.Call):
        if node.keywords:
            raise bad("keyword arguments")
        fn = node.func
        if isinstance(fn, ast.Name):
            if fn.id not in GUARD_CALLS:
                raise bad(f"call of {fn.id!r}")
        elif isinstance(fn, ast.Attribute):
            if isinstance(fn.value, ast.Name) and fn.value.id == "math":
                if fn.attr not in MATH_FUNCTIONS:
                    raise bad(f"math.{fn.attr}")
            elif fn.attr in GUARD_METHODS:
                _check_guard_node(fn.value, what)
            else:
                raise bad(f"method {fn.attr!r}")
        else:
            raise bad("call of an expression")
        for a in node.args:
            _check_guard_node(a, what)
        return
    raise bad(f"{type(node).__name__} is not allowed")


def check_guard(text: str, where: str = "guards_code") -> None:
    """Raise UnsafeArchive unless `text` is a shape guard such as "L['x'].size()[0] == 2*L['y'].size()[0]".

    torch pastes guards into generated Python source and execs it when the program runs, so besides the AST
    whitelist no quote, backslash, comment or newline may appear (they could break out of the template).
    """
    what = f"{where} {str(text)[:200]!r}"
    if not isinstance(text, str) or _GUARD_FORBIDDEN_CHARS & set(text):
        raise UnsafeArchive(f"{what} is not a plain shape guard: forbidden character")
    _check_guard_node(_parse(text, what).body, what)


# -- tree specs --------------------------------------------------------------------------------------------------


def check_treespec(text: Any, where: str) -> None:
    """Refuse the two pytree spec features that import modules by name: defaultdict factories and enums."""
    try:
        spec = json.loads(text)
        stack: list[Any] = [spec]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, dict):
                if "__enum__" in node:
                    raise UnsafeArchive(f"{where}: tree spec contains an enum (resolved by importing a module)")
                if node.get("type") == "collections.defaultdict":
                    raise UnsafeArchive(f"{where}: tree spec contains a defaultdict (its factory is imported by name)")
                ctx = node.get("context")
                if isinstance(ctx, str):
                    stack.append(json.loads(ctx))
                stack.extend(v for k, v in node.items() if k != "context")
    except AotcError:
        raise
    except Exception as e:
        raise Unprocessable(f"{where}: tree spec is not valid JSON ({type(e).__name__})") from None


# -- the archive ----------------------------------------------------------------------------------------------


def _read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    if info.file_size > cap:
        raise Unprocessable(f"{info.filename} is {info.file_size} bytes; the limit is {cap} bytes", entry=info.filename)
    try:
        with zf.open(info) as f:
            data = f.read(cap + 1)
    except Exception as e:  # BadZipFile (CRC, header), NotImplementedError (compression), zlib.error, EOFError
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__}: {e})") from None
    if len(data) > cap:
        raise Unprocessable(f"{info.filename} is over the limit of {cap} bytes", entry=info.filename)
    return data


def _read_json(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> Any:
    data = _read(zf, info, cap)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise Unprocessable(f"{info.filename} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise Unprocessable(f"{info.filename} is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _req(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise Unprocessable(f"{where}: missing {key!r}; the file is not a serialized ExportedProgram")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise Unprocessable(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _check_names(infos: list[zipfile.ZipInfo]) -> str:
    """All entries under one root folder, no traversal, no duplicates; returns the root."""
    if not infos:
        raise Unprocessable(NOT_EXPORT + " (the zip is empty)")
    if len(infos) > MAX_ENTRIES:
        raise Unprocessable(f"the zip has {len(infos)} entries; the limit is {MAX_ENTRIES}")
    seen: set[str] = set()
    root = infos[0].filename.split("/", 1)[0]
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if (
            name.startswith(("/", "\\"))
            or "\\" in name
            or "\x00" in name
            or re.match(r"^[A-Za-z]:", name)
            or any(p in ("..", ".") for p in parts)
        ):
            raise Unprocessable(f"zip entry {name!r} has an absolute or parent-relative path", entry=name)
        if name in seen:
            raise Unprocessable(f"zip entry {name!r} appears twice", entry=name)
        seen.add(name)
        if info.flag_bits & 0x1:
            raise Unprocessable(f"zip entry {name!r} is encrypted", entry=name)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise Unprocessable(f"zip entry {name!r} uses an unsupported compression method", entry=name)
        if len(parts) < 2 or parts[0] != root or not root:
            raise Unprocessable(NOT_EXPORT + f" (entry {name!r} is not under the root folder {root!r})", entry=name)
    return root


def _not_export_reason(names: set[str], root: str) -> str:
    if any(n.startswith(f"{root}/code/") for n in names) or f"{root}/constants.pkl" in names:
        return NOT_EXPORT + ". This is a TorchScript archive (torch.jit.save), which is not supported"
    if f"{root}/data.pkl" in names:
        return NOT_EXPORT + ". This is a torch.save checkpoint, not an exported program"
    return NOT_EXPORT


def _simple_name(path_name: Any, where: str) -> str:
    if not isinstance(path_name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", path_name) or path_name in (".", ".."):
        raise Unprocessable(f"{where}: payload path {str(path_name)[:100]!r} is not a plain file name")
    return path_name


def _payload_config(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> dict[str, dict[str, Any]]:
    doc = _read_json(zf, info, cap)
    config = _req(doc, "config", dict, info.filename)
    for fqn, meta in config.items():
        if not isinstance(meta, dict):
            raise Unprocessable(f"{info.filename}: entry {str(fqn)[:100]!r} is not an object")
        _simple_name(meta.get("path_name"), info.filename)
        if not isinstance(meta.get("use_pickle", False), bool):
            raise Unprocessable(f"{info.filename}: use_pickle of {str(fqn)[:100]!r} is not a boolean")
    return config


_TARGET = re.compile(r"^(torch|_operator|math)(\.[A-Za-z_][A-Za-z0-9_]*)+$|^#[A-Za-z0-9_.]+:[A-Za-z0-9_.]+$")
# ATen spells some operators as dunders (aten.__and__.Tensor, from `mask & mask` in every HF attention mask).
# Only these are allowed, and only as the operator name of torch.ops.<namespace>.<op>.<overload>: a dunder
# that every Python object has (__class__, __init__...) would resolve to something other than an operator.
_OP_DUNDERS = {f"__{n}__" for n in ("and", "or", "xor", "lshift", "rshift", "iand", "ior", "ixor", "ilshift", "irshift")}


def _is_operator_target(target: str) -> bool:
    if not _TARGET.match(target):
        return False
    if "__" not in target:
        return True
    parts = target.split(".")
    return (len(parts) in (4, 5) and parts[:2] == ["torch", "ops"] and parts[3] in _OP_DUNDERS
            and not any("__" in p for i, p in enumerate(parts) if i != 3))


def _walk_program(doc: Any, where: str) -> None:
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


def _sym_to_text(node: ast.AST) -> str:
    """Best-effort sympy-style printing of a (validated) srepr tree: Mul(Integer(2), Symbol('s0')) -> 2*s0."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.UnaryOp):
        return "-" + _sym_to_text(node.operand)
    if isinstance(node, ast.Name):
        return node.id
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    fn, args = node.func.id, node.args
    if fn in ("Symbol", "Dummy", "Integer", "Float") and args:
        a = args[0]
        return str(a.value) if isinstance(a, ast.Constant) else _sym_to_text(a)
    parts = [_sym_to_text(a) for a in args]
    wrap = [f"({p})" if (" " in p and not p.startswith("(")) else p for p in parts]
    if fn == "Add":
        return " + ".join(parts).replace("+ -", "- ")
    if fn == "Mul":
        return "*".join(wrap)
    if fn in ("Pow", "PowByNatural") and len(wrap) == 2:
        return f"{wrap[0]}**{wrap[1]}"
    if fn == "FloorDiv" and len(wrap) == 2:
        return f"(({parts[0]})//{wrap[1]})" if " " in parts[0] else f"({parts[0]}//{wrap[1]})"
    if fn == "Rational" and len(parts) == 2:
        return f"{parts[0]}/{parts[1]}"
    return f"{fn}({', '.join(parts)})"


Bounds = tuple[int | None, int | None]


def _bounds(node: ast.AST, ranges: dict[str, Bounds]) -> Bounds:
    """Interval of a size expression over non-negative symbol ranges; (None, None) when unknown."""
    lit = _int_literal(node)
    if lit is not None:
        return lit, lit
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None, None
    fn, args = node.func.id, node.args
    if fn == "Symbol" and args and isinstance(args[0], ast.Constant):
        return ranges.get(str(args[0].value), (None, None))
    sub = [_bounds(a, ranges) for a in args]
    if any(lo is None or lo < 0 for lo, _ in sub):
        return None, None
    los = [lo for lo, _ in sub]
    his = [hi for _, hi in sub]
    if fn in ("Add", "Mul"):
        acc_lo, acc_hi = (0, 0) if fn == "Add" else (1, 1)
        hi_known = all(h is not None for h in his)
        for lo, hi in zip(los, his):
            acc_lo = acc_lo + lo if fn == "Add" else acc_lo * lo  # type: ignore[operator]
            if hi_known:
                acc_hi = acc_hi + hi if fn == "Add" else acc_hi * hi  # type: ignore[operator]
        return acc_lo, acc_hi if hi_known else None
    if fn in ("FloorDiv", "CeilDiv") and len(sub) == 2:
        (a_lo, a_hi), (b_lo, b_hi) = sub
        if b_lo is None or b_lo <= 0 or b_lo != b_hi or a_lo is None:
            return None, None
        ceil = fn == "CeilDiv"
        div = (lambda x: -(-x // b_lo)) if ceil else (lambda x: x // b_lo)
        return div(a_lo), None if a_hi is None else div(a_hi)
    return None, None


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
    tree = _parse(text, where).body
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
    expr = _sym_to_text(tree)
    lo, hi = ranges.get(expr) or _bounds(tree, ranges)
    return {"expr": expr, "min": lo, "max": hi}


def _inputs(gm: dict[str, Any], rc: dict[str, Any]) -> list[dict[str, Any]]:
    sig = _req(gm, "signature", dict, "graph_module")
    specs = _req(sig, "input_specs", list, "signature")
    graph = _req(gm, "graph", dict, "graph_module")
    tensors = _req(graph, "tensor_values", dict, "graph")
    inputs: list[dict[str, Any]] = []
    refused: list[str] = []
    for spec in specs:
        if not isinstance(spec, dict) or len(spec) != 1:
            raise Unprocessable("signature: an input spec is malformed")
        kind, body = next(iter(spec.items()))
        if kind != "user_input":
            continue
        arg = _req(body, "arg", dict, "user_input")
        if set(arg) != {"as_tensor"}:
            kind_name, value = next(iter(arg.items()), ("?", None))
            name = (value.get("name") or value.get("as_name")) if isinstance(value, dict) else None
            refused.append(f"{name or f'#{len(inputs) + len(refused)}'} ({kind_name})")
            continue
        name = _req(arg["as_tensor"], "name", str, "user_input")
        meta = tensors.get(name)
        if not isinstance(meta, dict):
            raise Unprocessable(f"input {name!r} has no tensor metadata in the graph")
        dtype_num = _req(meta, "dtype", int, f"input {name!r}")
        if dtype_num not in SCALAR_TYPES:
            raise Unprocessable(f"input {name!r} has dtype {dtype_num}, which this service does not know")
        sizes = _req(meta, "sizes", list, f"input {name!r}")
        shape = [_dim(s, rc, f"input {name!r} dim {i}") for i, s in enumerate(sizes)]
        inputs.append({"name": name, "dtype": SCALAR_TYPES[dtype_num], "shape": shape})
    if refused:
        raise Unprocessable(
            f"the exported program takes non-tensor input(s) {', '.join(refused)}; this service compiles "
            "programs whose user inputs are all tensors (export with those values baked in as constants)",
            inputs=refused,
        )
    return inputs


def _looks_pickled(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    try:
        with zf.open(info) as f:
            head = f.read(4)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    return head == pickles.ZIP_MAGIC or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _scan(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    try:
        f: IO[bytes] = zf.open(info)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    with f:
        pickles.check_file(f, info.filename)


def inspect_archive(path: str, *, max_json_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """Validate an uploaded .pt2 statically and describe it (see module docstring for what is checked).

    Returns {"root", "torch_version", "schema_version", "inputs": [{"name", "dtype", "shape"}], "outputs": int,
    "params": {"count", "bytes"}, "pickles": [entries scanned]}; a shape dim is an int, {"symbol", "min", "max"}
    or {"expr", "min", "max"} (max None when unbounded).
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != pickles.ZIP_MAGIC:
            raise UnsupportedMedia(NOT_A_ZIP)
        with zipfile.ZipFile(path) as zf:
            return _inspect(zf, max_json_bytes)
    except AotcError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise UnsupportedMedia(f"{NOT_A_ZIP} ({e})") from None
    except RecursionError:
        raise Unprocessable("the archive is nested too deeply to inspect") from None
    except Exception as e:  # last line of defence: hostile input must never become a 500
        raise Unprocessable(f"the archive cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def _inspect(zf: zipfile.ZipFile, cap: int) -> dict[str, Any]:
    infos = zf.infolist()
    root = _check_names(infos)
    by_name = {i.filename: i for i in infos}
    names = set(by_name)
    p = f"{root}/"

    fmt = by_name.get(p + "archive_format")
    if fmt is None or _read(zf, fmt, 64).strip() != b"pt2":
        raise Unprocessable(_not_export_reason(names, root))
    models = [n for n in names if n.startswith(p + "models/")]
    if len(models) != 1 or models[0] != p + "models/model.json":
        if not models:
            raise Unprocessable(_not_export_reason(names, root) + " (no models/model.json)")
        raise Unprocessable(
            f"the archive holds {sorted(m[len(p):] for m in models)}; this service takes exactly one program, "
            "saved as models/model.json by torch.export.save"
        )
    version = by_name.get(p + "archive_version")
    if version is None:
        raise Unprocessable(NOT_EXPORT + " (no archive_version; it was written by an older torch)")
    version_text = _read(zf, version, 64).strip()
    if version_text != b"0":
        raise Unprocessable(f"the archive has archive_version {version_text[:20]!r}; this service reads version 0")
    native = sorted(n for n in names if n.startswith(p + "data/aotinductor/"))
    if native:
        raise UnsafeArchive(
            f"the archive contains AOTInductor compiled code ({native[0]}); upload the exported program only",
            entry=native[0],
        )

    doc = _read_json(zf, by_name[p + "models/model.json"], cap)
    where = "models/model.json"
    gm = _req(doc, "graph_module", dict, where)
    rc = _req(doc, "range_constraints", dict, where)
    schema = _req(doc, "schema_version", dict, where)
    _req(doc, "opset_version", dict, where)
    torch_version = doc.get("torch_version")
    major, minor = _req(schema, "major", int, "schema_version"), _req(schema, "minor", int, "schema_version")
    _walk_program(doc, where)
    guards = doc.get("guards_code", [])
    if not isinstance(guards, list):
        raise Unprocessable(f"{where}: guards_code is not a list")
    for g in guards:
        check_guard(g, f"{where} guards_code")
    calls = gm.get("module_call_graph", [])
    for entry in calls if isinstance(calls, list) else []:
        sig = entry.get("signature") if isinstance(entry, dict) else None
        if isinstance(sig, dict):
            for key in ("in_spec", "out_spec"):
                if sig.get(key) is not None:
                    check_treespec(sig[key], f"{where} module_call_graph {key}")

    inputs = _inputs(gm, rc)
    out_specs = _req(_req(gm, "signature", dict, "graph_module"), "output_specs", list, "signature")
    outputs = sum(1 for s in out_specs if isinstance(s, dict) and "user_output" in s)

    # Entries torch reads as raw tensor bytes (never unpickled) vs entries torch unpickles.
    raw: set[str] = set()
    to_scan: list[str] = []
    params = {"count": 0, "bytes": 0}
    weights_dir, consts_dir = p + "data/weights/", p + "data/constants/"
    legacy = [n for n in (weights_dir + "model.pt", consts_dir + "model.pt") if n in names]
    to_scan.extend(legacy)

    wcfg_name = weights_dir + "model_weights_config.json"
    if wcfg_name in names:
        wcfg = _payload_config(zf, by_name[wcfg_name], cap)
        files: set[str] = set()
        for fqn, meta in wcfg.items():
            entry = weights_dir + meta["path_name"]
            if entry not in names:
                raise Unprocessable(f"weight {str(fqn)[:100]!r} points at {entry}, which is not in the archive")
            (to_scan.append(entry) if meta.get("use_pickle") else raw.add(entry))
            files.add(entry)
        params = {"count": len(wcfg), "bytes": sum(by_name[e].file_size for e in files)}
    elif weights_dir + "model.pt" not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/weights/model_weights_config.json)")

    for n in sorted(names):
        if n.startswith(consts_dir) and n[len(consts_dir):].startswith(("custom_obj_", "opaque_obj_")):
            raise UnsafeArchive(
                f"{n[len(p):]} is a custom-object constant (torchbind or opaque object); such constants are "
                "pickled Python objects and cannot be loaded safely, so the service refuses them",
                entry=n,
            )
    ccfg_name = consts_dir + "model_constants_config.json"
    if ccfg_name in names:
        for fqn, meta in _payload_config(zf, by_name[ccfg_name], cap).items():
            path_name = meta["path_name"]
            if path_name.startswith(("custom_obj_", "opaque_obj_")):
                raise UnsafeArchive(
                    f"constant {str(fqn)[:100]!r} is a custom object ({path_name}); the service cannot load it safely",
                    entry=path_name,
                )
            if not path_name.startswith("tensor_"):
                raise Unprocessable(f"constant {str(fqn)[:100]!r} has unsupported payload {path_name!r}")
            entry = consts_dir + path_name
            if entry not in names:
                raise Unprocessable(f"constant {str(fqn)[:100]!r} points at {entry}, which is not in the archive")
            (to_scan.append(entry) if meta.get("use_pickle") else raw.add(entry))
    elif consts_dir + "model.pt" not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/constants/model_constants_config.json)")

    sample = p + "data/sample_inputs/model.pt"
    if sample not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/sample_inputs/model.pt)")
    if by_name[sample].file_size > 0:
        to_scan.append(sample)

    known = {p + "models/model.json", fmt.filename, version.filename, wcfg_name, ccfg_name} | raw | set(to_scan)
    for n in sorted(names - known):
        if by_name[n].file_size and _looks_pickled(zf, by_name[n]):
            to_scan.append(n)  # not read by torch.export.load today, but pickled bytes get no benefit of doubt

    scanned = sorted(set(to_scan))
    for n in scanned:
        _scan(zf, by_name[n])

    return {
        "root": root,
        "torch_version": torch_version if isinstance(torch_version, str) else None,
        "schema_version": f"{major}.{minor}",
        "inputs": inputs,
        "outputs": outputs,
        "params": params,
        "pickles": scanned,
    }
