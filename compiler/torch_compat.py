"""The one place aotc touches torch APIs that are private or moved between versions.

aotc runs on torch 2.13 (the CPU build in CI) and torch 2.11 (the GPU workers). Anything here may need a
version check; code elsewhere in compiler/ and worker/ uses only these wrappers and torch's public API.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as _pytree

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]


# -- AOTInductor --------------------------------------------------------------------------------------------
# aoti_compile_and_package / aoti_load_package live under torch._inductor (documented, but private by name).


def aoti_compile_and_package(ep: torch.export.ExportedProgram, package_path: str, inductor_configs: dict) -> str:
    from torch._inductor import aoti_compile_and_package as _compile

    return str(_compile(ep, package_path=package_path, inductor_configs=inductor_configs))


class LoadedPackage:
    """A loaded AOTInductor package, callable like the model.

    torch's `aoti_load_package` goes through `_load_aoti`, which calls `get_device_information` only to print a
    warning, and that builds and runs a test program per CPU vector ISA with g++: 30 s in a fresh process on
    the GPU machine (torch 2.11), for every package, CPU or CUDA. This wrapper goes straight to the C++ loader
    and the package's own call spec, which is what `AOTICompiledModel` does after that check.
    """

    def __init__(self, package_path: str, device: str = "cpu") -> None:
        index = -1
        if device.startswith("cuda"):
            index = torch.device(device).index or 0
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package_path), "model", False, 1, index)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec = _pytree.treespec_loads(in_spec)
        self.out_spec = _pytree.treespec_loads(out_spec)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        flat = [x for x in _pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return _pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())


def aoti_load_package(package_path: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    """Load a package for `device` (cuda:N picks the GPU). Falls back to torch's own loader if the C++ loader's
    signature differs in this torch version."""
    try:
        return LoadedPackage(package_path, device)
    except (AttributeError, TypeError):
        from torch._inductor import aoti_load_package as _load

        index = torch.device(device).index
        if device.startswith("cuda") and index is not None:
            return _load(package_path, device_index=index)
        return _load(package_path)


# -- Safe loading of untrusted exported programs ---------------------------------------------------------------
# torch.export.load trusts its archive: it unpickles with weights_only=False, pickle.loads opaque constants,
# loads torchbind objects, loads AOTInductor shared libraries and sympify()s (evals) expression strings.
# compiler.loading validates the archive first; this guard is the second line, patching those call sites for
# the duration of one load. Every lookup is defensive: torch 2.11 may lack some of these attributes.

import contextlib as _contextlib
import functools as _functools
import importlib as _importlib
import pickle as _pickle
import threading as _threading
import types as _types
from collections.abc import Callable as _Callable
from collections.abc import Iterator as _Iterator
from typing import Any as _Any


class DeserializationRefused(Exception):
    """A call the load guard blocked. Deliberately not a RuntimeError: torch.export.load catches those."""


_GUARD_LOCK = _threading.RLock()


def _optional_module(name: str) -> _types.ModuleType | None:
    try:
        return _importlib.import_module(name)
    except Exception:
        return None


class _RefusingPickle(_types.ModuleType):
    """Stands in for the `pickle` module inside torch's pt2 reader: dumps works, loads/load/Unpickler refuse."""

    def __init__(self, refuse: _Callable[[str], _Any]) -> None:
        super().__init__("pickle")
        self._refuse = refuse

    def __getattr__(self, name: str) -> _Any:
        if name in ("loads", "load", "Unpickler", "_loads", "_load", "_Unpickler"):
            return lambda *a, **k: self._refuse(f"pickle.{name}")
        return getattr(_pickle, name)


@_contextlib.contextmanager
def guarded_export_load(check_expr: _Callable[[str], None] | None = None) -> _Iterator[list[str]]:
    """Context for calling torch.export.load on an untrusted archive.

    Inside it: every torch.load runs with weights_only=True whatever its caller asked (an unpickling error then
    becomes DeserializationRefused); pickle.loads in torch's pt2 reader, torch._C._pickle_load_obj (torchbind)
    and the AOTInductor loader raise DeserializationRefused; each expression string reaching the serde
    deserializer's _parse_sym_expr is passed to `check_expr` first. Yields a list that collects a line for every
    refused or overridden call, so a refusal that torch swallows internally is still seen by the caller.
    Holds a process-wide lock: the patches are global while it is active.
    """
    events: list[str] = []
    undo: list[tuple[object, str, _Any]] = []

    def patch(owner: object, name: str, value: _Any) -> None:
        if owner is None or not hasattr(owner, name):
            return
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def refuse(what: str) -> _Any:
        events.append(f"refused {what}")
        raise DeserializationRefused(f"{what} is not allowed while loading an uploaded program")

    def forced(orig: _Callable[..., _Any]) -> _Callable[..., _Any]:
        @_functools.wraps(orig)
        def load(f: _Any, map_location: _Any = None, pickle_module: _Any = None, *, weights_only: _Any = None,
                 mmap: _Any = None, **kwargs: _Any) -> _Any:
            if weights_only is not True:
                events.append(f"torch.load(weights_only={weights_only!r}) ran with weights_only=True")
            try:
                return orig(f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
            except _pickle.UnpicklingError as e:
                events.append(f"refused torch.load: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}")
                raise DeserializationRefused(f"a pickle in the archive does not load with weights_only=True: {e}") from None

        return load

    with _GUARD_LOCK:
        try:
            serialization = _optional_module("torch.serialization")
            orig_load = getattr(serialization, "load", None) or torch.load
            safe_load = forced(orig_load)
            patch(torch, "load", safe_load)
            patch(serialization, "load", safe_load)
            patch(torch._C, "_pickle_load_obj", lambda *a, **k: refuse("torch._C._pickle_load_obj (torchbind object)"))
            package = _optional_module("torch.export.pt2_archive._package")
            if package is not None:
                patch(package, "pickle", _RefusingPickle(refuse))
                patch(package, "_load_aoti", lambda *a, **k: refuse("loading AOTInductor code from the archive"))
            serde = _optional_module("torch._export.serde.serialize")
            deserializer = getattr(serde, "GraphModuleDeserializer", None)
            original_parse = getattr(deserializer, "_parse_sym_expr", None)
            if check_expr is not None and original_parse is not None:

                @_functools.wraps(original_parse)
                def parse_sym_expr(self: _Any, expr_str: _Any, *args: _Any, **kwargs: _Any) -> _Any:
                    if isinstance(expr_str, str):
                        try:
                            check_expr(expr_str)
                        except Exception as e:
                            refuse(f"symbolic expression {expr_str[:200]!r} ({e})")
                    return original_parse(self, expr_str, *args, **kwargs)

                patch(deserializer, "_parse_sym_expr", parse_sym_expr)
            yield events
        finally:
            for owner, name, value in reversed(undo):
                setattr(owner, name, value)
