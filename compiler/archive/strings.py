"""The grammars for the strings of an uploaded program that codegen may paste into C++ or Python source.

Inductor and AOTInductor write some of a graph's strings into generated source without escaping them: the
message of `aten._assert_async.msg` (`throw std::runtime_error("{msg}")` in C++ kernels), the message of
`aten._assert_scalar` (the C++ wrapper), every string argument of an op that falls back to ATen
(`val_to_arg_str_for_prim_type` writes `"{val}"`), constant and parameter names (`constants_info_[i].name` and
`.original_fqn` in the C++ wrapper), and FX writes the program's argument names and dict keys into the Python
code of `ep.module()`. A string that closes the literal becomes code. So every such string must fit a grammar in
which it cannot: none holds a quote, backslash, backtick or control character, and each is short.

    TEXT     string arguments (rounding_mode='floor', approximate='tanh', an einsum equation, an assert message):
             printable ASCII except " ' \\ `
    ASSERT   the one message torch itself writes for `_assert_scalar`, which quotes a node name:
             Runtime assertion failed for expression <TEXT> on node '<IDENT>'
    IDENT    node and value names, argument names, forward argument names, symbols: [A-Za-z_][A-Za-z0-9_]*
    FQN      parameter, buffer and constant names, module paths: [A-Za-z0-9_-] parts joined by '.' (torchvision
             names blocks 'block1-0'; a '-' cannot close a literal)
    TOKEN    everything else (versions, device types, tree spec types and keys): [A-Za-z0-9_.+-]*

Each is an allow-list: what it does not describe is refused. Node metadata (stack traces, module stacks) is free
text by nature; it is not checked here, and the worker drops it from the loaded program before any stage runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.errors import UnsafeArchive

_TEXT_CHARS = r"\x20\x21\x23-\x26\x28-\x5b\x5d-\x5f\x61-\x7e"  # printable ASCII less " ' \ `
TEXT = re.compile(rf"^[{_TEXT_CHARS}]*\Z")
ASSERT = re.compile(rf"^Runtime assertion failed for expression [{_TEXT_CHARS}]+ on node '[A-Za-z_][A-Za-z0-9_]*'\Z")
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
FQN = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\Z")
TOKEN = re.compile(r"^[A-Za-z0-9_.+-]*\Z")

GRAMMARS: dict[str, tuple[re.Pattern[str], str]] = {
    "text": (TEXT, "printable ASCII without quotes, backslash or backtick"),
    "ident": (IDENT, "an identifier: letters, digits and '_'"),
    "fqn": (FQN, "letters, digits, '_' and '-', in parts joined by '.'"),
    "token": (TOKEN, "letters, digits, '_', '.', '+' and '-'"),
}


def shown(value: object, n: int = 60) -> str:
    """A hostile string as an error message may quote it: ASCII, escaped, cut."""
    text = ascii(value) if isinstance(value, str) else type(value).__name__
    return text if len(text) <= n else text[:n] + "...'"


def check(value: object, grammar: str, what: str | Callable[[], str], limits: Limits = DEFAULT_LIMITS,
          **detail: Any) -> str:
    """`value` if it is a string of `grammar` within the length limit; UnsafeArchive naming `what` otherwise
    (a callable `what` is only called to word a refusal: walks over large programs stay cheap)."""
    pattern, description = GRAMMARS[grammar]
    if isinstance(value, str) and len(value) <= limits.max_graph_string_chars and (
            pattern.match(value) or (grammar == "text" and ASSERT.match(value))):
        return value
    if callable(what):
        what = what()
    if not isinstance(value, str):
        raise UnsafeArchive(f"{what} is a {type(value).__name__}, not a string", **detail)
    if len(value) > limits.max_graph_string_chars:
        raise UnsafeArchive(
            f"{what} is {len(value)} characters long; the limit is {limits.max_graph_string_chars} "
            f"({Limits.name('max_graph_string_chars')})", setting=Limits.name("max_graph_string_chars"), **detail)
    raise UnsafeArchive(
        f"{what} is {shown(value)}, which generated code could not quote safely; it must be {description}", **detail)
