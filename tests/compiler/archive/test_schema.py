"""compiler/archive/schema.py against the installed torch's export schema (torch/_export/serde/schema.py): every type
reachable from ExportedProgram and PayloadConfig, every field with its type and whether it has a default, every
union member and enum value. A torch that adds or changes one fails here, before it can widen what an upload
may hold; what the table holds beyond this torch must be something another supported torch writes."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import pytest
from torch._export.serde import schema as torch_schema
from torch._export.serde.union import _Union

from compiler.archive.schema import ENUMS, ONLY_SOME_VERSIONS, REFUSED, ROOTS, STRUCTS, UNIONS, fields, parse


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=vars(torch_schema), include_extras=False)


def _text(t: Any, found: dict[str, type]) -> str:
    """A torch annotation in the table's type language, grammars left out; records the classes it reaches."""
    if isinstance(t, str):
        t = getattr(torch_schema, t)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _text(inner, found) + "?"
    if origin is list:
        return f"list[{_text(args[0], found)}]"
    if origin is dict:
        assert args[0] is str
        return f"dict[{_text(args[1], found)}]"
    if t in (int, float, bool, str):
        return t.__name__
    if isinstance(t, type) and issubclass(t, enum.IntEnum):
        found[t.__name__] = t
        return f"enum:{t.__name__}"
    if isinstance(t, typing.ForwardRef):
        return _text(t.__forward_arg__, found)
    assert dataclasses.is_dataclass(t), t
    found[t.__name__] = t
    return t.__name__


def _ours(text: str) -> str:
    """A table type with its grammars left out, as _text writes torch's."""
    t = parse(text)
    tail = "?" if t.nullable else ""
    if t.kind == "str":
        return "str" + tail
    if t.kind == "list":
        assert t.item is not None
        return f"list[{_ours(t.item.text)}]{tail}"
    if t.kind == "dict":
        assert t.item is not None
        return f"dict[{_ours(t.item.text)}]{tail}"
    if t.kind == "enum":
        return f"enum:{t.arg}{tail}"
    return (t.arg or t.kind) + tail


def _torch_tables() -> tuple[dict[str, dict[str, tuple[str, bool]]], dict[str, set[int]]]:
    """{type: {field or member: (type text, required)}} and {enum: values} of everything the roots reach."""
    tables: dict[str, dict[str, tuple[str, bool]]] = {}
    enums: dict[str, set[int]] = {}
    todo: dict[str, type] = {name: getattr(torch_schema, name) for name in ROOTS}
    while todo:
        name, cls = todo.popitem()
        if name in tables or name in enums:
            continue
        if issubclass(cls, enum.IntEnum):
            enums[name] = {int(v) for v in cls}
            continue
        found: dict[str, type] = {}
        hints = _hints(cls)
        table = {}
        for f in dataclasses.fields(cls):
            required = (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                        and not issubclass(cls, _Union))
            table[f.name] = (_text(hints[f.name], found), required)
        tables[name] = table
        todo.update({k: v for k, v in found.items() if k not in tables and k not in enums})
    return tables, enums


TORCH_TABLES, TORCH_ENUMS = _torch_tables()


def test_the_table_knows_every_type_torch_writes() -> None:
    ours = set(STRUCTS) | set(UNIONS)
    assert set(TORCH_TABLES) == ours, (sorted(set(TORCH_TABLES) - ours), sorted(ours - set(TORCH_TABLES)))
    assert set(TORCH_ENUMS) == set(ENUMS)
    for name in TORCH_TABLES:
        assert (name in UNIONS) == issubclass(getattr(torch_schema, name), _Union), name


@pytest.mark.parametrize("name", sorted(TORCH_TABLES))
def test_each_type_matches_torch_field_by_field(name: str) -> None:
    theirs = TORCH_TABLES[name]
    ours = {k: (_ours(f.type.text), f.required) for k, f in fields()[name].items()}
    elsewhere = {k for k in ours if f"{name}.{k}" in ONLY_SOME_VERSIONS}
    assert set(theirs) <= set(ours), f"torch's {name} has fields the table lacks: {sorted(set(theirs) - set(ours))}"
    assert set(ours) - set(theirs) <= elsewhere, f"{name}: {sorted(set(ours) - set(theirs) - elsewhere)}"
    for k, (text, required) in theirs.items():
        assert ours[k] == (text, required), f"{name}.{k}: torch has {text} (required={required}), table {ours[k]}"


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_each_enum_matches_torch(name: str) -> None:
    theirs, ours = TORCH_ENUMS[name], set(ENUMS[name])
    assert theirs <= ours, f"{name}: torch has values the table lacks: {sorted(theirs - ours)}"
    assert {f"{name}.{v}" for v in ours - theirs} <= set(ONLY_SOME_VERSIONS), sorted(ours - theirs)


def test_refused_types_and_version_notes_name_real_entries() -> None:
    assert set(REFUSED) <= set(STRUCTS)
    for entry in ONLY_SOME_VERSIONS:
        owner, _, member = entry.partition(".")
        assert member in fields().get(owner, {}) or (owner in ENUMS and int(member) in ENUMS[owner]), entry


@pytest.mark.parametrize("text", ["list[int", "dict[nogrammar, int]", "str:nogrammar", "enum:Colour", "Callable"])
def test_the_type_language_refuses_what_it_does_not_know(text: str) -> None:
    with pytest.raises(ValueError):
        parse(text)
