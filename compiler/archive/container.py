"""The zip container of an upload: its layout, entry names and sizes, bounded reads, and the JSON inside.

Python's zipfile (here) and torch's PyTorchStreamReader (miniz, in the worker) must read the same archive the
same way, so only the layout torch itself writes is accepted: entries back to back from offset 0, then the
central directory, then the end record with no comment; no data before, between or after; local headers that
agree with the central directory; names of one grammar under one root folder; no duplicates, not even by case
(torch's reader looks names up case-insensitively); stored or deflated entries, no encryption. Sizes come from
the central directory, are bounded there (`Limits`), and are enforced again while reading: a read never returns
more than the bound, and a deflated entry must inflate to exactly its declared size.

JSON is bounded before it is parsed: its size, its nesting depth and its number of values are measured on the
raw bytes, so a small upload cannot make `json.loads` build gigabytes of Python objects.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
import zlib
from typing import IO, Any

from compiler.archive import pickles
from compiler.archive.limits import DEFAULT_LIMITS, MB, Limits
from compiler.errors import Unprocessable

NOT_A_ZIP = "the upload is not a zip archive; save the program with torch.export.save(ep, 'model.pt2')"
NOT_EXPORT = "the upload is not a torch.export archive; save the program with torch.export.save(ep, 'model.pt2')"

# The root folder is the stem of the file torch.export.save wrote (spaces and dots included); every name below it
# is a plain relative path. Both grammars are ASCII: zipfile decodes other bytes as cp437 or UTF-8 by a flag,
# torch's reader keeps them raw.
_ROOT = re.compile(r"^[A-Za-z0-9_.+-]+( [A-Za-z0-9_.+-]+)*\Z")
_PART = re.compile(r"^[A-Za-z0-9_.+-]+\Z")
NAME_GRAMMAR = "ASCII letters, digits, '_', '.', '+' and '-' (and spaces in the root folder's name)"
_FLAG_DESCRIPTOR, _FLAG_UTF8 = 0x08, 0x800
_ALLOWED_FLAGS = _FLAG_DESCRIPTOR | _FLAG_UTF8  # what torch's writer and Python's zipfile set
_RATIO_FLOOR = 1 * MB  # entries smaller than this cannot amplify much, whatever their ratio
_EOCD, _EOCD64, _LOC64, _LOCAL = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07", b"PK\x03\x04"


def _too_big(what: str, size: int, limit: int, field: str, entry: str | None = None) -> Unprocessable:
    detail = {"entry": entry} if entry else {}
    return Unprocessable(f"{what} is {size} bytes; the limit is {limit} bytes ({Limits.name(field)})",
                         setting=Limits.name(field), **detail)


def read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int, field: str | None = None) -> bytes:
    """The entry's bytes, refused past `cap` whatever its header claims (`field` names the limit)."""
    setting = f" ({Limits.name(field)})" if field else ""
    if info.file_size > cap:
        raise Unprocessable(f"{info.filename} is {info.file_size} bytes; the limit is {cap} bytes{setting}",
                            entry=info.filename)
    try:
        with zf.open(info) as f:
            data = f.read(cap + 1)
    except Exception as e:  # BadZipFile (CRC, header), NotImplementedError (compression), zlib.error, EOFError
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__}: {e})") from None
    if len(data) > cap:
        raise Unprocessable(f"{info.filename} is over the limit of {cap} bytes{setting}", entry=info.filename)
    return data


# A JSON string once its escaped backslashes and quotes are gone (`_without_strings`): a quote, anything but a
# quote, a quote.
_PLAIN_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


def _depth_within(text: bytes, max_depth: int) -> bool | None:
    """True if the brackets in `text` nest at most `max_depth` deep, False if deeper, None if they do not balance.
    Each pass removes the innermost level everywhere (C-speed replaces), so the cost is max_depth passes."""
    brackets = text.translate(None, _NOT_BRACKET)
    for _ in range(max_depth):
        if not brackets:
            return True
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(brackets):
            return None
        brackets = inner
    if not brackets:
        return True
    return False if len(brackets.replace(b"[]", b"").replace(b"{}", b"")) < len(brackets) else None


