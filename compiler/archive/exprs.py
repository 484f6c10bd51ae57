"""The grammars for the strings in an upload that torch would evaluate: symbolic expressions, guards, tree specs.

torch's deserializer feeds every `expr_str` to `sympy.sympify` (an `eval`), pastes `guards_code` into Python source
that it `exec`s, and resolves two pytree spec features by importing a module by name. Each string is parsed with
`ast` and checked against a whitelist grammar here, never evaluated. The same checks run in the worker, inside
torch's loader (compiler.compat.safe_load), and on the loaded program (compiler.loading).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from compiler.archive.container import check_json_shape
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.strings import check
from compiler.errors import AotcError, Unprocessable, UnsafeArchive

MAX_EXPR_CHARS = 100_000
MAX_EXPR_NODES = 20_000

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
_GENERATED_FN = re.compile(r"^(OpaqueUnaryFn_[a-z0-9_]+|BitwiseFn_bitwise_[a-z_]+)\Z")
_STR_ARG_CALLS = frozenset({"Symbol", "Dummy", "Float"})  # the only calls that take a string
_POW_CALLS = frozenset({"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"})
_SYMBOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\Z")
_KWARG = re.compile(r"^[a-z][a-z_]*\Z")
MAX_INT_LITERAL = 2**128
MAX_EXPONENT = 64


def parse_expr(text: object, what: str) -> ast.Expression:
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


def _exponent(node: ast.AST) -> float | None:
    """A literal exponent or shift: an int, Integer(n), Rational(p, q) or Float('x'); None for anything else."""
    lit = _int_literal(node)
    if lit is not None:
        return float(lit) if abs(lit) <= MAX_INT_LITERAL else float("inf")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        if node.func.id == "Rational" and len(node.args) == 2:
            p, q = _int_literal(node.args[0]), _int_literal(node.args[1])
            if p is not None and q:
                return abs(p / q) if max(abs(p), abs(q)) <= MAX_INT_LITERAL else float("inf")
        value = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
        if node.func.id == "Float" and isinstance(value, (str, int, float)):
            try:
                return abs(float(value))
            except (TypeError, ValueError, OverflowError):
                return None
    return None


def _check_power(fn: str, args: Sequence[ast.AST], degree: float, bad: Any) -> float:
    """Powers and shifts take a literal right operand of at most MAX_EXPONENT, and nested powers multiply: the
    degree of the base (the product of the exponents above it) must stay within MAX_EXPONENT too, so neither
    `1 << 10**10` nor a tower of powers can be built. Returns the base's degree."""
    exp = _exponent(args[1]) if len(args) == 2 else None
    if exp is None:
        raise bad(f"{fn} with an exponent or shift that is not a literal number")
    if abs(exp) > MAX_EXPONENT:
        raise bad(f"{fn} with exponent or shift {exp:g} (at most {MAX_EXPONENT}, MAX_EXPONENT)")
    if fn in ("LShift", "RShift"):
        return degree
    degree *= max(abs(exp), 1)
    if degree > MAX_EXPONENT:
        raise bad(f"nested powers reach degree {degree:g} (at most {MAX_EXPONENT}, MAX_EXPONENT)")
    return degree


def _check_sym_node(node: ast.AST, what: str, degree: float = 1) -> None:
    def bad(why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{what} is not a plain symbolic expression: {why}")

    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool) and node.value is not None:
            raise bad(f"literal {node.value!r} outside a Symbol/Float argument")
        if type(node.value) is int and abs(node.value) > MAX_INT_LITERAL:
            raise bad("integer literal too large (MAX_INT_LITERAL)")
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
    base_degree = _check_power(fn, node.args, degree, bad) if fn in _POW_CALLS else degree
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            if fn not in _STR_ARG_CALLS or i != 0:
                raise bad(f"string argument to {fn}")  # Max('...') etc. would sympify (eval) the string
            pattern = _FLOAT_TEXT if fn == "Float" else _SYMBOL_NAME
            if not pattern.match(arg.value):
                raise bad(f"{fn} argument {arg.value[:100]!r}")
            continue
        _check_sym_node(arg, what, base_degree if i == 0 else degree)
    for kw in node.keywords:
        if kw.arg is None or not _KWARG.match(kw.arg):
            raise bad("keyword argument")
        if not (isinstance(kw.value, ast.Constant) and type(kw.value.value) in (bool, int)):
            raise bad(f"keyword {kw.arg} is not a bool or int literal")


def check_sym_expr(text: object, where: str = "expression") -> None:
    """Raise UnsafeArchive unless `text` is a plain sympy srepr (what torch writes as a SymExpr's expr_str)."""
    if not isinstance(text, str):
        raise UnsafeArchive(f"{where}: symbolic expression is not a string")
    # Cache only short texts: the cache must not keep megabytes of an upload alive in the API.
    why = _sym_expr_refusal(text) if len(text) <= 512 else _sym_expr_refusal.__wrapped__(text)
    if why is not None:
        raise UnsafeArchive(f"{where}: symbolic expression{why}")


