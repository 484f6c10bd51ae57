"""Specialise an exported program to the requested shapes by re-exporting its module.

Static dims become constants; each requested range becomes a torch.export.Dim (one per exported symbol, so dims
that share a size keep sharing it) and stays dynamic in the compiled artifact. With a precision other than "keep",
weights are cast and floating inputs/outputs are cast at the graph's edges, so the artifact keeps the program's
interface while computing in bf16/fp16.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from compiler import inputs as inputs_mod
from compiler.compat import pytree
from compiler.errors import SpecError
from compiler.loading import on_device


def dynamic_shapes(spec: inputs_mod.Spec, program_inputs: list[dict[str, Any]]) -> list[dict[int, Any] | None]:
    dims: dict[str, torch.export.Dim] = {}
    out: list[dict[int, Any] | None] = []
    for inp, prog in zip(spec, program_inputs):
        per: dict[int, Any] = {}
        for j, d in enumerate(inp["shape"]):
            if isinstance(d, int):
                continue
            exported = prog["shape"][j]
            sym = (exported.get("symbol") if isinstance(exported, dict) else None) or f"{inp['name']}_{j}"
            name = "d_" + "".join(c if c.isalnum() else "_" for c in sym)
            if name not in dims:
                dims[name] = torch.export.Dim(name, min=d["min"], max=d["max"])
            per[j] = dims[name]
        out.append(per or None)
    return out


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cast_edges(module: torch.fx.GraphModule, dtype: torch.dtype) -> torch.fx.GraphModule:
    """Cast floating weights to `dtype`; insert casts after floating inputs and before floating outputs (back to
    the dtype each output had), so callers pass and get the same dtypes as before."""
    graph = module.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    out_dtypes = {}
    for n in out_node.all_input_nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            out_dtypes[n] = val.dtype
    module.to(dtype)
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype != dtype):
            continue
        with graph.inserting_after(ph):
            cast = graph.call_function(torch.ops.aten._to_copy.default, (ph,), {"dtype": dtype})
        ph.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    with graph.inserting_before(out_node):
        back = {n: graph.call_function(torch.ops.aten._to_copy.default, (n,), {"dtype": d})
                for n, d in out_dtypes.items() if d != dtype}
    out_node.args = tuple(pytree.tree_map(lambda a: back.get(a, a) if isinstance(a, torch.fx.Node) else a,
                                          out_node.args))
    graph.lint()
    module.recompile()
    return module


def drop_metadata_asserts(module: torch.nn.Module) -> torch.nn.Module:
    """`module` (an exported program's module) without its `aten._assert_tensor_metadata` nodes, in place. Export
    puts one before each `.to()`/`.float()` the model calls, asserting the dtype its input had at export; under a
    precision (autocast, or the edge casts) that input's dtype is the new one, and the assert would refuse a program
    that runs. The casts themselves (`aten.to`) stay: what `.float()` asks for still happens."""
    for gm in module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        found = [n for n in gm.graph.nodes
                 if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
        for n in found:
            gm.graph.erase_node(n)
        if found:
            gm.recompile()
    return module


# What a Python literal becomes (bool, int, float, under any default dtype), each exact through .item() and
# aten.scalar_tensor. Other 0-d constants (complex, float8, unsigned wider than a byte) stay constants, in the blob.
LITERAL_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                            torch.float16, torch.bfloat16, torch.float32, torch.float64})


def is_literal(t: torch.Tensor) -> bool:
    """A constant inline_literals makes an op of (and program_weights leaves out of the blob): 0-d, a literal's
    dtype, with a value."""
    return t.dim() == 0 and not t.is_meta and t.dtype in LITERAL_DTYPES


def inline_literals(module: torch.nn.Module) -> list[str]:
    """Replace each 0-d lifted tensor constant the graphs of `module` (an exported program's module) read with the op
    that makes it (`aten.scalar_tensor` of its value, dtype and device), in place; returns their names.

    Export lifts a Python number the model writes into a tensor as a constant: Swin's shifted-window mask sets nine
    slices of a fresh tensor to 0..8, which made 45 `lifted_tensor_N` constants in torchvision's swin_t. As
    constants they are weights to the pipeline: a weightless package reads them from the blob that no caller's
    state_dict holds, and a train-step package got Inductor's own `_tensor_constantN` for them, which no one binds
    (the check refused swin_t on an H100). As ops they are code, which is what a literal is. Parameters and
    buffers are never touched, whatever their shape."""
    owned = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    done: list[str] = []
    for gm in module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for n in [n for n in gm.graph.nodes if n.op == "get_attr"]:
            owner, _, attr = str(n.target).rpartition(".")
            holder = gm.get_submodule(owner) if owner else gm
            t = getattr(holder, attr, None)
            if not isinstance(t, torch.Tensor) or id(t) in owned or not is_literal(t):
                continue
            with gm.graph.inserting_before(n):
                made = gm.graph.call_function(torch.ops.aten.scalar_tensor.default, (t.item(),),
                                              {"dtype": t.dtype, "device": t.device})
            made.meta.update(n.meta)
            n.replace_all_uses_with(made)
            gm.graph.erase_node(n)
            if not any(u.op == "get_attr" and u.target == n.target for u in gm.graph.nodes):
                delattr(holder, attr)
            done.append(str(n.target))
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
    return done


class Autocast(torch.nn.Module):
    """`inner` run under torch.autocast, with inner's own parameters and buffers under their own FQNs (it shares
    inner's dicts rather than holding inner as a child, which would prefix every name). mode=training's precision
    (compiler/training.py): export traces the autocast casts into the graph, weights stay in their dtype."""

    def __init__(self, inner: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self._modules, self._parameters, self._buffers = inner._modules, inner._parameters, inner._buffers
        object.__setattr__(self, "_inner", inner)  # not a child: that would prefix every name
        self._autocast = (device_type, dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self._autocast[0], dtype=self._autocast[1]):
            return self.__dict__["_inner"](*args, **kwargs)


def autocast_module(inner: torch.nn.Module, device_type: str, dtype: torch.dtype) -> torch.nn.Module:
    """`Autocast(inner, ...)` whose forward has inner's signature: export matches inputs and dynamic shapes to the
    forward's parameters by name, which `*args` would hide."""
    def forward(self: Autocast, *args: Any, **kwargs: Any) -> Any:
        return Autocast.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.signature(type(inner).forward)  # type: ignore[attr-defined]
    cls = type("Autocast", (Autocast,), {"forward": forward})
    module: torch.nn.Module = cls(inner, device_type, dtype)
    return module


def specialize(
    ep: torch.export.ExportedProgram, spec: inputs_mod.Spec, program_inputs: list[dict[str, Any]], device: str,
    precision: str = "keep", autocast: bool = False,
) -> torch.export.ExportedProgram:
    """`autocast`: a precision other than "keep" means torch.autocast to it (mode=training), not casts."""
    ep = on_device(ep, device)
    module: torch.nn.Module = ep.module()
    inline_literals(module)  # before the casts: a literal keeps its own dtype, as eager's does
    if precision != "keep":
        drop_metadata_asserts(module)
    if precision != "keep" and autocast:
        module = autocast_module(module, "cuda" if device.startswith("cuda") else "cpu", PRECISIONS[precision])
    elif precision != "keep":
        cast_edges(module, PRECISIONS[precision])  # type: ignore[arg-type]
    module.to(device)
    shapes = inputs_mod.hint_shapes(spec, program_inputs)
    example = inputs_mod.random_inputs(spec, shapes, device, inputs_mod.int_ranges(ep))
    args, kwargs = inputs_mod.call_args(ep, example)
    ds_args, ds_kwargs = pytree.tree_unflatten(dynamic_shapes(spec, program_inputs), ep.call_spec.in_spec)
    ds: Any = None
    if any(d is not None for d in pytree.tree_leaves((ds_args, ds_kwargs),
                                                     is_leaf=lambda x: x is None or isinstance(x, dict))):
        ds = (tuple(ds_args) + tuple(ds_kwargs[k] for k in kwargs)) if kwargs else tuple(ds_args)
    try:
        return torch.export.export(module, args, kwargs or None, dynamic_shapes=ds, strict=False)
    except Exception as e:  # export explains constraint violations well; pass its words on
        raise SpecError(f"re-export at the requested shapes failed: {type(e).__name__}: {e}", stage="specialize") from e
