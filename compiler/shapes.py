"""Input specs: what shapes a compile is for, checked against what the exported program allows.

A request gives, per input, each dim as a size (8) or a range ({"min": 1, "max": 32}); strings such as
"8x3x224x224" and "1..32x3x224x224" are accepted too. The canonical spec lists every user input in program
order with its dtype, so it hashes the same however the request spelled it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Union

from compiler.errors import Unprocessable

Dim = Union[int, dict[str, int]]  # canonical: int, or {"min": a, "max": b} with a < b
_DIM_RE = re.compile(r"^(\d+)(?:\.\.(\d+))?$")


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
        lo = int(m.group(1))
        dims.append(lo if m.group(2) is None else {"min": lo, "max": int(m.group(2))})
    return dims


def parse_shape_arg(arg: str) -> tuple[str, list[Dim]]:
    """'x=8x3x224x224' -> ('x', [8, 3, 224, 224])."""
    name, sep, shape = arg.partition("=")
    if not sep or not name.strip():
        raise Unprocessable(f"cannot read {arg!r}: write NAME=SHAPE, e.g. x=8x3x224x224")
    return name.strip(), parse_shape(shape)


def _norm_dim(name: str, i: int, d: Any) -> Dim:
    if isinstance(d, bool):
        raise Unprocessable(f"input {name!r} dim {i}: {d!r} is not a size")
    if isinstance(d, int):
        if d < 0:
            raise Unprocessable(f"input {name!r} dim {i} is {d}; sizes cannot be negative")
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


def canonical_spec(program_inputs: list[dict[str, Any]], requested: dict[str, Any]) -> list[dict[str, Any]]:
    """Check `requested` ({name: dims}) against the program's inputs and return the canonical spec.

    Raises Unprocessable naming the input and the dim for every contradiction: unknown or missing inputs, a wrong
    rank, a size outside the exported range, a range on a static dim, dims sharing a symbol that disagree.
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
                    raise Unprocessable(f"{where} is static ({have}) in the exported program; the request gives {_fmt(d)}")
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
    return spec


def is_dynamic(spec: list[dict[str, Any]]) -> bool:
    return any(isinstance(d, dict) for inp in spec for d in inp["shape"])


def covers(artifact_spec: list[dict[str, Any]], concrete: list[dict[str, Any]]) -> bool:
    """True when an artifact compiled for `artifact_spec` can run inputs of the shapes in `concrete`."""
    if [i["name"] for i in artifact_spec] != [i["name"] for i in concrete]:
        return False
    for a, c in zip(artifact_spec, concrete):
        if len(a["shape"]) != len(c["shape"]):
            return False
        for ad, cd in zip(a["shape"], c["shape"]):
            c_lo, c_hi = (cd, cd) if isinstance(cd, int) else (cd["min"], cd["max"])
            a_lo, a_hi = (ad, ad) if isinstance(ad, int) else (ad["min"], ad["max"])
            if c_lo < a_lo or c_hi > a_hi:
                return False
    return True


def spec_json(spec: list[dict[str, Any]]) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))
