"""mode=training: a train-step package, built from the joint forward/backward program of the upload.

The upload is an exported program whose outputs include a floating scalar loss (`options.loss_output`, default 0);
its other outputs must not need a gradient (returned detached). compiler.compat.joint turns it into the joint
program, and the one Inductor compile (compiler.stages.inductor) builds it weightless, as inference packages are
(compiler/weights.py), with `TRAINING_INDUCTOR_CONFIGS` added. A caller binds its LIVE parameters and buffers
(user-managed) and one boxed run of the package is one training step:

    flat outputs  [loss, output:0, output:1, ..., grad:<fqn>, ...]   (`roles`, in this order)
    in place      every mutated buffer (BatchNorm's running_mean, running_var, num_batches_tracked)

The roles and the mutated buffers are the package's training manifest; the check (compiler/traincheck.py) proves
them against eager and the worker signs them inside the check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from compiler.compat import joint as joint_mod
from compiler.stages import Captured


@dataclass
class JointBuild:
    captured: Captured  # the joint program, in the shape compiler.stages.inductor takes
    roles: list[joint_mod.Role]
    mutated: list[str]
    no_grad: list[str]

    def manifest(self, loss_output: int) -> dict[str, Any]:
        return manifest(self.roles, self.mutated, loss_output, self.no_grad)


def manifest(roles: list[joint_mod.Role], mutated: list[str], loss_output: int,
             no_grad: list[str] | None = None) -> dict[str, Any]:
    """What a client needs to run a package as a step: the role of each flat output, the buffers it updates, and the
    parameters the loss does not depend on (no gradient, as eager leaves their `.grad` None)."""
    return {"loss_output": loss_output, "outputs": [r.to_json() for r in roles], "mutated_buffers": list(mutated),
            "no_grad": list(no_grad or [])}


def joint(captured: Captured, loss_output: int) -> JointBuild:
    """The joint program of the captured (bounded, specialised) program, with its roles."""
    program = joint_mod.joint_program(captured.program, loss_output)
    roles, mutated = joint_mod.roles(program)
    return JointBuild(replace(captured, program=program), roles, mutated, joint_mod.untrained(program))


def snapshot(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """Copies of the program's buffers. Tracing a training-mode program for real (the autograd stage's facts, the
    joint export) runs BatchNorm, which updates the running statistics of the program's own tensors; the package's
    weights blob must hold the upload's values, so `restore` puts these back."""
    return {k: v.detach().clone() for k, v in program.state_dict.items() if k in program.graph_signature.buffers}


def restore(saved: dict[str, torch.Tensor], *programs: torch.export.ExportedProgram) -> None:
    with torch.no_grad():
        for program in programs:
            for k, v in saved.items():
                t = program.state_dict.get(k)
                if isinstance(t, torch.Tensor):
                    t.copy_(v)
