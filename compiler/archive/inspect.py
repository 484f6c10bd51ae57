"""Inspect an uploaded `torch.export.save` archive without torch and without unpickling anything.

The upload is untrusted, and `torch.export.load` trusts it: it unpickles sample inputs, pickled weights and
constants with weights_only=False, `pickle.loads` opaque constants, loads AOTInductor shared libraries, feeds
every `expr_str` to `sympy.sympify` (an `eval`), and `exec`s `guards_code` when the program runs. So before a
worker ever loads an upload, this checks every one of those inputs statically: the zip's entry names and sizes
(compiler.archive.container), pickles against an allow-list (compiler.archive.pickles), symbolic expressions,
guards and tree specs against whitelist grammars, parsed with `ast` and never evaluated (compiler.archive.exprs),
and the program against torch's export schema, every callable it names against the operator list
(compiler.archive.program, schema, ops). It also reads what the API needs to answer: user
inputs with dtypes and dynamic ranges, the output count, the weight size.

Everything that goes wrong is one of compiler.errors' classes; hostile bytes never surface as a raw exception.
Non-tensor user inputs (ints, floats, strings passed as graph inputs) are refused: the service compiles for
tensor inputs only.
"""

from __future__ import annotations

import zipfile
from typing import Any

from compiler.archive import pickles
from compiler.archive.container import (
    NOT_A_ZIP,
    NOT_EXPORT,
    check_zip,
    looks_pickled,
    not_export_reason,
    read_entry,
    read_json,
    require,
    scan_pickle_entry,
)
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.program import check_payload_config, storage_bytes, user_inputs, walk_program
from compiler.errors import AotcError, Unprocessable, UnsafeArchive, UnsupportedMedia


