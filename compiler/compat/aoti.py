"""AOTInductor: build a package from an exported program, and load one.

aoti_compile_and_package / aoti_load_package live under torch._inductor (documented, but private by name).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compiler.compat import pytree


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
        self.in_spec = pytree.treespec_loads(in_spec)
        self.out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        flat = [x for x in pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())


def aoti_load_package(package_path: str, device: str = "cpu") -> Callable[..., Any]:
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
