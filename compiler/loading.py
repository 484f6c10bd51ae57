"""Load an uploaded torch.export archive without letting it run code.

Three layers, each enough on its own for the attacks it covers:
1. the API's static checks again (compiler.archive: pickles against the allow-list, expression strings and
   guards against a whitelist grammar, no custom-object constants, no AOTInductor code) - the archive on the
   worker is the same bytes, but the worker must not trust that the API looked;
2. every pickled entry is loaded with torch.load(weights_only=True) before torch.export.load sees it;
3. torch.export.load runs inside compiler.compat.safe_load.guarded_export_load, which forces weights_only=True,
   blocks pickle.loads / torchbind / AOTInductor loading in torch's reader and re-checks each expression string.
After loading, every callable in the loaded graphs is checked against the same operator list before anything can
call it (`_check_callables`): each graph, nested subgraphs included, may call only operators on
compiler/archive/ops.txt, a higher-order op only if compiler.archive.ops.HOPS says how it calls its arguments and
each of those is a subgraph of the program, and every other argument must be data or a value of the graph, never an
operator, a function or a module. guards_code (exec'd by torch when the program runs) is checked once more on the
loaded object, and the graph is made safe for codegen before any stage sees it (`_sanitize`): every node's
free-text metadata is dropped (Inductor and AOTInductor write stack traces, module stacks and provenance into
generated source and the package), and node names, string arguments and weight names are checked against
compiler.archive.strings' grammars again.
"""

from __future__ import annotations

import io
import math
import operator
import traceback
import zipfile

import torch

from compiler.archive.exprs import check_guard, check_sym_expr
from compiler.archive.inspect import inspect_archive
from compiler.archive.limits import DEFAULT_LIMITS, Limits
from compiler.archive.ops import HOP_PREFIX, HOPS, excluded, is_operator_target
from compiler.archive.strings import check
from compiler.compat import pytree
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


# Values a node argument may hold besides graph values (fx.Node) and containers of them: what torch's deserializer
# makes of the schema's data members. Anything else (an operator, a function, a module, a class) is refused.
_DATA = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_ROOTS = {"torch": torch, "_operator": operator, "math": math}  # where the deserializer resolves names


def _serialized_name(target: object) -> str | None:
    """The name torch's serializer writes for `target`, if it has one."""
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        return None
    if module.startswith("torch._ops"):
        module = "torch.ops" + module[len("torch._ops"):]
    return f"{module}.{name}"


def _operator_name(target: object) -> str | None:
    """The name torch's serializer writes for `target` when that name is on the operator list and resolves, as the
    deserializer resolves it, to `target` itself; None for anything else."""
    serialized = _serialized_name(target)
    if serialized is None or not is_operator_target(serialized):
        return None
    root, *parts = serialized.split(".")
    found: object = _ROOTS.get(root)
    for part in parts:
        found = getattr(found, part, None)
    return serialized if found is target else None


def _attribute(gm: torch.fx.GraphModule, target: object) -> object:
    if not isinstance(target, str) or any(p.startswith("__") for p in target.split(".")):
        return None
    found: object = gm
    for part in target.split("."):
        found = getattr(found, part, None)
    return found


