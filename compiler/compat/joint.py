"""The joint forward/backward program of a training step, from an exported program whose outputs include the loss.

`torch.export.experimental._export_forward_backward(ep, joint_loss_index=i)` is private and marked unstable. Checked
on torch 2.13 (this box); the GPU workers run 2.11, where it has the same signature. Its program's outputs, in
`graph_signature.output_specs` order: BUFFER_MUTATION per mutated buffer (applied in place by an AOTInductor
package, never returned), LOSS_OUTPUT, USER_OUTPUT per other output, GRADIENT_TO_PARAMETER per parameter that needs
a gradient.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch

from compiler.compat import torch_version
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


def available() -> str | None:
    """None where this torch can build a joint program, else why not."""
    if torch_version() < OLDEST_CHECKED:
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


def _submodule(gm: torch.fx.GraphModule, n: torch.fx.Node) -> tuple[int, torch.fx.GraphModule] | None:
    """(position in n.args, the graph) of the subgraph a higher-order op `n` calls (wrap_with_autocast,
    wrap_with_set_grad_enabled, ...), else None."""
    if n.op != "call_function":
        return None
    for i, a in enumerate(n.args):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(gm, str(a.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                return i, sub
    return None


def _sources(gm: torch.fx.GraphModule, starts: list[torch.fx.Node]) -> set[str]:
    """Names of `gm`'s placeholders that the values `starts` depend on through ops a gradient flows through: not
    through `detach`, a value that is not floating, or a region traced under no_grad. A higher-order op's subgraph
    (export wraps an autocast region in one) is followed output by output, so a pooler computed inside the region
    and returned from it only to be detached is not counted."""
    no_grad_region = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    seen: set[tuple[str, int | None]] = set()
    found: set[str] = set()
    stack: list[tuple[torch.fx.Node, int | None]] = [(n, None) for n in starts]
    while stack:
        n, k = stack.pop()
        if (n.name, k) in seen:
            continue
        seen.add((n.name, k))
        if n.op == "placeholder":
            found.add(n.name)
            continue
        if n.op != "call_function" or n.target is torch.ops.aten.detach.default:
            continue
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
            continue
        first = n.args[0] if n.args else None
        if n.target is operator.getitem and isinstance(first, torch.fx.Node) and _submodule(gm, first) is not None:
            stack.append((first, int(n.args[1])))  # type: ignore[arg-type]
            continue
        called = _submodule(gm, n)
        if called is None:
            stack += [(a, None) for a in n.all_input_nodes]
            continue
        if n.target is no_grad_region and n.args[0] is False:
            continue
        at, sub = called
        operands = n.args[at + 1:]
        out = sub.graph.output_node().args[0]
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        picked = outs if k is None else outs[k:k + 1]
        inner = _sources(sub, [o for o in picked if isinstance(o, torch.fx.Node)])
        placeholders = [p.name for p in sub.graph.nodes if p.op == "placeholder"]
        stack += [(o, None) for o, name in zip(operands, placeholders, strict=False)
                  if name in inner and isinstance(o, torch.fx.Node)]
    return found


def no_gradient(ep: torch.export.ExportedProgram, loss_output: int) -> list[str]:
    """FQNs of the parameters the loss does not depend on, whose `.grad` eager's `loss.backward()` leaves None: a
    pooler whose output nothing uses (BERT's, under a head of the user's own), a head that feeds only a detached
    output (`_sources`)."""
    user = [s for s in ep.graph_signature.output_specs if s.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
    start = next((n for n in ep.graph.nodes if n.name == getattr(user[loss_output].arg, "name", "")), None)
    reached = _sources(ep.graph_module, [start] if start is not None else [])
    return [fqn for name, fqn in ep.graph_signature.inputs_to_parameters.items() if name not in reached]


def joint_program(ep: torch.export.ExportedProgram, loss_output: int) -> torch.export.ExportedProgram:
    """The joint program of `ep` with output `loss_output` as the loss. Raises JointUnavailable or LossOutputError
    (a user's mistake, with what to change). A parameter the loss does not depend on (`no_gradient`) gets no
    gradient output, as eager gives it no `.grad`: AOTAutograd asserts that every input requiring grad receives one,
    so its placeholder's traced value is marked as not requiring grad for the trace (and marked back after)."""
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
    untrained = set(no_gradient(ep, loss_output))
    names = {name for name, fqn in ep.graph_signature.inputs_to_parameters.items() if fqn in untrained}
    marked = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder" and n.name in names
              and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].requires_grad]
    try:
        for v in marked:
            v.requires_grad_(False)
        joint = _fused_cpu_attention_joint(ep, loss_output) if attends_on_cpu(ep) else None
        if joint is None:
            joint = _export_forward_backward(ep, joint_loss_index=loss_output)
        misfed = misfed_cpu_attention(joint)
        if misfed:
            raise JointUnavailable(f"torch {torch.__version__}'s joint export hands the CPU attention kernel's "
                                   f"backward the attention weights for its logsumexp (at {', '.join(misfed)}): its "
                                   "gradients would be wrong. Build the train step on a torch whose joint export "
                                   "keeps that kernel (compiler.compat.joint), or on CUDA", stage="autograd")
        return joint
    except RuntimeError as e:
        if "requires gradients" in str(e):
            raise LossOutputError(f"an output other than the loss (output {loss_output}) needs a gradient: return "
                                  "the other outputs detached (out.detach()), or name the loss output in "
                                  f"options.loss_output. torch: {str(e)[:600]}", stage="autograd") from e
        raise
    finally:
        for v in marked:
            v.requires_grad_(True)


