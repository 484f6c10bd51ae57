"""Inputs of requested shapes: example inputs for re-export and random inputs for the artifact check."""

from __future__ import annotations

from typing import Any

import torch

from compiler.compat import pytree

Spec = list[dict[str, Any]]


def points(spec: Spec) -> dict[str, list[list[int]]]:
    """Concrete shapes to check at: the one shape of a static spec; every range at its min and at its max."""
    shapes_min = [[d if isinstance(d, int) else d["min"] for d in i["shape"]] for i in spec]
    shapes_max = [[d if isinstance(d, int) else d["max"] for d in i["shape"]] for i in spec]
    return {"min": shapes_min} if shapes_min == shapes_max else {"min": shapes_min, "max": shapes_max}


def hint_shapes(spec: Spec, program_inputs: list[dict[str, Any]]) -> list[list[int]]:
    """A shape per input for re-export: ranges get a size inside them, distinct per symbol so torch's duck sizing
    does not merge dims the user declared independent, and never 0 or 1, which export would specialise."""
    hints: dict[str, int] = {}
    shapes: list[list[int]] = []
    for inp, prog in zip(spec, program_inputs):
        shape = []
        for j, d in enumerate(inp["shape"]):
            if isinstance(d, int):
                shape.append(d)
                continue
            exported = prog["shape"][j]
            sym = exported.get("symbol") if isinstance(exported, dict) else None
            key = sym or f"{inp['name']}.{j}"
            if key not in hints:
                taken = set(hints.values())
                v = max(d["min"], 2)
                while v in taken and v < d["max"]:
                    v += 1
                hints[key] = min(v, d["max"])
            shape.append(hints[key])
        shapes.append(shape)
    return shapes


def int_ranges(ep: torch.export.ExportedProgram) -> list[tuple[int, int] | None]:
    """Per user input, the [low, high) of the sample integer values the archive carries (token ids and the like),
    so random integer inputs stay in a range the model accepts."""
    try:
        flat, _ = pytree.tree_flatten(ep.example_inputs)
    except Exception:
        return []
    out: list[tuple[int, int] | None] = []
    for t in flat:
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.numel():
            out.append((int(t.min()), int(t.max()) + 1))
        else:
            out.append(None)
    return out


def random_inputs(
    spec: Spec, shapes: list[list[int]], device: str, ranges: list[tuple[int, int] | None], seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (inp, shape) in enumerate(zip(spec, shapes)):
        dtype = getattr(torch, inp["dtype"])
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        elif dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype.is_complex:
            t = torch.randn(shape, generator=gen, dtype=dtype)
        else:
            lo, hi = (ranges[k] if k < len(ranges) else None) or (0, 2)
            t = torch.randint(lo, max(hi, lo + 1), shape, generator=gen, dtype=dtype)
        out.append(t.to(device))
    return out


def call_args(ep: torch.export.ExportedProgram, flat: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild (args, kwargs) in the structure the program was exported with from the flat user inputs."""
    args, kwargs = pytree.tree_unflatten(flat, ep.call_spec.in_spec)
    return tuple(args), dict(kwargs)