def _check_callables(ep: torch.export.ExportedProgram) -> None:
    """Every graph of the loaded program, nested subgraphs included, against the operator list: each call_function
    target on it; a higher-order op one of HOPS, with a subgraph of the program (a get_attr of a GraphModule) at each
    position it calls and nowhere else; every argument and keyword argument data or graph values, never a callable.
    The upload checks refuse all of this before torch reads the file; this catches what they might miss."""

    def refuse(where: str, why: str) -> UnsafeModel:
        return UnsafeModel(f"{where} {why}; refused before anything could call it (compiler/archive/ops.txt lists "
                           "the operators this service compiles)", stage=STAGE)

    for path, gm in ep.graph_module.named_modules():
        graph_name = f"subgraph {path!r}" if path else "the program's graph"
        if not isinstance(gm, torch.fx.GraphModule):
            raise refuse(graph_name, f"is a {type(gm).__name__}, not a graph")
        subgraphs: set[torch.fx.Node] = set()
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                found = _attribute(gm, node.target)
                if isinstance(found, torch.fx.GraphModule):
                    subgraphs.add(node)
                elif not isinstance(found, torch.Tensor):
                    raise refuse(f"{graph_name}: node {node.name!r}", f"reads {str(node.target)[:120]!r}, a "
                                 f"{type(found).__name__}, where only subgraphs and tensors are read")

        def data(value: object, where: str) -> None:
            stack = [value]
            while stack:
                v = stack.pop()
                if isinstance(v, torch.fx.Node):
                    if v in subgraphs:
                        raise refuse(where, f"passes the subgraph {v.name!r} where no higher-order op calls it")
                elif isinstance(v, (list, tuple)):
                    stack.extend(v)
                elif isinstance(v, dict):
                    stack.extend(v.keys())
                    stack.extend(v.values())
                elif not isinstance(v, _DATA):
                    raise refuse(where, f"holds {type(v).__name__} {str(v)[:120]!r}, which is not data")

        for node in gm.graph.nodes:
            where = f"{graph_name}: node {node.name!r}"
            if node.op == "get_attr":
                continue
            if node.op not in ("placeholder", "output", "call_function"):
                raise refuse(where, f"is a {node.op} node; an exported program calls functions only")
            hop = None
            if node.op == "call_function":
                name = _operator_name(node.target)
                if name is None:
                    serialized = _serialized_name(node.target) or ""
                    if (why := excluded(serialized)) is not None:
                        raise refuse(where, f"calls {serialized}, which {why}; no model's exported graph calls it, "
                                     "so it is left off the operator list (compiler/archive/ops.py EXCLUDED)")
                    raise refuse(where, f"calls {type(node.target).__name__} {str(node.target)[:120]!r}, which is "
                                 "not a torch operator this service compiles")
                hop = HOPS.get(name)
                if name.startswith(HOP_PREFIX) and hop is None:
                    raise refuse(where, f"calls {name}, a higher-order op whose callables this service does not "
                                 "know how to check")
            for i, arg in enumerate(node.args):
                if hop is not None and i in hop.graphs:
                    if arg not in subgraphs:
                        raise refuse(where, f"passes {type(arg).__name__} {str(arg)[:120]!r} as argument {i}, which "
                                     f"{hop.signature} calls; it must be a subgraph of the program")
                else:
                    data(arg, f"{where} argument {i}")
            if hop is not None and len(node.args) <= max(hop.graphs):
                raise refuse(where, f"calls {hop.signature} with {len(node.args)} positional argument(s)")
            data(dict(node.kwargs), f"{where} keyword arguments")


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
        with guarded_export_load(check_sym_expr, is_operator_target, excluded) as events:
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
    _check_callables(ep)
    _check_loaded(ep)
    _sanitize(ep)
    return ep


def on_device(ep: torch.export.ExportedProgram, device: str) -> torch.export.ExportedProgram:
    """`ep` ready to run on `device`. A program exported on the CPU, for another device, is moved there whole, in
    place (torch.export.passes.move_to_device_pass): its weights and constants, and the devices burnt into its
    nodes, which `module.to(device)` leaves on the CPU: a factory call's `device=` (`torch.arange(n)`), and the
    `aten._assert_tensor_metadata` that export puts before each cast (`.long()`, `.to(dtype)`), which asserts the
    device its input had at export. Without the move, a program exported on a laptop and compiled for a CUDA target
    failed its capture and its check on "Tensor device mismatch! Expected: cpu". A program exported on a GPU is
    left as it is, with any tensor it placed on the CPU itself; so is one with no device in its nodes (a plain
    convolution net), which `module.to(device)` moves as it always has."""
    from torch.export.passes import move_to_device_pass

    target = torch.device(device)
    if target.type == "cpu" or _devices(ep) - {"cpu"} or not _burnt_in(ep):
        return ep
    return move_to_device_pass(ep, {"cpu": str(target)})


def _burnt_in(ep: torch.export.ExportedProgram) -> bool:
    """Whether a node of the program (or of a subgraph) names a device: a `device=` argument, or `aten.to.device`."""
    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if "device" in node.kwargs or (node.op == "call_function" and node.target is torch.ops.aten.to.device):
                return True
    return False


def _devices(ep: torch.export.ExportedProgram) -> set[str]:
    """The device types of the program's inputs, weights and constants, as export saw them."""
    found: set[str] = set()
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor):
                found.add(v.device.type)
    return found