def _without_strings(data: bytes) -> bytes:
    """`data` with its JSON strings removed, in time linear in its length. Escaped backslashes go first, then
    escaped quotes (what is left of an escape cannot end a string), so every quote left opens or closes one. The
    regular expression that did this (a quote, then runs of plain characters or escapes) tried every quote of an
    unclosed run to the end of the text: quadratic, 47 s of the API's CPU, the GIL held, for a 120 kB upload."""
    return _PLAIN_STRING.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))


def check_json_shape(data: bytes, where: str, limits: Limits = DEFAULT_LIMITS) -> None:
    """Refuse JSON with more than `max_json_values` values or nested deeper than `max_json_depth`, measured on the
    raw bytes before anything is parsed.

    Both are first measured counting brackets and commas inside strings too (a few C-speed passes, an upper
    bound): a real program's model.json is far inside both limits that way. Only JSON whose brackets do not
    pass that way is measured again with its strings removed (a regular expression, slower)."""
    values = data.count(b",") + data.count(b"[") + data.count(b"{") + 1  # every value but the first follows a ','
    if values > limits.max_json_values:                                 # or opens a container: an upper bound
        raise Unprocessable(
            f"{where} holds more than {limits.max_json_values} JSON values or separators ({values}); the limit "
            f"is {limits.max_json_values} values ({Limits.name('max_json_values')})",
            setting=Limits.name("max_json_values"))
    if _depth_within(data, limits.max_json_depth):
        return
    if _depth_within(_without_strings(data), limits.max_json_depth) is False:
        raise Unprocessable(
            f"{where} is nested more than {limits.max_json_depth} levels deep ({Limits.name('max_json_depth')})",
            setting=Limits.name("max_json_depth"))
    # balanced and shallow once strings are left out, or malformed: json.loads says how