# torch/_decomp/decompositions.py decomposes `_scaled_dot_product_flash_attention_for_cpu` (what SDPA runs as on a
# CPU) into its math form, for export, and returns the attention weights in the place of the kernel's logsumexp.
# `_export_forward_backward` applies that decomposition to the forward but keeps the kernel's own derivative,
# `..._for_cpu_backward`, which then reads the weights as a logsumexp. Every gradient through the attention is wrong
# (a SegFormer-B0 train step on torch 2.13's CPU, float32: its stage-0 gradients 1e9 times their scale away from
# eager's; the joint program itself, run op by op, before any Inductor), and in bf16 the backward refuses the bf16
# weights (`expected scalar type Float but found BFloat16`). The check refused those packages; the joint is now built
# with that one decomposition left out, so the kernel runs forward and backward as in eager (AOTInductor calls both
# through its C shims). Its derivative needs the real logsumexp, of shape (batch, heads, queries).
CPU_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"


def training_decompositions() -> Any:
    """Core ATen's decompositions less the CPU attention kernel's (above): for every trace that differentiates (this
    joint, and compiler.compat.autograd's for the report)."""
    from torch._decomp import core_aten_decompositions

    table = core_aten_decompositions()
    table.pop(getattr(torch.ops.aten, CPU_ATTENTION).default, None)
    return table


def attends_on_cpu(ep: torch.export.ExportedProgram) -> bool:
    """Whether the program calls scaled_dot_product_attention (or the CPU kernel) on CPU tensors, in its graph or a
    subgraph (autocast's): only those take `_fused_cpu_attention_joint`; the rest keep torch's own joint, the path
    the GPU runs proved."""
    ops = {torch.ops.aten.scaled_dot_product_attention.default, getattr(torch.ops.aten, CPU_ATTENTION).default}
    calls = (n for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
             if n.op == "call_function" and n.target in ops and n.args and isinstance(n.args[0], torch.fx.Node))
    return any(isinstance(q := n.args[0].meta.get("val"), torch.Tensor) and q.device.type == "cpu" for n in calls)


def _fused_cpu_attention_joint(ep: torch.export.ExportedProgram,
                               loss_output: int) -> torch.export.ExportedProgram | None:
    """`_export_forward_backward(ep, loss_output)` with core ATen's decompositions less the CPU attention kernel's;
    None where this torch's private pieces differ (the caller then builds the stock joint, and checks it)."""
    try:
        from torch.export.experimental import _copy_graph_module_and_signature, _remove_detach_pass
        from torch.export.exported_program import _decompose_exported_program
    except ImportError:
        return None
    try:
        decomposed = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=training_decompositions(),
                                                 joint_loss_index=loss_output, decompose_custom_triton_ops=False)
    except TypeError:  # another signature: this torch's stock joint, checked by the caller
        return None
    gm, signature = _copy_graph_module_and_signature(decomposed)
    _remove_detach_pass(gm, signature)
    return decomposed._update(gm, signature)


def misfed_cpu_attention(joint: torch.export.ExportedProgram) -> list[str]:
    """The joint's CPU attention backward nodes whose logsumexp argument is not a (batch, heads, queries) tensor:
    torch's decomposed forward handed them the attention weights (above)."""
    backward = getattr(torch.ops.aten, f"{CPU_ATTENTION}_backward").default
    bad = []
    for n in joint.graph.nodes:
        if n.op == "call_function" and n.target is backward:
            lse = n.args[5].meta.get("val") if isinstance(n.args[5], torch.fx.Node) else None
            q = n.args[1].meta.get("val") if isinstance(n.args[1], torch.fx.Node) else None
            if not (isinstance(lse, torch.Tensor) and isinstance(q, torch.Tensor) and lse.dim() == 3
                    and lse.dtype == torch.float32 and list(lse.shape) == list(q.shape[:3])):
                bad.append(n.name)
    return bad


def run_op_by_op(joint: torch.export.ExportedProgram, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The joint program's graph run with ATen's kernels on its own weights, no Inductor: its outputs in
    `output_specs` order less the buffer mutations (what a package returns; the module's `__call__` fails on the
    joint's out-spec). What tells the export path's arithmetic from Inductor's (bench/train_numerics.py, tests)."""
    kinds = torch.export.graph_signature
    user = iter(args)
    flat = [next(user) if s.kind == kinds.InputKind.USER_INPUT
            else joint.state_dict[s.target] if s.target in joint.state_dict else joint.constants[s.target]
            for s in joint.graph_signature.input_specs]
    with torch.no_grad():
        outs = joint.graph_module(*flat)
    return [o for o, s in zip(outs, joint.graph_signature.output_specs, strict=True)
            if s.kind != kinds.OutputKind.BUFFER_MUTATION]


def untrained(joint: torch.export.ExportedProgram) -> list[str]:
    """The joint program's parameters with no gradient output (`no_gradient`'s), in input order."""
    kinds = torch.export.graph_signature.OutputKind
    grads = {s.target for s in joint.graph_signature.output_specs if s.kind == kinds.GRADIENT_TO_PARAMETER}
    return [p for p in joint.graph_signature.parameters if p not in grads]


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
