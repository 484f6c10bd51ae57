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

from compiler.compat import pytree, torch_version


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
        # A weightless package run before its weights are bound reads unset constants (a segfault on torch 2.13).
        metadata = self.get_metadata()
        self.unbound = metadata.get(WEIGHTS_METADATA) == "external"
        self.train_step = TRAIN_METADATA in metadata
        self.path = str(package_path)
        self.device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
        self.expected: list[dict[str, Any]] | None = None

    def expect(self, spec: list[dict[str, Any]]) -> None:
        """Check every call's inputs against `spec` (the signed one: compiler.shapes' form, each input's name,
        dtype and dims, a dim one size or a {min, max} range) before the package runs. AOTInductor checks no input
        by default (AOTI_RUNTIME_CHECK_INPUTS), and its kernels read each input as the dense tensor of the shape
        they were built for: a smaller tensor, another dtype, or a view over too little storage is read past its
        end, and what lies there comes back in the outputs."""
        self.expected = [dict(inp) for inp in spec]

    def check_inputs(self, flat: list[torch.Tensor]) -> None:
        """ValueError naming the first input the package must not be given (see `expect`); nothing when none is
        expected."""
        if self.expected is None:
            return
        if len(flat) != len(self.expected):
            raise ValueError(f"the package takes {len(self.expected)} input tensor(s) "
                             f"({[i.get('name') for i in self.expected]}); this call gave {len(flat)}")
        for t, inp in zip(flat, self.expected, strict=True):
            name, dims = inp.get("name"), inp.get("shape") or []
            if t.dim() != len(dims):
                raise ValueError(f"input {name!r} has {t.dim()} dims {list(t.shape)}; the package was built for "
                                 f"{len(dims)}")
            for j, (n, d) in enumerate(zip(t.shape, dims, strict=True)):
                lo, hi = (d["min"], d["max"]) if isinstance(d, dict) else (d, d)
                if not lo <= n <= hi:
                    want = f"{lo}..{hi}" if lo != hi else str(lo)
                    raise ValueError(f"input {name!r} dim {j} is {n}; the package was built for {want} "
                                     f"(shape {list(t.shape)})")
            dtype = inp.get("dtype")
            if dtype is not None and str(t.dtype).removeprefix("torch.") != dtype:
                raise ValueError(f"input {name!r} is {str(t.dtype).removeprefix('torch.')}; the package was built "
                                 f"for {dtype}")
            if t.device.type != self.device.type:
                raise ValueError(f"input {name!r} is on {t.device}; the package runs on {self.device}")
            if t.numel() and t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
                raise ValueError(f"input {name!r} is a view over less storage than its {t.numel()} elements "
                                 "(an expanded or strided view): pass a dense tensor (.contiguous())")

    def _refuse_unbound(self) -> None:
        if self.unbound:
            raise RuntimeError(f"the package {self.path} binds its weights at load and none were bound: load it "
                               "with aotc's Client.load, or put its weights blob (GET /v1/artifacts/KEY/weights; "
                               "aotc pull writes it) beside it as NAME.weights.safetensors")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.train_step:  # its flat outputs are not the program's: unflattening them would fail or mislead
            raise RuntimeError(f"the package {self.path} is a train step (mode=training): load it with aotc's "
                               "Client.load_training(key, model), which binds it to the model's parameters")
        self._refuse_unbound()
        flat = self.flat_inputs(args, kwargs)
        self.check_inputs(flat)
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self.out_spec)

    def get_metadata(self) -> dict[str, str]:
        return dict(self.loader.get_metadata())

    def get_constant_fqns(self) -> list[str]:
        return list(self.loader.get_constant_fqns())

    def bind_constants(self, constants: dict[str, torch.Tensor]) -> None:
        """Bind `constants` (FQN -> tensor on the package's device) as the package's weights, user-managed: the
        package keeps pointers to these tensors, copies nothing, and sees any change made to them in place. The
        caller keeps them alive. Positional arguments (use_inactive, check_full_update, user_managed): the same in
        torch 2.11 and 2.13; 2.13 adds allow_h2d_copy after them, defaulted."""
        self.loader.load_constants(constants, False, True, True)
        self.unbound = False

    def flat_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors the package takes, in its order, from a call's arguments."""
        if not kwargs and all(type(x) is torch.Tensor for x in args):
            return list(args)  # what flattening gives, without its 7.7-11 us (CPU box) on a call replayed from a graph
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs

            kwargs = reorder_kwargs(kwargs, self.in_spec)
        return [x for x in pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]

    def run_flat(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run on flat input tensors, on the current CUDA stream; the flat outputs. (boxed_run empties the list it is
        given, so it gets a copy.)"""
        self._refuse_unbound()
        self.check_inputs(flat)
        return list(self.loader.boxed_run(list(flat)))

    def unflatten(self, outputs: list[Any]) -> Any:
        return pytree.tree_unflatten(outputs, self.out_spec)


# The package's own metadata (aot_inductor.metadata, read back by get_metadata) marks a weightless build, so a
# loader can refuse to run it before its weights are bound.
WEIGHTS_METADATA = "aotc_weights"
# ... and a train-step package (compiler/training.py), with the index of the upload's loss output: its flat outputs
# are [loss, other outputs, gradients], not the program's outputs, so a caller runs it flat (`run_flat`).
TRAIN_METADATA = "aotc_train_step_loss_output"


def train_step_loss_output(package: Any) -> int | None:
    """The loss output's index in the upload where `package` (a LoadedPackage) is a train step, else None."""
    try:
        value = package.get_metadata().get(TRAIN_METADATA)
    except Exception:  # noqa: BLE001 - torch's own loaders may lack metadata: then it is no train step of ours
        return None
    return int(value) if value is not None and str(value).isdigit() else None


def weightless_configs() -> dict[str, Any] | None:
    """The Inductor settings that build a package without its weights, where this torch has them (2.11 and 2.13
    do), else None: the package is built self-contained. `always_keep_tensor_constants` stops Inductor inlining
    small constants (any 0-d one, 1-d of 8 elements or fewer: graph.py `can_inline_constant`) as literals, which a
    package bound to other weights would silently ignore. Never `package_constants_on_disk_format`: its
    "pickle_weights" is pickle."""
    from torch._inductor import config

    if not hasattr(config.aot_inductor, "package_constants_in_so") or not hasattr(
            config, "always_keep_tensor_constants"):
        return None
    configs: dict[str, Any] = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}
    if hasattr(config.aot_inductor, "metadata"):
        configs["aot_inductor.metadata"] = {WEIGHTS_METADATA: "external"}
    if hasattr(config.aot_inductor, "package_constants_on_disk_format"):
        configs["aot_inductor.package_constants_on_disk_format"] = None
    return configs