def read_json(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits = DEFAULT_LIMITS) -> Any:
    data = read_entry(zf, info, limits.max_json_bytes, "max_json_bytes")
    check_json_shape(data, info.filename, limits)
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise Unprocessable(f"{info.filename} is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise Unprocessable(f"{info.filename} is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def require(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`obj[key]`, which must be a `kind` (a bool is not an int); the error names `where`."""
    if not isinstance(obj, dict) or key not in obj:
        raise Unprocessable(f"{where}: missing {key!r}; the file is not a serialized ExportedProgram")
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise Unprocessable(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _layout(f: IO[bytes], infos: list[zipfile.ZipInfo]) -> None:
    """The bytes are exactly: the entries back to back from offset 0, the central directory, the end record(s).

    Anything else (a comment, data before, between or after the entries, overlapping entries, local headers that
    disagree with the central directory) could make another zip reader see other entries or other bytes."""
    f.seek(0, 2)
    size = f.tell()

    def at(offset: int, n: int) -> bytes:
        f.seek(offset)
        data = f.read(n)
        if len(data) != n:
            raise Unprocessable("the zip is truncated")
        return data

    if size < 22 or at(size - 22, 4) != _EOCD:
        raise Unprocessable("the zip has an archive comment or bytes after its end record; torch.export.save "
                            "writes neither")
    _, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment = struct.unpack("<4sHHHHIIH", at(size - 22, 22))
    cd_end = size - 22
    if size >= 42 + 56 and at(size - 42, 4) == _LOC64:  # zip64 (torch always writes it): its record and locator
        (rec_offset,) = struct.unpack("<Q", at(size - 42 + 8, 8))
        rec = at(rec_offset, 56) if rec_offset + 56 <= size else b""
        if rec[:4] != _EOCD64 or struct.unpack("<Q", rec[4:12])[0] != 44 or rec_offset + 56 != size - 42:
            raise Unprocessable("the zip's zip64 end record is not where its locator says")
        cd_size64, cd_offset64 = struct.unpack("<QQ", rec[40:56])
        if (cd_size, cd_offset) != (cd_size64, cd_offset64) and 0xFFFFFFFF not in (cd_size, cd_offset):
            raise Unprocessable("the zip's two end records disagree on where the central directory is")
        cd_size, cd_offset, cd_end = cd_size64, cd_offset64, rec_offset
    elif 0xFFFFFFFF in (cd_size, cd_offset) or 0xFFFF in (n_disk, n_total):
        raise Unprocessable("the zip's zip64 end locator is missing")
    if disk or cd_disk or comment or cd_offset + cd_size != cd_end:
        raise Unprocessable("the zip has bytes before its entries or around its central directory, spans disks, "
                            "or has a comment; torch.export.save writes none of these")
    pos = 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        name = info.orig_filename
        if info.header_offset != pos:
            raise Unprocessable(f"zip entry {name!r} is not where the previous entry ends (hidden or overlapping "
                                "data)", entry=name)
        head = at(pos, 30)
        sig, _, flags, method, _, _, _, _, _, n_len, x_len = struct.unpack("<4sHHHHHIIIHH", head)
        if sig != _LOCAL or flags != info.flag_bits or method != info.compress_type:
            raise Unprocessable(f"zip entry {name!r}: its local header disagrees with the central directory",
                                entry=name)
        if at(pos + 30, n_len) != name.encode("ascii"):
            raise Unprocessable(f"zip entry {name!r}: its local header names another file", entry=name)
        pos += 30 + n_len + x_len + info.compress_size
        if flags & _FLAG_DESCRIPTOR:  # crc and sizes follow the data: 16 or 24 bytes (zip64) with a signature
            for n in (16, 24, 12, 20):
                if pos + n > cd_offset or (n in (16, 24) and at(pos, 4) != b"PK\x07\x08"):
                    continue
                if pos + n == cd_offset or at(pos + n, 4) == _LOCAL:
                    pos += n
                    break
            else:
                raise Unprocessable(f"zip entry {name!r}: no data descriptor after its data", entry=name)
    if pos != cd_offset:
        raise Unprocessable("the zip has bytes between its last entry and its central directory")


def check_zip(f: IO[bytes], infos: list[zipfile.ZipInfo], limits: Limits = DEFAULT_LIMITS) -> str:
    """The container as torch writes it: names, flags, sizes (bounded by `limits`) and layout; returns the root.

    Every name is `root/part/.../part` in NAME_GRAMMAR, with no '.' or '..' part, no directory entries, and no
    two names equal when case is ignored."""
    if not infos:
        raise Unprocessable(NOT_EXPORT + " (the zip is empty)")
    if len(infos) > limits.max_entries:
        raise Unprocessable(f"the zip has {len(infos)} entries; the limit is {limits.max_entries} "
                            f"({Limits.name('max_entries')})", setting=Limits.name("max_entries"))
    seen: set[str] = set()
    root = infos[0].orig_filename.split("/", 1)[0]
    total = packed = 0
    for info in infos:
        name = info.orig_filename
        shown = name.encode("ascii", "backslashreplace").decode()[:200]
        parts = name.split("/")
        if (
            info.filename != name
            or not name.isascii()
            or not _ROOT.match(parts[0])
            or not all(_PART.match(p) for p in parts[1:])
            or any(p in (".", "..") for p in parts)
        ):
            raise Unprocessable(f"zip entry {shown!r}: names may use only {NAME_GRAMMAR}, with no empty, '.' or '..' "
                                "part (save the program to a file with a plain ASCII name)", entry=shown)
        if len(parts) < 2 or parts[0] != root:
            raise Unprocessable(NOT_EXPORT + f" (entry {shown!r} is not under the root folder {root!r})", entry=shown)
        if name.lower() in seen:
            raise Unprocessable(f"zip entry {shown!r} appears twice (names are compared ignoring case, as torch's "
                                "reader does)", entry=shown)
        seen.add(name.lower())
        if info.flag_bits & 0x1:
            raise Unprocessable(f"zip entry {shown!r} is encrypted", entry=shown)
        if info.flag_bits & ~_ALLOWED_FLAGS:
            raise Unprocessable(f"zip entry {shown!r} uses zip features torch does not write (flags "
                                f"{info.flag_bits:#x})", entry=shown)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise Unprocessable(f"zip entry {shown!r} uses an unsupported compression method", entry=shown)
        if info.file_size > limits.max_entry_bytes:
            raise _too_big(f"zip entry {shown!r}", info.file_size, limits.max_entry_bytes, "max_entry_bytes", shown)
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise Unprocessable(f"zip entry {shown!r} is stored but declares {info.file_size} bytes in "
                                f"{info.compress_size}", entry=shown)
        ratio = info.file_size / max(info.compress_size, 1)
        if info.file_size > _RATIO_FLOOR and ratio > limits.max_compression_ratio:
            raise Unprocessable(
                f"zip entry {shown!r} inflates {info.compress_size} bytes to {info.file_size} (ratio {ratio:.0f}); "
                f"the limit is {limits.max_compression_ratio} ({Limits.name('max_compression_ratio')})",
                entry=shown, setting=Limits.name("max_compression_ratio"))
        total += info.file_size
        packed += info.compress_size
    if total > limits.max_unpacked_bytes:
        raise _too_big("the archive, uncompressed,", total, limits.max_unpacked_bytes, "max_unpacked_bytes")
    # The whole archive's ratio too: entries under the floor each, thousands of 1 MiB entries of zeros (9 MB that
    # inflate to 8 GiB, each inflated once below) cost the API 26 s of CPU with no entry over the limit.
    if total > _RATIO_FLOOR and total > limits.max_compression_ratio * max(packed, 1):
        raise Unprocessable(
            f"the archive's entries inflate {packed} bytes to {total} (ratio {total / max(packed, 1):.0f}); the "
            f"limit is {limits.max_compression_ratio} ({Limits.name('max_compression_ratio')})",
            setting=Limits.name("max_compression_ratio"))
    _layout(f, infos)
    for info in infos:
        if info.compress_type == zipfile.ZIP_DEFLATED:
            _inflates_to_declared_size(f, info)
    return root


def _inflates_to_declared_size(f: IO[bytes], info: zipfile.ZipInfo) -> None:
    """Inflate a deflated entry once, never past its declared size (which the limits bound): a stream that is
    shorter, longer or corrupt is refused here, where zipfile would stop quietly at the declared size."""
    f.seek(info.header_offset + 26)
    n_len, x_len = struct.unpack("<HH", f.read(4))
    f.seek(info.header_offset + 30 + n_len + x_len)
    inflate = zlib.decompressobj(-15)
    left, out, crc = info.compress_size, 0, 0
    try:
        while left and not inflate.eof:
            chunk = f.read(min(left, MB))
            if not chunk:
                break
            left -= len(chunk)
            while chunk and not inflate.eof:
                data = inflate.decompress(chunk, MB)
                out += len(data)
                if out > info.file_size:
                    break
                crc = zlib.crc32(data, crc)
                chunk = inflate.unconsumed_tail
            if out > info.file_size:
                break
    except zlib.error:
        out = -1
    if out != info.file_size or not inflate.eof or left or inflate.unused_data or crc != info.CRC:
        raise Unprocessable(f"zip entry {info.orig_filename!r} does not inflate to exactly the {info.file_size} "
                            "bytes its header declares (or its checksum is wrong)", entry=info.orig_filename)


def not_export_reason(names: set[str], root: str) -> str:
    if any(n.startswith(f"{root}/code/") for n in names) or f"{root}/constants.pkl" in names:
        return NOT_EXPORT + ". This is a TorchScript archive (torch.jit.save), which is not supported"
    if f"{root}/data.pkl" in names:
        return NOT_EXPORT + ". This is a torch.save checkpoint, not an exported program"
    return NOT_EXPORT


def looks_pickled(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    try:
        with zf.open(info) as f:
            head = f.read(4)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    return head == pickles.ZIP_MAGIC or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def scan_pickle_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo, budget: pickles.Budget | None = None) -> None:
    try:
        f: IO[bytes] = zf.open(info)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    with f:
        pickles.check_file(f, info.filename, budget)
