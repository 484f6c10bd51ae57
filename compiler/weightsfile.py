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
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from typing_extensions import Buffer

# safetensors dtype name -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}
BY_TORCH_NAME = {t: s for s, (t, _) in DTYPES.items()}
# The header's cap, in MiB: a setting (worker/settings.py declares it, so a worker validates it at start-up, and
# hands it to its sandboxed children), read here from the environment since the SDK, the loader and the check all
# read blobs. safetensors' own reader caps a header at 100 MB; 64 MiB holds ~500k entries.
MAX_HEADER_SETTING = "AOTC_WEIGHTS_MAX_HEADER_MB"
DEFAULT_MAX_HEADER_MB = 64
MAX_HEADER_MB_LIMIT = 1024
METADATA = "__metadata__"
SUFFIX = ".weights.safetensors"
STRIDES = "aotc.strides"  # aotc's metadata: each tensor's stride in the program (what the package expects)


def sidecar(package_path: str | Path) -> Path:
    """Where a package's weights blob sits beside it on disk: NAME.weights.safetensors for NAME.pt2."""
    p = Path(package_path)
    return p.with_name(p.name.removesuffix(".pt2") + SUFFIX)


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


def header_cap() -> int:
    """AOTC_WEIGHTS_MAX_HEADER_MB (default 64), in bytes. ValueError naming the setting when it is not 1..1024."""
    raw = os.environ.get(MAX_HEADER_SETTING, "").strip()
    if not raw:
        return DEFAULT_MAX_HEADER_MB * 2**20
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_HEADER_SETTING}={raw[:20]!r} is not a whole number of MiB") from None
    if not 0 < mb <= MAX_HEADER_MB_LIMIT:
        raise ValueError(f"{MAX_HEADER_SETTING}={mb}: it must be 1..{MAX_HEADER_MB_LIMIT} (MiB)")
    return mb * 2**20


def read_header(f: BinaryIO, size: int, max_header_bytes: int | None = None) -> Header:
    """Parse and check the header of a file of `size` bytes open as `f`. FormatError names what is wrong.
    `max_header_bytes`: the cap; by default AOTC_WEIGHTS_MAX_HEADER_MB's."""
    cap = max_header_bytes if max_header_bytes is not None else header_cap()
    if size < 8:
        raise FormatError(f"{size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > cap:
        raise FormatError(f"the header claims {n} bytes, over the cap of {cap} ({MAX_HEADER_SETTING}="
                          f"{cap // 2**20} MiB)")
    if n > size - 8:
        raise FormatError(f"the header claims {n} bytes, and the file has {size}")
    try:
        raw = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as bad:
        raise FormatError(f"the header is not JSON: {bad}") from None
    if not isinstance(raw, dict):
        raise FormatError("the header is not a JSON object")
    meta = raw.pop(METADATA, {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError("__metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    entries: dict[str, Entry] = {}
    for name, item in raw.items():
        if not isinstance(item, dict) or set(item) != {"dtype", "shape", "data_offsets"}:
            raise FormatError(f"tensor {name!r}: an entry has exactly dtype, shape and data_offsets")
        dtype, shape, offsets = item["dtype"], item["shape"], item["data_offsets"]
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
    for entry in sorted(entries.values(), key=lambda x: (x.start, x.end)):
        if entry.start != at:
            raise FormatError(f"tensor {entry.name!r} starts at {entry.start}, expected {at} (a gap or an overlap)")
        at = entry.end
    if at != data_len:
        raise FormatError(f"the tensors cover {at} bytes of data, the file holds {data_len}")
    return Header(entries, dict(meta), data_start, size)


def read_header_file(path: str | Path, max_header_bytes: int | None = None) -> Header:
    p = Path(path)
    with open(p, "rb") as f:
        return read_header(f, p.stat().st_size, max_header_bytes)


def write(f: BinaryIO, tensors: list[tuple[str, str, tuple[int, ...], Buffer]], metadata: dict[str, str]) -> None:
    """Write `tensors` ((name, torch dtype name, shape, little-endian row-major bytes), in this order) to `f`. The
    same tensors and metadata always give the same bytes (sorted JSON), so a blob's sha256 names its content."""
    header: dict[str, Any] = {METADATA: dict(metadata)} if metadata else {}
    at = 0
    for name, dtype, shape, data in tensors:
        n = memoryview(data).nbytes
        header[name] = {"dtype": BY_TORCH_NAME[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data region starts 8-byte aligned, as safetensors' writer leaves it
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for _, _, _, data in tensors:
        f.write(data)


def dense_stride(entry: Entry, raw: Any) -> tuple[int, ...] | None:
    """The stride the metadata gives a tensor, if it is a dense layout of its shape; None: take it contiguous.
    A stride that would alias elements or reach past them is refused here, before anything allocates by it."""
    if not isinstance(raw, list) or len(raw) != len(entry.shape) or not all(type(s) is int and s >= 0 for s in raw):
        return None
    expected = 1  # a permutation of a contiguous layout: sorted by stride, each is the product of the dims before
    for d, s in sorted(((d, s) for d, s in zip(entry.shape, raw) if d > 1), key=lambda ds: ds[1]):
        if s != expected:
            return None
        expected *= d
    return tuple(raw)


def describe(header: Header) -> list[dict[str, Any]]:
    """Each tensor's fqn, shape, dtype (torch's name) and stride, by name: what a manifest signs."""
    try:
        strides = json.loads(header.metadata.get(STRIDES, "{}"))
    except ValueError:
        strides = {}
    strides = strides if isinstance(strides, dict) else {}
    out = []
    for name in sorted(header.entries):
        e = header.entries[name]
        stride = dense_stride(e, strides.get(name))
        contiguous = [math.prod(e.shape[i + 1:]) for i in range(len(e.shape))]
        out.append({"fqn": name, "shape": list(e.shape), "dtype": e.dtype,
                    "stride": list(stride) if stride is not None else contiguous})
    return out
