"""The joint forward/backward program of a training step, from an exported program whose outputs include the loss.

`torch.export.experimental._export_forward_backward(ep, joint_loss_index=i)` is private and marked unstable. Checked
on torch 2.13 (this box); the GPU workers run 2.11, where it has the same signature. Its program's outputs, in
`graph_signature.output_specs` order: BUFFER_MUTATION per mutated buffer (applied in place by an AOTInductor
package, never returned), LOSS_OUTPUT, USER_OUTPUT per other output, GRADIENT_TO_PARAMETER per parameter that needs
a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compiler.errors import CompileError

# The oldest torch whose joint export aotc has run (2.11 on the GPU workers); older ones may lack or differ.
OLDEST_CHECKED = (2, 11)


class JointUnavailable(CompileError):
    """This torch cannot build a joint forward/backward program (the private API is absent or older than checked)."""


class LossOutputError(CompileError):
    """The upload's outputs do not fit a training step: no such loss output, a loss that is not a scalar, or
    another output that needs a gradient."""


# Substrings of the ATen ops that draw random numbers: dropout (aten.dropout, native_dropout, feature_dropout...),
# rand/randn/randint/randperm(_like), bernoulli, normal, uniform, exponential, multinomial, poisson.
RANDOM_OP_WORDS = ("dropout", "rand", "bernoulli", "normal", "uniform", "exponential", "multinomial", "poisson")


def random_ops(ep: torch.export.ExportedProgram) -> list[str]:
    """Each node of the program that draws random numbers, as 'op (module path)': what a train step's check seeds
    (compiler.traincheck), and what its report names."""
    found = []
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        name = str(n.target)
        if not any(w in name for w in RANDOM_OP_WORDS):
            continue
        if "dropout" in name and len(n.args) > 1 and n.args[1] == 0.0:
            continue  # p=0: no draw
        if "dropout" in name and len(n.args) > 2 and n.args[2] is False:
            continue  # train=False
        stack = n.meta.get("nn_module_stack") or {}
        where = next(reversed(stack.values()))[0] if stack else n.name
        found.append(f"{name} ({where})")
    return found


def _version() -> tuple[int, int]:
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


def available() -> str | None:
    """None where this torch can build a joint program, else why not."""
    if _version() < OLDEST_CHECKED:
        return (f"torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_CHECKED))}, the oldest whose "
                "joint export aotc has checked")
    try:
        from torch.export.experimental import _export_forward_backward  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no torch.export.experimental._export_forward_backward ({e})"
    return None


@dataclass(frozen=True)
class Role:
    """One flat output of a train-step package: `loss`, `output:<i>` (a user output, by its index in the upload's
    outputs) or `grad:<fqn>`."""

    role: str
    index: int  # position in the package's flat outputs

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "index": self.index}


def joint_program(ep: torch.export.ExportedProgram, loss_output: int) -> torch.export.ExportedProgram:
    """The joint program of `ep` with output `loss_output` as the loss. Raises JointUnavailable or LossOutputError
    (a user's mistake, with what to change)."""
    why = available()
    if why is not None:
        raise JointUnavailable(why, stage="autograd")
    from torch.export.experimental import _export_forward_backward

    user = [s for s in ep.graph_signature.output_specs if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    if not 0 <= loss_output < len(user):
        raise LossOutputError(f"options.loss_output is {loss_output}, but the program has {len(user)} output(s) "
                              f"(0..{len(user) - 1})", stage="autograd")
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes}
    loss = vals.get(getattr(user[loss_output].arg, "name", ""))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        what = f"{loss.dtype} of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LossOutputError(f"output {loss_output} (options.loss_output) is the loss and must be a floating scalar; "
                              f"it is {what}", stage="autograd")
    try:
        return _export_forward_backward(ep, joint_loss_index=loss_output)
    except RuntimeError as e:
        if "requires gradients" in str(e):
            raise LossOutputError(f"an output other than the loss (output {loss_output}) needs a gradient: return "
                                  "the other outputs detached (out.detach()), or name the loss output in "
                                  f"options.loss_output. torch: {str(e)[:600]}", stage="autograd") from e
        raise


def roles(joint: torch.export.ExportedProgram) -> tuple[list[Role], list[str]]:
    """The roles of the package's flat outputs, in order, and the FQNs of the buffers it mutates in place."""
    kinds = torch.export.graph_signature.OutputKind
    out: list[Role] = []
    mutated: list[str] = []
    users = 0
    for s in joint.graph_signature.output_specs:
        if s.kind == kinds.BUFFER_MUTATION:
            mutated.append(str(s.target))
        elif s.kind == kinds.LOSS_OUTPUT:
            out.append(Role("loss", len(out)))
        elif s.kind == kinds.USER_OUTPUT:
            out.append(Role(f"output:{users}", len(out)))
            users += 1
        elif s.kind == kinds.GRADIENT_TO_PARAMETER:
            out.append(Role(f"grad:{s.target}", len(out)))
        else:
            raise LossOutputError(f"the joint program has an output of kind {s.kind.name} ({s.target}), which a "
                                  "train-step package does not support (user inputs' gradients, or mutated user "
                                  "inputs)", stage="autograd")
    return out, mutated
