"""Input specs: what shapes a compile is for, checked against what the exported program allows.

A request gives, per input, each dim as a size (8) or a range ({"min": 1, "max": 32}); strings such as
"8x3x224x224" and "1..32x3x224x224" are accepted too. The canonical spec lists every user input in program
order with its dtype, so it hashes the same however the request spelled it.

This is the one parser and the one coverage rule of shapes: the API, the worker and the client all use it.
Specs stay plain JSON (they are stored in job and artifact records and hashed into cache keys); the types below
say what that JSON holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

from compiler.errors import Unprocessable


class Range(TypedDict):
    min: int
    max: int


Dim = int | Range  # canonical: a size, or {"min": a, "max": b} with a < b


class InputSpec(TypedDict):
    name: str
    dtype: str
    shape: list[Dim]


Spec = list[InputSpec]  # every user input, in program order
INT64_MAX = 2**63 - 1
# Bytes per element of each dtype an exported program's inputs may have (compiler.archive.program's names).
DTYPE_BYTES: dict[str, int] = {
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8,
    "complex32": 4, "complex64": 8, "complex128": 16, "bool": 1, "bfloat16": 2, "uint16": 2, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "uint32": 4, "uint64": 8,
}
_DIM_RE = re.compile(r"^(\d+)(?:\.\.(\d+))?$")
_MAX_DIGITS = len(str(INT64_MAX))  # 19


def parse_shape(text: str) -> list[Dim]:
    """'8x3x224x224' -> [8, 3, 224, 224]; '1..32x3' -> [{'min': 1, 'max': 32}, 3]; '' -> [] (a scalar)."""
    text = text.strip()
    if text in ("", "scalar", "()"):
        return []
    dims: list[Dim] = []
    for part in text.lower().split("x"):
        m = _DIM_RE.match(part.strip())
        if not m:
            raise Unprocessable(f"cannot read shape {text!r}: each dim is a size (8) or a range (1..32), joined by 'x'")
        if any(g is not None and len(g) > _MAX_DIGITS for g in m.groups()):  # int() of 4300+ digits raises
            raise Unprocessable(f"cannot read shape {text[:40]!r}...: a dim has more than {_MAX_DIGITS} digits; sizes "
                                f"fit in int64 (at most {INT64_MAX})")
        lo = int(m.group(1))
        dims.append(lo if m.group(2) is None else {"min": lo, "max": int(m.group(2))})
    return dims


def parse_shape_args(args: Iterable[str]) -> dict[str, list[Dim]]:
    """['x=8x3x224x224', 'y=1..4'] -> {'x': [8, 3, 224, 224], 'y': [{'min': 1, 'max': 4}]}: the CLI's --shape
    and the lookup's ?shape= (NAME=SHAPE, once per input)."""
    out: dict[str, list[Dim]] = {}
    for arg in args:
        name, sep, shape = arg.partition("=")
        if not sep or not name.strip():
            raise Unprocessable(
                f"cannot read {arg!r}: write NAME=SHAPE, e.g. x=8x3x224x224 or x=1..32x3x224x224"
            )
        out[name.strip()] = parse_shape(shape)
    return out


