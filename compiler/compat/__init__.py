"""The one place aotc touches torch APIs that are private or moved between versions.

aotc runs on torch 2.13 (the CPU build in CI) and torch 2.11 (the GPU workers). Code elsewhere in compiler/, worker/
and client/ uses only these adapters and torch's public API; an adapter does the version check it needs:

    aoti        build and load AOTInductor packages
    safe_load   the guard around torch.export.load for untrusted archives
    graphs      reading FX graphs: op names, histograms, in-place ops, provenance
    observe     watching the one Inductor compile that builds the package, through its hooks
    autograd    AOTAutograd's joint graph and its forward/backward partition (mode=training)
    prims       the program traced to prims (the report's prims view)
    caches      what Inductor does with its caches; the max-autotune timings file

A torch-private module is imported inside the function that needs it, so a torch that lacks it fails that call
(where the caller records the stage as unavailable or falls back), never the import of the adapter.
"""

from __future__ import annotations

import importlib
import types

import torch
import torch.utils._pytree as _pytree

# torch's pytree utilities are private by name but stable across 2.11-2.13; every other module takes them from here.
pytree = _pytree


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major, minor


# Inductor wrapped a negative id as Python indexing does (`weight[-1]`, the last row) where eager raises IndexError:
# in `aten.embedding`'s lowering, and in the gather of nll_loss's decomposition (a class target of -1), until
# pytorch/pytorch#184107 (merged 2026-05-23: `indirect_indexing(..., wrap_neg=False)`; torch 2.13 has it, 2.11 has
# not). A wrapped id stays inside the table, so it reads no foreign memory, but the package returns where eager
# refuses. On a torch before it, compiler.bounds moves negative ids out of range, where the index assert every compile
# forces fires. Seen on an H100, torch 2.11: DistilBERT's train step returned at id -1, and every classifier's at
# label -1, and each failed the adversarial check.
INDUCTOR_WRAPS_NEGATIVE_IDS = torch_version() < (2, 13)


def optional_module(name: str) -> types.ModuleType | None:
    """The module `name`, or None where this torch lacks it (or it fails to import)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dst.copy_(src, non_blocking=True)` for every pair, in one call: torch._foreach_copy_ (private by name, in
    2.11-2.13) launches one multi-tensor kernel for the pairs that share a device and dtype, where a copy each
    launches one kernel each: what a CUDA graph's replay does before and after it, per call (compiler.cudagraphs).
    A torch without it copies one by one."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=True)
    elif dsts:
        foreach(dsts, srcs, non_blocking=True)
