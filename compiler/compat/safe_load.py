"""Safe loading of untrusted exported programs.

torch.export.load trusts its archive: it unpickles with weights_only=False, pickle.loads opaque constants,
loads torchbind objects, loads AOTInductor shared libraries, sympify()s (evals) expression strings, and resolves
every node target, operator-valued argument and `source_fn_stack` metadata entry by a getattr chain under `torch`,
`_operator` or `math`. compiler.loading validates the archive first; this guard is the second line, patching those
call sites for the duration of one load. Every lookup is defensive: torch 2.11 may lack some of these attributes.

What the deserializer does with a name, in torch 2.11 and 2.13 alike (torch/_export/serde/serialize.py,
`GraphModuleDeserializer.deserialize_operator` and `deserialize_metadata`, the same code in both): it looks each
dotted part up with hasattr/getattr and never calls what it finds; a node whose target resolves to a callable gets
`graph.create_node`, which stores it. Nothing the upload names runs during the load. The lookups themselves can run
torch's own module `__getattr__` hooks (lazy imports, a deprecated alias's getter), so the guard narrows them too:
a name off the operator list is refused before its first getattr, and node metadata is not read at all (the worker
drops it after the load anyway, compiler.loading), so `source_fn_stack` resolves nothing.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from compiler.compat import optional_module


class DeserializationRefused(Exception):
    """A call the load guard blocked. Deliberately not a RuntimeError: torch.export.load catches those."""


_GUARD_LOCK = threading.RLock()


class _RefusingPickle(types.ModuleType):
    """Stands in for the `pickle` module inside torch's pt2 reader: dumps works, loads/load/Unpickler refuse."""

    def __init__(self, refuse: Callable[[str], Any]) -> None:
        super().__init__("pickle")
        self._refuse = refuse

    def __getattr__(self, name: str) -> Any:
        if name in ("loads", "load", "Unpickler", "_loads", "_load", "_Unpickler"):
            return lambda *a, **k: self._refuse(f"pickle.{name}")
        return getattr(pickle, name)


@contextlib.contextmanager
def guarded_export_load(check_expr: Callable[[str], None] | None = None,
                        is_operator: Callable[[str], bool] | None = None,
                        why_left_off: Callable[[str], str | None] | None = None) -> Iterator[list[str]]:
    """Context for calling torch.export.load on an untrusted archive.

    Inside it: every torch.load runs with weights_only=True whatever its caller asked (an unpickling error then
    becomes DeserializationRefused); pickle.loads in torch's pt2 reader, torch._C._pickle_load_obj (torchbind)
    and the AOTInductor loader raise DeserializationRefused; each expression string reaching the serde
    deserializer's _parse_sym_expr is passed to `check_expr` first; each name reaching its deserialize_operator
    (node targets and operator-valued arguments) must pass `is_operator` before it is looked up (the refusal
    quotes `why_left_off` of the name, when it has a reason); node metadata is
    not deserialized (each node gets none). Yields a list that collects a line for every refused or overridden
    call, so a refusal that torch swallows internally is still seen by the caller.
    Holds a process-wide lock: the patches are global while it is active.
    """
    events: list[str] = []
    undo: list[tuple[object, str, Any]] = []

    def patch(owner: object, name: str, value: Any) -> None:
        if owner is None or not hasattr(owner, name):
            return
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def refuse(what: str) -> Any:
        events.append(f"refused {what}")
        raise DeserializationRefused(f"{what} is not allowed while loading an uploaded program")

    def forced(orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
                 mmap: Any = None, **kwargs: Any) -> Any:
            if weights_only is not True:
                events.append(f"torch.load(weights_only={weights_only!r}) ran with weights_only=True")
            try:
                return orig(f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
            except pickle.UnpicklingError as e:
                events.append(f"refused torch.load: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
                raise DeserializationRefused(
                    f"a pickle in the archive does not load with weights_only=True: {e}") from None

        return load

    with _GUARD_LOCK:
        try:
            serialization = optional_module("torch.serialization")
            orig_load = getattr(serialization, "load", None) or torch.load
            safe_load = forced(orig_load)
            patch(torch, "load", safe_load)
            patch(serialization, "load", safe_load)
            patch(torch._C, "_pickle_load_obj", lambda *a, **k: refuse("torch._C._pickle_load_obj (torchbind object)"))
            package = optional_module("torch.export.pt2_archive._package")
            if package is not None:
                patch(package, "pickle", _RefusingPickle(refuse))
                patch(package, "_load_aoti", lambda *a, **k: refuse("loading AOTInductor code from the archive"))
            serde = optional_module("torch._export.serde.serialize")
            deserializer = getattr(serde, "GraphModuleDeserializer", None)
            original_parse = getattr(deserializer, "_parse_sym_expr", None)
            if check_expr is not None and original_parse is not None:

                @functools.wraps(original_parse)
                def parse_sym_expr(self: Any, expr_str: Any, *args: Any, **kwargs: Any) -> Any:
                    if isinstance(expr_str, str):
                        try:
                            check_expr(expr_str)
                        except Exception as e:
                            refuse(f"symbolic expression {expr_str[:200]!r} ({e})")
                    return original_parse(self, expr_str, *args, **kwargs)

                patch(deserializer, "_parse_sym_expr", parse_sym_expr)
            original_operator = getattr(deserializer, "deserialize_operator", None)
            if is_operator is not None and original_operator is not None:

                @functools.wraps(original_operator)
                def deserialize_operator(self: Any, serialized_target: Any, *args: Any, **kwargs: Any) -> Any:
                    if not isinstance(serialized_target, str) or not is_operator(serialized_target):
                        why = why_left_off(serialized_target) if why_left_off is not None and isinstance(
                            serialized_target, str) else None
                        reason = f"{why}, so it is left off the operator list" if why else "is not on the operator list"
                        refuse(f"resolving {str(serialized_target)[:200]!r}, which {reason}")
                    return original_operator(self, serialized_target, *args, **kwargs)

                patch(deserializer, "deserialize_operator", deserialize_operator)
            # Free text the worker drops after the load (compiler.loading.KEPT_META); torch would resolve its
            # source_fn_stack entries by getattr and json.loads the rest.
            patch(deserializer, "deserialize_metadata", lambda self, metadata, *args, **kwargs: {})
            yield events
        finally:
            for owner, name, value in reversed(undo):
                setattr(owner, name, value)
