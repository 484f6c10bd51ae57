"""The safetensors file format, read strictly and written plainly, with no torch and no unpickling.

A file is an 8-byte little-endian header length, a JSON header (`{name: {"dtype", "shape", "data_offsets"}}`
plus an optional `"__metadata__"` of strings), then the tensors' bytes, row-major, little-endian, back to back.
aotc's weights blobs are such files (compiler/weights.py writes them), so the worker, the service and the SDK can
describe one without torch, and the C++ example can read one with a JSON parser.

`read_header` trusts nothing in the file: the header's size is capped, every entry must name a known dtype, a
shape of non-negative ints, and offsets that tile the data region exactly (no gaps, no overlap, nothing past the
end), so a loader that maps the bytes can never read outside the file or alias two tensors.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# safetensors dtype name -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}
BY_TORCH_NAME = {t: s for s, (t, _) in DTYPES.items()}
MAX_HEADER_BYTES = 64 * 2**20  # safetensors' own reader caps it at 100 MB; 64 MiB holds ~500k entries
METADATA = "__metadata__"


class FormatError(ValueError):
    """The file is not a well-formed safetensors file (the message says where)."""


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch's name: float32, bfloat16, ...
    shape: tuple[int, ...]
    start: int  # offsets into the data region, which begins at `Header.data_start`
    end: int


@dataclass(frozen=True)
class Header:
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    size: int  # the whole file's bytes


def read_header(f: BinaryIO, size: int, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    """Parse and check the header of a file of `size` bytes open as `f`. FormatError names what is wrong."""
    if size < 8:
        raise FormatError(f"{size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > max_header_bytes or n > size - 8:
        raise FormatError(f"the header claims {n} bytes (the file has {size}, the cap is {max_header_bytes})")
    try:
        raw = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"the header is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise FormatError("the header is not a JSON object")
    meta = raw.pop(METADATA, {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError("__metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    entries: dict[str, Entry] = {}
    for name, e in raw.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"tensor {name!r}: an entry has exactly dtype, shape and data_offsets")
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPES:
            raise FormatError(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"tensor {name!r}: the shape must be a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise FormatError(f"tensor {name!r}: data_offsets must be two ints")
        start, end = offsets
        if not 0 <= start <= end <= data_len:
            raise FormatError(f"tensor {name!r}: bytes {start}..{end} are outside the data ({data_len} bytes)")
        if end - start != math.prod(shape) * DTYPES[dtype][1]:
            raise FormatError(f"tensor {name!r}: {end - start} bytes for shape {shape} of {dtype}")
        entries[name] = Entry(name, DTYPES[dtype][0], tuple(shape), start, end)
    # The offsets must tile the data exactly: no tensor overlaps another, no bytes are hidden between them.
    at = 0
    for e in sorted(entries.values(), key=lambda x: (x.start, x.end)):
        if e.start != at:
            raise FormatError(f"tensor {e.name!r} starts at {e.start}, expected {at} (a gap or an overlap)")
        at = e.end
    if at != data_len:
        raise FormatError(f"the tensors cover {at} bytes of data, the file holds {data_len}")
    return Header(entries, dict(meta), data_start, size)


def read_header_file(path: str | Path, max_header_bytes: int = MAX_HEADER_BYTES) -> Header:
    p = Path(path)
    with open(p, "rb") as f:
        return read_header(f, p.stat().st_size, max_header_bytes)


def write(f: BinaryIO, tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str]) -> None:
    """Write `tensors` ((name, torch dtype name, shape, little-endian row-major bytes), in this order) to `f`. The
    same tensors and metadata always give the same bytes (sorted JSON), so a blob's sha256 names its content."""
    header: dict[str, Any] = {METADATA: dict(metadata)} if metadata else {}
    at = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": BY_TORCH_NAME[dtype], "shape": list(shape), "data_offsets": [at, at + len(data)]}
        at += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data region starts 8-byte aligned, as safetensors' writer leaves it
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for _, _, _, data in tensors:
        f.write(data)
