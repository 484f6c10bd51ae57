"""Load an uploaded torch.export archive without letting it run code.

Three layers, each enough on its own for the attacks it covers:
1. the API's static checks again (compiler.archive: pickles against the allow-list, expression strings and
   guards against a whitelist grammar, no custom-object constants, no AOTInductor code) - the archive on the
   worker is the same bytes, but the worker must not trust that the API looked;
2. every pickled entry is loaded with torch.load(weights_only=True) before torch.export.load sees it;
3. torch.export.load runs inside compiler.compat.safe_load.guarded_export_load, which forces weights_only=True,
   blocks pickle.loads / torchbind / AOTInductor loading in torch's reader and re-checks each expression string.
After loading, guards_code (exec'd by torch when the program runs) is checked once more on the loaded object, and
the graph is made safe for codegen before any stage sees it (`_sanitize`): every node's free-text metadata is
dropped (Inductor and AOTInductor write stack traces, module stacks and provenance into generated source and the
package), and node names, string arguments and weight names are checked against compiler.archive.strings'
grammars again.
"""

from __future__ import annotations

import io
import traceback
import zipfile

import torch

from compiler.archive.exprs import check_guard, check_sym_expr
from compiler.archive.inspect import inspect_archive
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.strings import check
from compiler.compat.safe_load import DeserializationRefused, guarded_export_load
from compiler.errors import AotcError, BadModel, UnsafeArchive, UnsafeModel

STAGE = "load"
# What a node's meta keeps after loading: what torch's deserializer builds from the program's structure (tensor
# values and unbacked-symbol bindings), which the stages read. Everything it builds from the free-text `metadata`
# of model.json (stack_trace, nn_module_stack, source_fn_stack, torch_fn, custom, from_node) is dropped: the
# stage report's provenance comes from the re-export and Inductor's own passes, not from the upload.
KEPT_META = frozenset({"val", "tensor_meta", "unbacked_bindings"})
MAX_PICKLE_ENTRY_BYTES = 64 * 2**30


def _validate(path: str, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    """The API's inspection, mapped to compiler errors; returns the pickled entries to pre-load."""
    try:
        info = inspect_archive(path, limits)
    except UnsafeArchive as e:
        raise UnsafeModel(e.message, stage=STAGE) from None
    except AotcError as e:
        raise BadModel(e.message, stage=STAGE) from None
    return list(info["pickles"])


def _preload_pickles(path: str, entries: list[str]) -> None:
    """torch.load(weights_only=True) each pickled entry: a pickle that only loads unrestricted is refused."""
    try:
        with zipfile.ZipFile(path) as zf:
            for entry in entries:
                info = zf.getinfo(entry)
                if info.file_size > MAX_PICKLE_ENTRY_BYTES:
                    raise BadModel(f"{entry} is {info.file_size} bytes; too large to load", stage=STAGE)
                data = zf.read(info)
                try:
                    torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
                except Exception as e:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise UnsafeModel(
                        f"{entry} does not load with torch.load(weights_only=True): {first[:300]}",
                        stage=STAGE,
                        excerpt=str(e)[:2000],
                    ) from None
    except (UnsafeModel, BadModel):
        raise
    except Exception as e:
        raise BadModel(f"cannot read the archive: {type(e).__name__}: {e}", stage=STAGE) from None


def _check_loaded(ep: torch.export.ExportedProgram) -> None:
    for guard in getattr(ep, "_guards_code", None) or []:
        try:
            check_guard(guard)
        except AotcError as e:
            raise UnsafeModel(e.message, stage=STAGE) from None


def _strings_in(value: object) -> list[str]:
    """Every string inside a node argument: lists, tuples, dicts (keys too), at any depth."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return out


def _sanitize(ep: torch.export.ExportedProgram) -> None:
    """Drop free-text node metadata in every graph of the program (HOP subgraphs included), and check the strings
    codegen pastes into source: node names, string arguments and keyword names, weight and constant names."""
    try:
        for gm in ep.graph_module.modules():
            if not isinstance(gm, torch.fx.GraphModule):
                continue
            for node in gm.graph.nodes:
                for key in [k for k in node.meta if k not in KEPT_META]:
                    del node.meta[key]
                where = f"node {node.name!r}"
                check(node.name, "ident", f"{where} name", node=node.name)
                for key in node.kwargs:
                    check(key, "ident", f"{where} keyword", node=node.name)
                if node.op == "call_function":
                    for s in _strings_in((node.args, node.kwargs)):
                        check(s, "text", f"{where} string argument", node=node.name)
        for name in [*ep.state_dict, *ep.constants]:
            check(name, "fqn", "weight or constant name")
    except AotcError as e:
        raise UnsafeModel(e.message, stage=STAGE) from None


def load_program(path: str, limits: Limits | None = None) -> torch.export.ExportedProgram:
    """Load the exported program at `path` (an untrusted upload) safely.

    Raises UnsafeModel when any part would need unrestricted unpickling or code execution to load, BadModel when
    the file is not an exported program torch can read. `limits` are the API's upload bounds (the defaults
    unless the worker passes the ones its operator set).
    """
    entries = _validate(path, limits) if limits is not None else _validate(path)
    _preload_pickles(path, entries)
    try:
        with guarded_export_load(check_sym_expr) as events:
            try:
                ep = torch.export.load(path)
            except DeserializationRefused as e:
                raise UnsafeModel(str(e), stage=STAGE, excerpt="\n".join(events)) from None
    except (UnsafeModel, BadModel):
        raise
    except Exception as e:
        if any(ev.startswith("refused") for ev in events):
            raise UnsafeModel(
                f"loading needed a refused operation: {next(ev for ev in events if ev.startswith('refused'))}",
                stage=STAGE,
                excerpt="\n".join(events),
            ) from None
        raise BadModel(
            f"torch.export.load cannot read the archive: {type(e).__name__}: {str(e)[:500]}",
            stage=STAGE,
            excerpt=traceback.format_exc()[-4000:],
        ) from None
    refused = [ev for ev in events if ev.startswith("refused")]
    if refused:  # torch caught a refusal and carried on: the program is still not one we load
        raise UnsafeModel(f"loading needed a refused operation: {refused[0]}", stage=STAGE, excerpt="\n".join(events))
    if not isinstance(ep, torch.export.ExportedProgram):
        raise BadModel(f"the archive holds a {type(ep).__name__}, not an ExportedProgram", stage=STAGE)
    _check_loaded(ep)
    _sanitize(ep)
    return ep
