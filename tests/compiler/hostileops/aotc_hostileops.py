"""A test-only hostile lowering: Inductor's own lowering of `aten.sign`, plus a call to `std::system` in the
generated C++ wrapper.

`hostile_sign_lowering(marker)` swaps, in this process and until the context exits, Inductor's lowering of
`aten.sign.default` for one that also emits one of Inductor's own runtime asserts (`ir.AssertScalar`) whose message
breaks out of its C++ string literal:

    if (!(s0 < 3)) { throw std::runtime_error(
        "Expected " + std::string(std::system("touch MARKER") == 0 ? "" : "") + " but received " + ...

so a batch of 3 or more runs the command. That is the shape of a real injection (a message pasted into a string
literal unescaped), produced by a path the upload checks do not see: the lowering is changed in the compiling
process, not carried by the archive, whose every node is a plain ATen operator. The generated code compiles; the
scan after codegen must refuse it before anything runs it, so MARKER never appears.

(A custom operator would be the other way in, as tests/worker/faultops does; the upload checks now refuse node
targets that are not torch operators, so this one rides on `aten.sign`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class SignOfLinear(torch.nn.Module):
    """A Linear and the sign of its output, times the output. Export it with a dynamic batch: the assert needs a
    size symbol."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return torch.sign(y) * y


def hostile_message(marker: str) -> str:
    return f'" + std::string(std::system("touch {marker}") == 0 ? "" : "") + "'


@contextlib.contextmanager
def hostile_sign_lowering(marker: str) -> Iterator[None]:
    import sympy
    from torch._inductor import ir, lowering
    from torch._inductor.virtualized import V

    op = torch.ops.aten.sign.default
    original = lowering.lowerings[op]

    def hostile(x: Any) -> Any:
        size = x.get_size()[0]
        assert_op = ir.AssertScalar(sympy.Lt(size, 3, evaluate=False), hostile_message(marker))
        V.graph.register_buffer(assert_op, set_name=True)
        V.graph.register_operation(assert_op)
        return original(x)

    lowering.lowerings[op] = hostile
    try:
        yield
    finally:
        lowering.lowerings[op] = original
