"""The zip container of an upload: entry names, size-capped reads, and why a zip is not an exported program.

Every read is capped, names are checked before any entry is opened (one root folder, no traversal, no duplicates,
no encryption, stored or deflated only), and pickled entries are handed to compiler.archive.pickles' static scan.
"""

from __future__ import annotations

import json
import re
import zipfile
from typing import IO, Any

from compiler.archive import pickles
from compiler.errors import Unprocessable

MAX_ENTRIES = 100_000

NOT_A_ZIP = "the upload is not a zip archive; save the program with torch.export.save(ep, 'model.pt2')"
NOT_EXPORT = "the upload is not a torch.export archive; save the program with torch.export.save(ep, 'model.pt2')"


def read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> bytes:
    """The entry's bytes, refused past `cap` whatever its header claims."""
    if info.file_size > cap:
        raise Unprocessable(f"{info.filename} is {info.file_size} bytes; the limit is {cap} bytes", entry=info.filename)
    try:
        with zf.open(info) as f:
            data = f.read(cap + 1)
    except Exception as e:  # BadZipFile (CRC, header), NotImplementedError (compression), zlib.error, EOFError
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__}: {e})") from None
    if len(data) > cap:
        raise Unprocessable(f"{info.filename} is over the limit of {cap} bytes", entry=info.filename)
    return data


def read_json(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> Any:
    data = read_entry(zf, info, cap)
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


def check_names(infos: list[zipfile.ZipInfo]) -> str:
    """All entries under one root folder, no traversal, no duplicates; returns the root."""
    if not infos:
        raise Unprocessable(NOT_EXPORT + " (the zip is empty)")
    if len(infos) > MAX_ENTRIES:
        raise Unprocessable(f"the zip has {len(infos)} entries; the limit is {MAX_ENTRIES}")
    seen: set[str] = set()
    root = infos[0].filename.split("/", 1)[0]
    for info in infos:
        name = info.filename
        parts = name.split("/")
        if (
            name.startswith(("/", "\\"))
            or "\\" in name
            or "\x00" in name
            or re.match(r"^[A-Za-z]:", name)
            or any(p in ("..", ".") for p in parts)
        ):
            raise Unprocessable(f"zip entry {name!r} has an absolute or parent-relative path", entry=name)
        if name in seen:
            raise Unprocessable(f"zip entry {name!r} appears twice", entry=name)
        seen.add(name)
        if info.flag_bits & 0x1:
            raise Unprocessable(f"zip entry {name!r} is encrypted", entry=name)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise Unprocessable(f"zip entry {name!r} uses an unsupported compression method", entry=name)
        if len(parts) < 2 or parts[0] != root or not root:
            raise Unprocessable(NOT_EXPORT + f" (entry {name!r} is not under the root folder {root!r})", entry=name)
    return root


def not_export_reason(names: set[str], root: str) -> str:
    if any(n.startswith(f"{root}/code/") for n in names) or f"{root}/constants.pkl" in names:
        return NOT_EXPORT + ". This is a TorchScript archive (torch.jit.save), which is not supported"
    if f"{root}/data.pkl" in names:
        return NOT_EXPORT + ". This is a torch.save checkpoint, not an exported program"
    return NOT_EXPORT


def _simple_name(path_name: Any, where: str) -> str:
    if not isinstance(path_name, str) or not re.match(r"^[A-Za-z0-9_.-]+$", path_name) or path_name in (".", ".."):
        raise Unprocessable(f"{where}: payload path {str(path_name)[:100]!r} is not a plain file name")
    return path_name


def payload_config(zf: zipfile.ZipFile, info: zipfile.ZipInfo, cap: int) -> dict[str, dict[str, Any]]:
    doc = read_json(zf, info, cap)
    config = require(doc, "config", dict, info.filename)
    for fqn, meta in config.items():
        if not isinstance(meta, dict):
            raise Unprocessable(f"{info.filename}: entry {str(fqn)[:100]!r} is not an object")
        _simple_name(meta.get("path_name"), info.filename)
        if not isinstance(meta.get("use_pickle", False), bool):
            raise Unprocessable(f"{info.filename}: use_pickle of {str(fqn)[:100]!r} is not a boolean")
    return config


def looks_pickled(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    try:
        with zf.open(info) as f:
            head = f.read(4)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    return head == pickles.ZIP_MAGIC or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def scan_pickle_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    try:
        f: IO[bytes] = zf.open(info)
    except Exception as e:
        raise Unprocessable(f"{info.filename}: cannot read the zip entry ({type(e).__name__})") from None
    with f:
        pickles.check_file(f, info.filename)
