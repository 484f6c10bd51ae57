"""AOTInductor: build a package from an exported program, and load one.

aoti_compile_and_package / aoti_load_package live under torch._inductor (documented, but private by name). The C++
loader `torch._C._aoti.AOTIModelPackageLoader(path, model_name, run_single_threaded, num_runners, device_index)`
has had that signature from torch 2.6 through 2.13. `run_single_threaded=True` runs the model without the
container's locks and per-run CUDA events: the mode a CUDA graph can capture (compiler/cudagraphs.py).
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

    def __init__(self, package_path: str, device: str = "cpu", run_single_threaded: bool = False) -> None:
        index = -1
        if device.startswith("cuda"):
            index = torch.device(device).index or 0
        self.run_single_threaded = run_single_threaded
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(package_path), "model", run_single_threaded, 1, index)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec = pytree.treespec_loads(in_spec)
        self.out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return pytree.tree_unflatten(self.loader.boxed_run(self.flat_inputs(args, kwargs)), self.out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())

    def flat_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors the package takes, in its order, from a call's arguments."""
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        return [x for x in pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]

    def run_flat(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run on flat input tensors, on the current CUDA stream; the flat outputs. (boxed_run empties the list it is
        given, so it gets a copy.)"""
        return list(self.loader.boxed_run(list(flat)))

    def unflatten(self, outputs: list[Any]) -> Any:
        return pytree.tree_unflatten(outputs, self.out_spec)


def aoti_load_package(package_path: str, device: str = "cpu", *,
                      run_single_threaded: bool = False) -> Callable[..., Any]:
    """Load a package for `device` (cuda:N picks the GPU). Falls back to torch's own loader if the C++ loader's
    signature differs in this torch version. `run_single_threaded=True` loads it for CUDA graph capture."""
    try:
        return LoadedPackage(package_path, device, run_single_threaded)
    except (AttributeError, TypeError):
        from torch._inductor import aoti_load_package as _load

        index = torch.device(device).index
        if device.startswith("cuda") and index is not None:
            return _load(package_path, run_single_threaded=run_single_threaded, device_index=index)
        return _load(package_path, run_single_threaded=run_single_threaded)


def load_for_graphs(package_path: str, device: str) -> LoadedPackage:
    """The package loaded in single-threaded mode with the flat-tensor interface CUDA graph capture needs. Raises
    RuntimeError naming what this torch lacks when its loader cannot do that."""
    try:
        return LoadedPackage(package_path, device, run_single_threaded=True)
    except (AttributeError, TypeError) as e:
        raise RuntimeError(f"torch {torch.__version__} has no AOTIModelPackageLoader(..., run_single_threaded, ...) "
                           f"to capture a package's run in a CUDA graph: {e}") from e


# The last torch checked for CUDA-graph support of its own in AOTInductor packages (none through this one).
CHECKED_NO_NATIVE_GRAPHS = (2, 13)


def native_graph_support() -> str | None:
    """The name of torch's own CUDA-graph support for AOTInductor packages, where this torch has one; None otherwise.

    torch 2.11 to 2.13 have none: `torch._inductor.config.aot_inductor` has no CUDA-graph option, the package loader
    only offers `run_single_threaded` ("useful to avoid conflicts with CUDAGraphs"), and cudagraph trees work on
    torch.compile's Python wrapper, not on a package. So aotc captures the single-threaded run itself. Up to the
    version checked, this answers without importing Inductor (seconds in a fresh process: the loader's cold start);
    a later torch is looked at."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) <= CHECKED_NO_NATIVE_GRAPHS:
        return None
    from torch._inductor import config

    for name in ("use_cuda_graphs", "cuda_graphs", "cudagraphs"):
        if hasattr(config.aot_inductor, name):
            return f"torch._inductor.config.aot_inductor.{name}"
    return None
