"""The prims view: the program traced down to prims.

torch._prims.context.TorchRefsMode maps ATen calls to their torch._refs implementations, which are written in
prims; make_fx records the result. Private, and not every op has a ref: those stay as ATen in the view.
"""

from __future__ import annotations

from typing import Any

import torch


def prims_graph(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    from torch._prims.context import TorchRefsMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def run(*a: Any) -> Any:
        return module(*a, **kwargs)

    with TorchRefsMode(strict=False):
        return make_fx(run, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