@lru_cache(maxsize=4096)
def _sym_expr_refusal(text: str) -> str | None:
    """Why `text` is refused (the message after "symbolic expression"), or None; a program repeats the same few
    expressions thousands of times, so each distinct one is parsed once."""
    try:
        _check_sym_node(parse_expr(text, "").body, "")
    except UnsafeArchive as e:
        return e.message
    return None


# -- guards ----------------------------------------------------------------------------------------------------

GUARD_CALLS: frozenset[str] = frozenset(
    {"Eq", "Ne", "Mod", "FloorDiv", "CeilDiv", "PythonMod", "Max", "Min", "Abs", "abs", "max", "min", "int",
     "float", "round", "floor", "ceiling", "sym_float", "sym_int", "sym_max", "sym_min"}
)
GUARD_METHODS: frozenset[str] = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
MATH_FUNCTIONS: frozenset[str] = frozenset({"floor", "ceil", "trunc", "sqrt", "log2", "log", "exp"})
_GUARD_FORBIDDEN_CHARS = set("\"\\#\n\r\t\x00{}")
_GUARD_BINOPS = frozenset({"Add", "Sub", "Mult", "Div", "FloorDiv", "Mod", "Pow", "LShift", "RShift", "BitAnd",
                           "BitOr", "BitXor"})
_GUARD_POWERS = {"Pow": "Pow", "LShift": "LShift", "RShift": "RShift"}  # bounded like their sympy forms


def _check_guard_node(node: ast.AST, what: str, degree: float = 1) -> None:
    def bad(why: str) -> UnsafeArchive:
        return UnsafeArchive(f"{what} is not a plain shape guard: {why}")

    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, bool) and node.value is not None:
            raise bad(f"literal {node.value!r}")
        if type(node.value) is int and abs(node.value) > MAX_INT_LITERAL:
            raise bad("integer literal too large (MAX_INT_LITERAL)")
        return
    if isinstance(node, ast.BinOp):
        op = type(node.op).__name__
        if op not in _GUARD_BINOPS:
            raise bad(f"operator {op}")
        if op in _GUARD_POWERS:
            left_degree = _check_power(_GUARD_POWERS[op], [node.left, node.right], degree, bad)
            _check_guard_node(node.left, what, left_degree)
            return
        _check_guard_node(node.left, what, degree)
        _check_guard_node(node.right, what, degree)
        return
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            raise bad(f"operator {type(node.op).__name__}")
        _check_guard_node(node.operand, what, degree)
        return
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check_guard_node(v, what, degree)
        return
    if isinstance(node, ast.Compare):
        _check_guard_node(node.left, what, degree)
        for c in node.comparators:
            _check_guard_node(c, what, degree)
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
        _check_guard_node(node.value, what, degree)
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
                _check_guard_node(fn.value, what, degree)
            else:
                raise bad(f"method {fn.attr!r}")
        else:
            raise bad("call of an expression")
        for a in node.args:
            _check_guard_node(a, what, degree)
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
    _check_guard_node(parse_expr(text, what).body, what)


# -- tree specs --------------------------------------------------------------------------------------------------


def check_treespec(text: Any, where: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse the two pytree spec features that import modules by name (defaultdict factories and enums), and any
    string in the spec outside the TOKEN grammar: FX writes a spec's dict keys and the forward's argument names
    into the Python code of `ep.module()` (`{'key': arg}`), which the worker runs."""
    if not isinstance(text, str):
        raise Unprocessable(f"{where}: tree spec is not a string")
    check_json_shape(text.encode("utf-8", "replace"), f"{where} tree spec", limits)
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
                for k in node:
                    check(k, "token", f"{where}: a tree spec key", limits)
                ctx = node.get("context")
                if isinstance(ctx, str):
                    check_json_shape(ctx.encode("utf-8", "replace"), f"{where} tree spec context", limits)
                    stack.append(json.loads(ctx))
                stack.extend(v for k, v in node.items() if k != "context")
            elif isinstance(node, str):
                check(node, "token", f"{where}: a tree spec string", limits)
    except AotcError:
        raise
    except Exception as e:
        raise Unprocessable(f"{where}: tree spec is not valid JSON ({type(e).__name__})") from None


# -- reading a checked size expression ----------------------------------------------------------------------------


def sym_to_text(node: ast.AST) -> str:
    """Best-effort sympy-style printing of a (validated) srepr tree: Mul(Integer(2), Symbol('s0')) -> 2*s0."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.UnaryOp):
        return "-" + sym_to_text(node.operand)
    if isinstance(node, ast.Name):
        return node.id
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    fn, args = node.func.id, node.args
    if fn in ("Symbol", "Dummy", "Integer", "Float") and args:
        a = args[0]
        return str(a.value) if isinstance(a, ast.Constant) else sym_to_text(a)
    parts = [sym_to_text(a) for a in args]
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


def expr_bounds(node: ast.AST, ranges: dict[str, Bounds]) -> Bounds:
    """Interval of a size expression over non-negative symbol ranges; (None, None) when unknown."""
    lit = _int_literal(node)
    if lit is not None:
        return lit, lit
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None, None
    fn, args = node.func.id, node.args
    if fn == "Symbol" and args and isinstance(args[0], ast.Constant):
        return ranges.get(str(args[0].value), (None, None))
    sub = [expr_bounds(a, ranges) for a in args]
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
