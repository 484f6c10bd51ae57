"""AOTAutograd for mode=training: the joint forward/backward graph and its partition.

aot_module and min_cut_rematerialization_partition (the partitioner Inductor uses) are torch._functorch APIs,
stable in name since torch 2.0. The joint graph is what the partitioner receives.
"""

from __future__ import annotations

from typing import Any

import torch

from compiler.compat import pytree
from compiler.compat.joint import training_decompositions


def aot_joint_and_partition(module: torch.nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> dict[str, torch.fx.GraphModule]:
    """Trace forward and backward of `module` through AOTAutograd with the core ATen decompositions (less the CPU
    attention kernel's, compiler.compat.joint.training_decompositions); returns the
    joint graph and its forward/backward partition. Runs one forward and one backward (on sum of outputs) on
    `args`, because AOTAutograd compiles the backward when it is first needed."""
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.partitioners import min_cut_rematerialization_partition

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

    compiled = aot_module(module, fw_compiler=lambda gm, ex: boxed(gm), bw_compiler=lambda gm, ex: boxed(gm),
                          partition_fn=partition, decompositions=training_decompositions())
    with torch.enable_grad():
        out = compiled(*args, **kwargs)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward([t.sum() for t in leaves])
    return got
