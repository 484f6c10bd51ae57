"""A train-step package (mode=training) bound to the caller's live parameters: `loss, outputs = step(batch)`.

One call runs forward and backward in the package. It reads the parameters and buffers the caller holds, by
pointer (bound user-managed: nothing is copied), so an optimizer's in-place update is what the next step sees;
it updates the mutated buffers (BatchNorm's running statistics) in place; and it ACCUMULATES each parameter's
gradient into `.grad` as `loss.backward()` does (set where `.grad` is None, added where it is not), so
`optimizer.zero_grad()` and gradient accumulation work unchanged. The roles of the package's outputs come from its
signed manifest (the check's `training` block), never from the service's record.

Bound by pointer means: keep the module alive while the step is used, and do not replace a parameter's storage
(`model.to(...)`, `p.data = ...`, loading a state dict that swaps tensors): load the step again after that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from compiler.compat.aoti import LoadedPackage


class TrainStepError(ValueError):
    """The caller's module or tensors do not fit the train-step package (named, with what the package expects)."""


def live_tensors(model_or_tensors: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FQN -> the tensor the caller holds: a module's parameters and buffers, or a mapping of live tensors
    (`{**dict(m.named_parameters()), **dict(m.named_buffers())}`; a `state_dict()` shares storage too, but its
    tensors are detached, so the gradients would land where no optimizer looks)."""
    if isinstance(model_or_tensors, torch.nn.Module):
        out: dict[str, torch.Tensor] = dict(model_or_tensors.named_parameters(remove_duplicate=False))
        out.update(dict(model_or_tensors.named_buffers(remove_duplicate=False)))
        return out
    return dict(model_or_tensors)


class TrainStep:
    """`loss, outputs = step(*batch)`: one training step of the package on the bound tensors (see the module)."""

    def __init__(self, package_path: str, manifest: Mapping[str, Any], constants: Sequence[Mapping[str, Any]],
                 model_or_tensors: torch.nn.Module | Mapping[str, torch.Tensor], device: str = "cpu",
                 expect: list[dict[str, Any]] | None = None) -> None:
        self.manifest = dict(manifest)
        live = live_tensors(model_or_tensors)
        where = torch.device(device)
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", 0)
        self.package = LoadedPackage(package_path, str(where))
        if expect:  # the signed spec: a batch of another shape must not be read past its end (LoadedPackage.expect)
            self.package.expect(expect)
        fqns = self.package.get_constant_fqns()
        signed = {str(c["fqn"]): c for c in constants}
        bind: dict[str, torch.Tensor] = {}
        for fqn in fqns:
            t = live.get(fqn)
            if t is None:
                raise TrainStepError(f"the package reads {fqn!r}, which the given module has no parameter or buffer "
                                     "of (was it exported from another module?)")
            want = signed.get(fqn)
            if want is not None and (list(t.shape) != list(want["shape"])
                                     or str(t.dtype).removeprefix("torch.") != want["dtype"]):
                raise TrainStepError(f"{fqn!r} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}; the "
                                     f"package was built for {want['dtype']} {list(want['shape'])}")
            if t.device != where:
                raise TrainStepError(f"{fqn!r} is on {t.device}; the package runs on {device}: move the module "
                                     "first, then load the step")
            if not t.is_contiguous():
                raise TrainStepError(f"{fqn!r} is not contiguous; the package reads it as a dense tensor")
            bind[fqn] = t.detach()
        self.package.bind_constants(bind)
        self._bound = bind  # the package holds raw pointers: keep the tensors alive as long as it is
        self.grads: list[tuple[torch.Tensor, int]] = []
        self.outputs: list[int] = []
        self.loss = -1
        for r in self.manifest.get("outputs", []):
            role, index = str(r["role"]), int(r["index"])
            if role == "loss":
                self.loss = index
            elif role.startswith("output:"):
                self.outputs.append(index)
            elif role.startswith("grad:"):
                p = live.get(role.removeprefix("grad:"))
                if p is None:
                    raise TrainStepError(f"the package returns a gradient for {role[5:]!r}, which the given module "
                                         "has no parameter of")
                self.grads.append((p, index))
        if self.loss < 0:
            raise TrainStepError("the package's manifest names no loss output")

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        flat = self.package.run_flat(self.package.flat_inputs(args, kwargs))
        with torch.no_grad():
            for p, i in self.grads:
                if p.grad is None:
                    p.grad = flat[i]
                else:
                    p.grad.add_(flat[i])
        return flat[self.loss], tuple(flat[i] for i in self.outputs)
