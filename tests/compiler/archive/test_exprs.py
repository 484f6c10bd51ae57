"""compiler.archive.exprs: the symbolic expression and guard grammars, on plain and hostile strings."""

from __future__ import annotations

import pytest

from compiler.archive.exprs import check_guard, check_sym_expr
from compiler.errors import UnsafeArchive


@pytest.mark.parametrize(
    "text",
    [
        "Symbol('s77', positive=True, integer=True)",
        "Mul(Integer(2), Symbol('s17', positive=True, integer=True))",
        "Add(Symbol('s52', positive=True, integer=True), Integer(-1))",
        "FloorDiv(Symbol('s77', positive=True, integer=True), Integer(2))",
        "Pow(Symbol('s0', integer=True), Integer(2))",
        "Max(Integer(1), Symbol('s0'))",
        "Equality(Mod(Symbol('s0'), Integer(2)), Integer(0))",
        "Float('1.5', precision=53)",
        "Rational(1, 2)",
        "true",
        "int_oo",
    ],
)
def test_plain_sym_exprs_pass(text: str) -> None:
    check_sym_expr(text)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('touch /tmp/x') or Symbol('s0')",
        "Max('__import__(\"os\").system(\"x\")', 1)",  # Max sympifies string arguments
        "Symbol('s0').__class__",
        "exec(chr(49))",
        "Symbol('a b')",
        "Integer(1) + Integer(2)",
        "(lambda: 1)()",
        "Pow(Integer(10), Integer(100000000))",
        "Symbol('s', **{'x': 1})",
        "Symbol(s0)",
        "[Symbol('s0')]",
        "x" * 200_000,
        "Add(" * 300 + ")" * 300,
    ],
)
def test_hostile_sym_exprs_fail(text: str) -> None:
    with pytest.raises(UnsafeArchive):
        check_sym_expr(text)


@pytest.mark.parametrize(
    "text",
    [
        "L['a'].size()[0] == L['b'].size()[0]",
        "(L['x'].size()[0] % 2) == 0",
        "(L['x'].size()[0] // 2) != 1",
        "L['z'].size()[0] == (2*L['y'].size()[0])",
        "L['x'].size()[0] <= 64 and 2 <= L['x'].size()[0]",
        "L['args'][0].stride()[1] == 1",
    ],
)
def test_plain_guards_pass(text: str) -> None:
    check_guard(text)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('touch /tmp/x') == 0",
        "L['x'].size()[0] == 1, \"\"); import os; (\"",
        "L['x'].__class__ == 1",
        "L['x\"'].size()[0] == 1",
        "getattr(L, 'x') == 1",
        "L['x'].size()[0] == 1 # comment",
        "L['x'].size()[0] ==\n1",
        "math.system(1) == 0",
        "[L['x']] == 1",
    ],
)
def test_hostile_guards_fail(text: str) -> None:
    with pytest.raises(UnsafeArchive):
        check_guard(text)