def bind(package: Any, constants: dict[str, torch.Tensor]) -> None:
    """Bind weights into a loaded package, user-managed (the package uses these tensors, not copies)."""
    if isinstance(package, LoadedPackage):
        package.bind_constants(constants)
    else:  # torch's AOTICompiledModel
        package.load_constants(constants, check_full_update=True, user_managed=True)


def constant_fqns(package: Any) -> list[str]:
    return list(package.get_constant_fqns())


def aoti_load_package(package_path: str, device: str = "cpu", *, run_single_threaded: bool = False,
                      weights: dict[str, torch.Tensor] | None = None,
                      expect: list[dict[str, Any]] | None = None) -> Callable[..., Any]:
    """Load a package for `device` (cuda:N picks the GPU). Falls back to torch's own loader if the C++ loader's
    signature differs in this torch version. `run_single_threaded=True` loads it for CUDA graph capture.
    `weights` (FQN -> tensor on `device`) are bound into it; without them, a weights sidecar beside the package
    (compiler.weights.sidecar) is loaded and bound if there is one. `expect`: the spec every call's inputs are
    checked against (`LoadedPackage.expect`; a consumer passes the signed one)."""
    try:
        package: Any = LoadedPackage(package_path, device, run_single_threaded)
        if expect:
            package.expect(expect)
    except (AttributeError, TypeError):
        from torch._inductor import aoti_load_package as _load

        index = torch.device(device).index
        if device.startswith("cuda") and index is not None:
            package = _load(package_path, run_single_threaded=run_single_threaded, device_index=index)
        else:
            package = _load(package_path, run_single_threaded=run_single_threaded)
    _bind_weights(package, package_path, device, weights)
    return package


def _bind_weights(package: Any, package_path: str, device: str, weights: dict[str, torch.Tensor] | None) -> None:
    from compiler import weights as weights_mod

    if weights is None:
        side = weights_mod.sidecar(package_path)
        if not side.exists():
            return
        weights = weights_mod.load(side, device)
    bind(package, {k: weights[k] for k in constant_fqns(package) if k in weights})
    # the package holds raw pointers: keep the tensors alive as long as it is
    try:
        package._aotc_weights = weights
    except AttributeError:
        pass


def load_for_graphs(package_path: str, device: str, weights: dict[str, torch.Tensor] | None = None,
                    expect: list[dict[str, Any]] | None = None) -> LoadedPackage:
    """The package loaded in single-threaded mode with the flat-tensor interface CUDA graph capture needs, its
    weights bound as `aoti_load_package` binds them. Raises RuntimeError naming what this torch lacks when its
    loader cannot do that."""
    try:
        package = LoadedPackage(package_path, device, run_single_threaded=True)
    except (AttributeError, TypeError) as e:
        raise RuntimeError(f"torch {torch.__version__} has no AOTIModelPackageLoader(..., run_single_threaded, ...) "
                           f"to capture a package's run in a CUDA graph: {e}") from e
    if expect:
        package.expect(expect)
    _bind_weights(package, package_path, device, weights)
    return package


# The last torch checked for CUDA-graph support of its own in AOTInductor packages (none through this one).
CHECKED_NO_NATIVE_GRAPHS = (2, 13)


def native_graph_support() -> str | None:
    """The name of torch's own CUDA-graph support for AOTInductor packages, where this torch has one; None otherwise.

    torch 2.11 to 2.13 have none: `torch._inductor.config.aot_inductor` has no CUDA-graph option, the package loader
    only offers `run_single_threaded` ("useful to avoid conflicts with CUDAGraphs"), and cudagraph trees work on
    torch.compile's Python wrapper, not on a package. So aotc captures the single-threaded run itself. Up to the
    version checked, this answers without importing Inductor (seconds in a fresh process: the loader's cold start);
    a later torch is looked at."""
    if torch_version() <= CHECKED_NO_NATIVE_GRAPHS:
        return None
    from torch._inductor import config

    for name in ("use_cuda_graphs", "cuda_graphs", "cudagraphs"):
        if hasattr(config.aot_inductor, name):
            return f"torch._inductor.config.aot_inductor.{name}"
    return None
