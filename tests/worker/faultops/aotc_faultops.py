"""Custom operators that break the compiler for real, for the fault tests.

`aotc_faultops::segv` and `aotc_faultops::hang` compute `x.clone()` when run, but their fake (meta) kernels,
which torch calls while tracing, misbehave when Inductor is on the stack, that is in the `compile` stage:
`segv` dereferences a NULL pointer through ctypes (a real SIGSEGV in native code) and `hang` never returns.
Export and the `specialize` re-export run them fine, so the archive uploads and loads like any model's.

A custom op must be registered in every process that loads a program using it, as with custom ops in
production: the fault tests put this folder on the worker's PYTHONPATH, whose `sitecustomize` imports this module
in the worker and in each compile child. No hook in aotc itself is involved.
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch


def _inductor_on_stack() -> bool:
    f = sys._getframe(1)
    while f is not None:
        if "/torch/_inductor/" in f.f_code.co_filename:
            return True
        f = f.f_back
    return False


@torch.library.custom_op("aotc_faultops::segv", mutates_args=())
def segv(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@segv.register_fake
def _segv_fake(x: torch.Tensor) -> torch.Tensor:
    if _inductor_on_stack():
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return torch.empty_like(x)


@torch.library.custom_op("aotc_faultops::hang", mutates_args=())
def hang(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@hang.register_fake
def _hang_fake(x: torch.Tensor) -> torch.Tensor:
    while _inductor_on_stack():
        time.sleep(1.0)
    return torch.empty_like(x)


class Faulty(torch.nn.Module):
    """A Linear followed by one of the ops above."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(torch.ops.aotc_faultops, self.op)(self.lin(x))