def inspect_archive(path: str, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Validate an uploaded .pt2 statically and describe it (see module docstring for what is checked).

    Returns {"root", "torch_version", "schema_version", "inputs": [{"name", "dtype", "shape"}], "outputs": int,
    "params": {"count", "bytes"}, "pickles": [entries scanned]}; a shape dim is an int, {"symbol", "min", "max"}
    or {"expr", "min", "max"} (max None when unbounded).
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != pickles.ZIP_MAGIC:
            raise UnsupportedMedia(NOT_A_ZIP)
        with open(path, "rb") as f, zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            root = check_zip(f, infos, limits)
            return _inspect(zf, root, limits)
    except AotcError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise UnsupportedMedia(f"{NOT_A_ZIP} ({e})") from None
    except RecursionError:
        raise Unprocessable("the archive is nested too deeply to inspect") from None
    except Exception as e:  # last line of defence: hostile input must never become a 500
        raise Unprocessable(f"the archive cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def _inspect(zf: zipfile.ZipFile, root: str, limits: Limits) -> dict[str, Any]:
    infos = zf.infolist()
    by_name = {i.filename: i for i in infos}
    names = set(by_name)
    p = f"{root}/"

    fmt = by_name.get(p + "archive_format")
    if fmt is None or read_entry(zf, fmt, 64).strip() != b"pt2":
        raise Unprocessable(not_export_reason(names, root))
    models = [n for n in names if n.startswith(p + "models/")]
    if len(models) != 1 or models[0] != p + "models/model.json":
        if not models:
            raise Unprocessable(not_export_reason(names, root) + " (no models/model.json)")
        raise Unprocessable(
            f"the archive holds {sorted(m[len(p):] for m in models)}; this service takes exactly one program, "
            "saved as models/model.json by torch.export.save"
        )
    version = by_name.get(p + "archive_version")
    if version is None:
        raise Unprocessable(NOT_EXPORT + " (no archive_version; it was written by an older torch)")
    version_text = read_entry(zf, version, 64).strip()
    if version_text != b"0":
        raise Unprocessable(f"the archive has archive_version {version_text[:20]!r}; this service reads version 0")
    native = sorted(n for n in names if n.startswith(p + "data/aotinductor/"))
    if native:
        raise UnsafeArchive(
            f"the archive contains AOTInductor compiled code ({native[0]}); upload the exported program only",
            entry=native[0],
        )

    doc = read_json(zf, by_name[p + "models/model.json"], limits)
    where = "models/model.json"
    gm = require(doc, "graph_module", dict, where)
    rc = require(doc, "range_constraints", dict, where)
    schema = require(doc, "schema_version", dict, where)
    require(doc, "opset_version", dict, where)
    torch_version = doc.get("torch_version")
    major, minor = require(schema, "major", int, "schema_version"), require(schema, "minor", int, "schema_version")
    walk_program(doc, where, limits)  # guards and tree specs too: each field by the grammar of where it sits

    inputs = user_inputs(gm, rc)
    out_specs = require(require(gm, "signature", dict, "graph_module"), "output_specs", list, "signature")
    outputs = sum(1 for s in out_specs if isinstance(s, dict) and "user_output" in s)

    # Entries torch reads as raw tensor bytes (never unpickled) vs entries torch unpickles.
    raw: set[str] = set()
    to_scan: list[str] = []
    params = {"count": 0, "bytes": 0}
    weights_dir, consts_dir = p + "data/weights/", p + "data/constants/"
    legacy = [n for n in (weights_dir + "model.pt", consts_dir + "model.pt") if n in names]
    to_scan.extend(legacy)

    wcfg_name = weights_dir + "model_weights_config.json"
    if wcfg_name in names:
        wcfg = check_payload_config(read_json(zf, by_name[wcfg_name], limits), wcfg_name[len(p):], limits)
        files: set[str] = set()
        for fqn, meta in wcfg.items():
            entry = weights_dir + meta["path_name"]
            if entry not in names:
                raise Unprocessable(f"weight {fqn!r} points at {entry}, which is not in the archive")
            (to_scan.append(entry) if meta.get("use_pickle") else raw.add(entry))
            files.add(entry)
            _check_storage(f"weight {fqn!r}", meta, by_name[entry])
        params = {"count": len(wcfg), "bytes": sum(by_name[e].file_size for e in files)}
    elif weights_dir + "model.pt" not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/weights/model_weights_config.json)")

    for n in sorted(names):
        if n.startswith(consts_dir) and n[len(consts_dir):].startswith(("custom_obj_", "opaque_obj_")):
            raise UnsafeArchive(
                f"{n[len(p):]} is a custom-object constant (torchbind or opaque object); such constants are "
                "pickled Python objects and cannot be loaded safely, so the service refuses them",
                entry=n,
            )
    ccfg_name = consts_dir + "model_constants_config.json"
    if ccfg_name in names:
        ccfg = check_payload_config(read_json(zf, by_name[ccfg_name], limits), ccfg_name[len(p):], limits)
        for fqn, meta in ccfg.items():
            path_name = meta["path_name"]
            if path_name.startswith(("custom_obj_", "opaque_obj_")):
                raise UnsafeArchive(
                    f"constant {fqn!r} is a custom object ({path_name}); the service cannot load it safely",
                    entry=path_name,
                )
            if not path_name.startswith("tensor_"):
                raise Unprocessable(f"constant {fqn!r} has unsupported payload {path_name!r}")
            entry = consts_dir + path_name
            if entry not in names:
                raise Unprocessable(f"constant {fqn!r} points at {entry}, which is not in the archive")
            (to_scan.append(entry) if meta.get("use_pickle") else raw.add(entry))
            _check_storage(f"constant {fqn!r}", meta, by_name[entry])
    elif consts_dir + "model.pt" not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/constants/model_constants_config.json)")

    sample = p + "data/sample_inputs/model.pt"
    if sample not in names:
        raise Unprocessable(NOT_EXPORT + " (no data/sample_inputs/model.pt)")
    if by_name[sample].file_size > 0:
        to_scan.append(sample)

    known = {p + "models/model.json", fmt.filename, version.filename, wcfg_name, ccfg_name} | raw | set(to_scan)
    for n in sorted(names - known):
        if by_name[n].file_size and looks_pickled(zf, by_name[n]):
            to_scan.append(n)  # not read by torch.export.load today, but pickled bytes get no benefit of doubt

    scanned = sorted(set(to_scan))
    budget = pickles.Budget()  # all of the upload's pickle streams together (pickles.MAX_PICKLE_TOTAL)
    for n in scanned:
        scan_pickle_entry(zf, by_name[n], budget)

    return {
        "root": root,
        "torch_version": torch_version if isinstance(torch_version, str) else None,
        "schema_version": f"{major}.{minor}",
        "inputs": inputs,
        "outputs": outputs,
        "params": params,
        "pickles": scanned,
    }


def _check_storage(what: str, meta: dict[str, Any], info: zipfile.ZipInfo) -> None:
    """A raw tensor's file holds its whole storage: its view (sizes, strides, offset, dtype) must fit in the
    bytes the file really has. torch allocates the declared size for an empty file (torch.zeros), so an empty
    file is right only for an empty tensor."""
    if meta.get("use_pickle"):
        return  # torch.load checks each storage against its record
    itemsize, numel, needed = storage_bytes(what, meta.get("tensor_meta"))
    have = info.file_size
    if have == 0 and numel == 0:
        return
    if have == 0 or have % itemsize or needed > have:
        raise Unprocessable(
            f"{what} declares a tensor that needs {needed} bytes of storage, but its file "
            f"{info.filename.split('/', 1)[1]} holds {have} bytes", entry=info.filename)
