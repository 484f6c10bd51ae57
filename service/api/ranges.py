"""Conditional and range requests for downloads (RFC 9110): `If-None-Match` (a list, weak tags too), `If-Range`
and one `Range` of bytes.

A `Range` the server cannot read (a syntax error, a unit other than bytes, several ranges) is ignored and the whole
body is sent, as RFC 9110 allows; one that lies past the end is unsatisfiable (416).

No regular expression reads it: the one that did (optional runs of spaces and digits side by side, around the
dash) backtracked in cubic time, and a 3.6 kB header held the API process (the GIL: its event loop too) for 37 s.
This reading is linear in the header's length, which the HTTP protocol bounds (AOTC_MAX_HEADER_KB).
"""

from __future__ import annotations


def _parse(range_header: str) -> tuple[str, str] | None:
    """The first and last positions' digits of `bytes=FIRST-LAST` (either may be empty), or None."""
    unit, eq, spec = range_header.partition("=")
    first, dash, last = spec.partition("-")
    if not eq or not dash or unit.strip() != "bytes":
        return None
    first, last = first.strip(), last.strip()
    if any(d and not (d.isascii() and d.isdigit()) for d in (first, last)):
        return None
    return first, last


class Unsatisfiable(Exception):
    pass


def _int(digits: str) -> int:
    """A byte position: one past any size for more digits than int64 holds (int() refuses 4300+ digits)."""
    return int(digits) if len(digits) <= 18 else 2**63


def _opaque(tag: str) -> str:
    tag = tag.strip()
    return tag[2:] if tag.startswith("W/") else tag


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    """`If-None-Match` names this entity tag (weak comparison, any in a list, or `*`)."""
    if not if_none_match:
        return False
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or _opaque(etag) in (_opaque(t) for t in tags)


def byte_range(range_header: str | None, if_range: str | None, etag: str, size: int) -> tuple[int, int] | None:
    """[start, end) that `Range` asks for, None for the whole body; Unsatisfiable past the end. `If-Range` with
    another entity tag (strong comparison) means the client's copy is stale: the whole body."""
    if not range_header or (if_range is not None and if_range.strip() != etag):
        return None
    m = _parse(range_header)
    if m is None or (not m[0] and not m[1]):
        return None
    first, last = m
    if not first:  # the last N bytes
        n = _int(last)
        if n == 0 or size == 0:
            raise Unsatisfiable
        return max(0, size - n), size
    start = _int(first)
    end = size if not last else _int(last) + 1
    if last and end <= start:
        return None  # last < first: invalid, so ignored
    if start >= size:
        raise Unsatisfiable
    return start, min(end, size)
