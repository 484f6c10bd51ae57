"""AOTAutograd for mode=training: the joint forward/backward graph and its partition.

aot_function and min_cut_rematerialization_partition (the partitioner Inductor uses) are torch._functorch APIs,
stable in name since torch 2.0, and FakeTensorMode is what AOTAutograd itself traces with. The joint graph is what
the partitioner receives.
"""

from __future__ import annotations

from typing import Any

import torch

from compiler.compat import pytree
from compiler.compat.joint import training_decompositions
from compiler.errors import first_line


def aot_joint_and_partition(module: torch.nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> tuple[dict[str, torch.fx.GraphModule], str]:
    """Trace forward and backward of `module` through AOTAutograd with the core ATen decompositions (less the CPU
    attention kernel's, compiler.compat.joint.training_decompositions); returns the joint graph and its
    forward/backward partition, and where the trace ran. AOTAutograd compiles the backward when it is first needed,
    so one forward and one backward (on the sum of the outputs) run: on fake copies of `args` and of the module's
    weights, so that nothing runs on the device and nothing of the module changes (a real run here updated
    BatchNorm's statistics, and was where two models' CUDA errors surfaced, on graphs only the report shows). The
    graphs are those a real run traces. Where the fake trace fails (an op whose output size depends on values,
    which fake tensors cannot know without a shape environment), the real run traces them on a CPU, as before. On
    CUDA it does not: that would run the upload's step on the device in the compile's own process, where a
    device-side assert (EVA02's, on an H200) ends the CUDA context that the compile's later stages need; the
    fake trace's error is raised instead, and the report says its graphs are unavailable."""
    try:
        return _trace(module, args, kwargs, fake=True), "fake tensors"
    except Exception as e:  # noqa: BLE001 - any failure of the fake trace: the real run is the old, proven path
        why = first_line(e)
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (*args, *kwargs.values())):
            raise RuntimeError(f"the fake-tensor trace failed ({why}); on CUDA the report does not run the step on "
                               "the device instead") from e
    return _trace(module, args, kwargs, fake=False), f"the inputs' device (fake tensors failed: {why})"


def _trace(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
           fake: bool) -> dict[str, torch.fx.GraphModule]:
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode

    got: dict[str, torch.fx.GraphModule] = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        got["joint"] = joint
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        got["forward"], got["backward"] = fw, bw
        return fw, bw

    def boxed(gm: torch.fx.GraphModule) -> Any:
        def run(args_list: list[Any]) -> Any:
            a = list(args_list)
            args_list.clear()
            return gm(*a)

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's boxed calling convention
        return run

    params: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    buffers: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
    if fake:
        # allow_non_fake_inputs: the program's lifted constants are module attributes, neither parameters nor buffers
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        params = {k: mode.from_tensor(v) for k, v in params.items()}
        buffers = {k: mode.from_tensor(v) for k, v in buffers.items()}
        args, kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (tuple(args), dict(kwargs)))

    def functional(named_params: dict[str, Any], named_buffers: dict[str, Any], *a: Any, **kw: Any) -> Any:
        return torch.func.functional_call(module, {**named_params, **named_buffers}, a, kw)

    compiled = aot_function(functional, fw_compiler=lambda gm, ex: boxed(gm), bw_compiler=lambda gm, ex: boxed(gm),
                            partition_fn=partition, decompositions=training_decompositions(),
                            num_params_buffers=len(params) + len(buffers))
    # Not inside the fake mode: fake tensors dispatch to it by themselves, and AOTAutograd deep-copies the backward
    # graph with the program's real constants in it when it compiles it, which a real tensor cannot do inside it.
    with torch.enable_grad():
        out = compiled(params, buffers, *args, **kwargs)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward([t.sum() for t in leaves])
    return got
