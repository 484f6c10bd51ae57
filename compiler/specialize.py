"""Specialise an exported program to the requested shapes by re-exporting its module.

Static dims become constants; each requested range becomes a torch.export.Dim (one per exported symbol, so dims
that share a size keep sharing it) and stays dynamic in the compiled artifact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from compiler import inputs as inputs_mod
from compiler.errors import SpecError


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


def specialize(
    ep: torch.export.ExportedProgram, spec: inputs_mod.Spec, program_inputs: list[dict[str, Any]], device: str
) -> torch.export.ExportedProgram:
    module = ep.module()
    module.to(device)
    shapes = inputs_mod.hint_shapes(spec, program_inputs)
    example = inputs_mod.random_inputs(spec, shapes, device, inputs_mod.int_ranges(ep))
    args, kwargs = inputs_mod.call_args(ep, example)
    ds_args, ds_kwargs = pytree.tree_unflatten(dynamic_shapes(spec, program_inputs), ep.call_spec.in_spec)
    ds: Any = None
    if any(d is not None for d in pytree.tree_leaves((ds_args, ds_kwargs), is_leaf=lambda x: x is None or isinstance(x, dict))):
        ds = (tuple(ds_args) + tuple(ds_kwargs[k] for k in kwargs)) if kwargs else tuple(ds_args)
    try:
        return torch.export.export(module, args, kwargs or None, dynamic_shapes=ds, strict=False)
    except Exception as e:  # export explains constraint violations well; pass its words on
        raise SpecError(f"re-export at the requested shapes failed: {type(e).__name__}: {e}", stage="specialize") from e