def _norm_dim(name: str, i: int, d: Any) -> Dim:
    if isinstance(d, bool):
        raise Unprocessable(f"input {name!r} dim {i}: {d!r} is not a size")
    if isinstance(d, int):
        if d < 0:
            raise Unprocessable(f"input {name!r} dim {i} is {d}; sizes cannot be negative")
        if d > INT64_MAX:
            raise Unprocessable(f"input {name!r} dim {i} is {d}, which does not fit in int64")
        return d
    if isinstance(d, str):
        parsed = parse_shape(d)
        if len(parsed) != 1:
            raise Unprocessable(f"input {name!r} dim {i}: {d!r} is not one dim")
        return _norm_dim(name, i, parsed[0])
    if isinstance(d, dict) and set(d) == {"min", "max"}:
        lo, hi = d["min"], d["max"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise Unprocessable(f"input {name!r} dim {i}: min and max must be integers")
        if lo < 0 or hi < lo:
            raise Unprocessable(f"input {name!r} dim {i}: range {lo}..{hi} is empty or negative")
        if hi > INT64_MAX:
            raise Unprocessable(f"input {name!r} dim {i}: range {lo}..{hi} does not fit in int64")
        return lo if lo == hi else {"min": lo, "max": hi}
    raise Unprocessable(f"input {name!r} dim {i}: {d!r} is neither a size nor a {{min, max}} range")


def _fmt(d: Any) -> str:
    if isinstance(d, int):
        return str(d)
    if "symbol" in d or "expr" in d:
        hi = "inf" if d.get("max") is None else d["max"]
        return f"{d.get('min', '?')}..{hi}"
    return f"{d['min']}..{d['max']}"


def format_shape(shape: list[Any]) -> str:
    return "x".join(_fmt(d) for d in shape) or "scalar"


def format_spec(spec: Sequence[dict[str, Any]], *, dtypes: bool = False) -> str:
    """'x=1..32x3x64x64 y=8', or with dtypes 'x:float32[1..32x3x64x64]' (how the CLI lists a model's inputs)."""
    if dtypes:
        return " ".join(f"{i['name']}:{i['dtype']}[{format_shape(i['shape'])}]" for i in spec)
    return " ".join(f"{i['name']}={format_shape(i['shape'])}" for i in spec)


def check_input_bytes(spec: Sequence[dict[str, Any]], max_input_bytes: int) -> None:
    """Refuse a spec one of whose inputs, at the largest shape it allows, would exceed `max_input_bytes` (the
    API's AOTC_MAX_INPUT_MB): the artifact check allocates every input at its largest shape."""
    for inp in spec:
        largest = [bounds(d)[1] for d in inp["shape"]]
        numel = 1
        for n in largest:
            numel *= n
        size = numel * DTYPE_BYTES.get(inp["dtype"], 8)
        if size > max_input_bytes:
            raise Unprocessable(
                f"input {inp['name']!r} at its largest shape {format_shape(largest)} ({inp['dtype']}) is {numel} "
                f"elements, {size} bytes; the limit is {max_input_bytes} bytes (AOTC_MAX_INPUT_MB)",
                setting="AOTC_MAX_INPUT_MB", input=inp["name"])


def canonical_spec(program_inputs: list[dict[str, Any]], requested: dict[str, Any], *,
                   max_input_bytes: int | None = None) -> list[dict[str, Any]]:
    """Check `requested` ({name: dims}) against the program's inputs and return the canonical spec.

    Raises Unprocessable naming the input and the dim for every contradiction: unknown or missing inputs, a wrong
    rank, a size outside the exported range, a range on a static dim, dims sharing a symbol that disagree, a
    size that does not fit int64, and (with `max_input_bytes`) an input too large at its largest shape.
    """
    if not isinstance(requested, dict):
        raise Unprocessable("shapes must be an object mapping each input name to its dims")
    known = [p["name"] for p in program_inputs]
    unknown = sorted(set(requested) - set(known))
    if unknown:
        raise Unprocessable(f"unknown input(s) {unknown}; the exported program takes {known}", inputs=known)
    missing = [n for n in known if n not in requested]
    if missing:
        raise Unprocessable(f"no shape given for input(s) {missing}; the exported program takes {known}", inputs=known)

    bound: dict[str, tuple[Dim, str]] = {}  # symbol -> (requested dim, where it was first given)
    spec: list[dict[str, Any]] = []
    for p in program_inputs:
        name, exported = p["name"], p["shape"]
        dims_in = requested[name]
        if isinstance(dims_in, str):
            dims_in = parse_shape(dims_in)
        if not isinstance(dims_in, list):
            raise Unprocessable(f"input {name!r}: dims must be a list or a string such as '8x3x224x224'")
        if len(dims_in) != len(exported):
            raise Unprocessable(
                f"input {name!r} has rank {len(exported)} in the exported program "
                f"({format_shape(exported)}); the request gives {len(dims_in)} dims"
            )
        dims: list[Dim] = []
        for i, (want, have) in enumerate(zip(dims_in, exported)):
            d = _norm_dim(name, i, want)
            where = f"input {name!r} dim {i}"
            if isinstance(have, int):
                if d != have:
                    raise Unprocessable(f"{where} is static ({have}) in the exported program; "
                                        f"the request gives {_fmt(d)}")
            else:
                lo, hi = have.get("min"), have.get("max")
                d_lo, d_hi = (d, d) if isinstance(d, int) else (d["min"], d["max"])
                if (lo is not None and d_lo < lo) or (hi is not None and d_hi > hi):
                    allowed = f"{lo if lo is not None else 0}..{hi if hi is not None else 'inf'}"
                    raise Unprocessable(f"{where} is {_fmt(d)}; the exported program allows {allowed}")
                sym = have.get("symbol")
                if sym:
                    if sym in bound and bound[sym][0] != d:
                        first, at = bound[sym]
                        raise Unprocessable(
                            f"{where} shares its size with {at} in the exported program, "
                            f"so both must be the same (got {_fmt(d)} and {_fmt(first)})"
                        )
                    bound.setdefault(sym, (d, where))
            dims.append(d)
        spec.append({"name": name, "dtype": p["dtype"], "shape": dims})
    if max_input_bytes is not None:
        check_input_bytes(spec, max_input_bytes)
    return spec


def is_dynamic(spec: list[dict[str, Any]]) -> bool:
    return any(isinstance(d, dict) for inp in spec for d in inp["shape"])


def bounds(d: Dim) -> tuple[int, int]:
    return (d, d) if isinstance(d, int) else (d["min"], d["max"])


def covers(spec: Sequence[InputSpec] | Sequence[dict[str, Any]], shapes: Sequence[Sequence[Dim]]) -> bool:
    """True when an artifact compiled for `spec` can run inputs of `shapes` (one per input, in order; each dim a
    size or a range that must lie inside the spec's)."""
    if len(spec) != len(shapes):
        return False
    for inp, shape in zip(spec, shapes):
        if len(inp["shape"]) != len(shape):
            return False
        for have, want in zip(inp["shape"], shape):
            (lo, hi), (w_lo, w_hi) = bounds(have), bounds(want)
            if w_lo < lo or w_hi > hi:
                return False
    return True


def training_refusal(spec: Sequence[dict[str, Any]]) -> str | None:
    """Why `spec` cannot be compiled for mode=training, naming its first dynamic dim, or None: a train-step package
    is built at static shapes (compiler/training.py; docs/training.md)."""
    for inp in spec:
        for j, d in enumerate(inp.get("shape", [])):
            if isinstance(d, dict):
                return (f"mode=training takes static shapes: input {inp.get('name')!r} dim {j} is a range "
                        f"{d.get('min')}..{d.get('max')}; give one size (one package per batch shape)")
    return None
